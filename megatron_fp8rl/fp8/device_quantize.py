"""Quantization on the device path: each quantizer of fp8/quantizer.py run by the fused Triton kernels.

Owns: `device_quantize(quantizer, x, transposed)` (the same codes, scales, scaling-state updates
and statistics as `quantizer.quantize(x)` on the CPU, bit for bit, without a host
synchronization), `device_quantize_weight` (the same with the weight-quantization cache),
`DeviceQuantStats` (statistics left on the device until a logger reads them) and
`check_device_recipe` / `check_device_quantizer` (combinations without a device kernel, refused by
name). fp8/device_linear.py calls it; tensors are CUDA ones, or CPU ones under TRITON_INTERPRET=1
(the tests).
Per quantizer (x [M, K], one kernel pass writing codes, statistics and, optionally, the copy
the backward reads: per tensor and 128x128 blocks the transposed codes, 1xG groups a column-wise
quantization of x^T in 1xG groups, i.e. Gx1 groups of x). Per-tensor scales and every scaling-state
update run in one small kernel (fp8/triton_scaling.py), so a quantization is at most three launches:
- CurrentQuantizer: the amax pass (each row's finite max |x|), the scale kernel (which also zeroes
  the statistics counters), the quantize pass;
- DelayedQuantizer: zeroed counters, the quantize pass with the state's scale (it also writes each
  program's max |x| for the amax history), the history and scale update;
- CalibratedQuantizer ('max' criterion): weights as CurrentQuantizer (the bound all-reduced);
  activations: an amax pass that also counts overflow under the predicted scale, the decision,
  scale and history update in the scale kernel, the quantize pass;
- BlockQuantizer: one pass, scales computed in the kernel (1xG groups, GxG blocks), and the counters;
- StaticQuantizer: the counters and the quantize pass with the fixed scale (its observer runs too).
With an amax-reduction group of more than one rank the scale kernel runs twice around the
all-reduce (fp8/triton_scaling.py).
Weight cache: `device_quantize_weight` reuses a weight's quantization while (data_ptr,
tensor._version, quantizer.weights_generation()) is unchanged; the optimizer step and weight loads
call `quantizer.weights_updated()`. A calibrated weight's cache hit still records its bound and
rolls its history as a fresh quantization does (one launch), but skips the bound's all-reduce
(every rank hits and misses at the same calls). A delayed-scaling weight is quantized once per
weight change, with the state's scale at that moment, and its amax recorded then; hits leave the
state alone, as Transformer Engine's cached FP8 weights do between optimizer steps (the CPU path,
fp8/quantizer.py, quantizes it at every call). Weights with a predicted calibrated scale
(`calibrate_weights_every_step=False`) change scale at every call and are never cached. A no-grad
pass caches the weight without its transposed copy; the first pass that needs it adds it.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch; triton through
fp8/triton_quantize.py and fp8/triton_scaling.py, imported at the first quantization so importing
this module stays cheap).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fp8rl.fp8 import recipe as recipes
from megatron_fp8rl.fp8.formats import Fp8Format
from megatron_fp8rl.fp8.quantize import Fp8Tensor, scale_from_bound
from megatron_fp8rl.fp8.quantizer import (
    BlockQuantizer,
    CalibratedQuantizer,
    CurrentQuantizer,
    DelayedQuantizer,
    StaticQuantizer,
    _on_device,
    weights_generation,
)
from megatron_fp8rl.fp8.scaling import all_reduce_max_
from megatron_fp8rl.fp8.stats import QuantStats

GROUP_WIDTHS = (32, 128)
"""Scale group widths along K the device path has kernels and GEMMs for (1xG, GxG)."""


class DeviceQuantStats:
    """A quantization's statistics as the kernel left them: int64 counters on the device, turned
    into a `QuantStats` (same fields, same definitions as fp8/stats.py) only when read, so a call
    never waits for them; a logger reads them once per logged step (`as_floats()`)."""

    def __init__(self, counts: torch.Tensor, numel: int, scales: torch.Tensor, fmt: Fp8Format,
                 recalibrated: torch.Tensor, scales_are_inverse: bool = False):
        self.counts, self.numel, self.scales, self.fmt = counts, numel, scales, fmt
        self.recalibrated_flag, self.scales_are_inverse = recalibrated, scales_are_inverse

    def materialize(self) -> QuantStats:
        """The statistics as a QuantStats of device tensors (a few small device ops, no sync)."""
        saturated, underflow, nonzero, nonfinite, _ = self.counts.unbind()
        scale = self.scales.float()
        smallest = (scale.reciprocal() if self.scales_are_inverse else scale).min()
        return QuantStats(bound=self.fmt.max / smallest, scale=smallest,
                          saturated_fraction=saturated.float() / max(self.numel, 1),
                          underflow_fraction=underflow.float() / nonzero.clamp(min=1).float(),
                          nonfinite_count=nonfinite, recalibrated=self.recalibrated_flag.float())

    def __getattr__(self, name):
        if name in QuantStats.__dataclass_fields__:
            return getattr(self.materialize(), name)
        raise AttributeError(name)

    def as_floats(self) -> dict[str, float]:
        """Plain Python numbers, for a logger (this is the host sync: once per logged step)."""
        return self.materialize().as_floats()


def check_device_recipe(recipe: recipes.Fp8Recipe) -> None:
    """ValueError naming a recipe setting the device path has no kernel for (called where a layer
    is built for CUDA): calibration criteria other than 'max' (their search sorts or loops on the
    host), block shapes other than 1xG activations with 1xG or GxG weights, G in GROUP_WIDTHS."""
    if isinstance(recipe, recipes.CalibratedDelayedScaling) and recipe.criterion != "max":
        raise ValueError(f"FP8 recipe {type(recipe).__name__}(criterion={recipe.criterion!r}) has no device "
                         "kernel: only criterion 'max' runs on CUDA (percentile / mse bounds are computed "
                         "on the host)")
    if isinstance(recipe, recipes.BlockwiseScaling):
        _refuse_pow2(recipe.scale_pow2, "FP8 recipe BlockwiseScaling(scale_pow2=True)")
        group = recipe.activation_block[1]
        if (recipe.activation_block != (1, group) or group not in GROUP_WIDTHS
                or recipe.weight_block not in ((1, group), (group, group))):
            raise ValueError(f"FP8 recipe BlockwiseScaling(activation_block={recipe.activation_block}, "
                             f"weight_block={recipe.weight_block}) has no device kernel: activations in 1xG "
                             f"groups with 1xG or GxG weight blocks, G in {GROUP_WIDTHS}")


def _refuse_pow2(scale_pow2: bool, what: str) -> None:
    """ValueError: the device kernels compute fp32 block scales; power-of-two ones are not wired."""
    if scale_pow2:
        raise ValueError(f"{what} has no device kernel: the Triton quantization computes fp32 block scales; "
                         "power-of-two scales run on the CPU tier only (scale_pow2=false on CUDA)")


def check_device_quantizer(quantizer) -> None:
    """ValueError naming a quantizer the device path has no kernel for (check_device_recipe's
    rules, for quantizers built without that check)."""
    if isinstance(quantizer, CalibratedQuantizer):
        check_device_recipe(quantizer.spec)
    elif isinstance(quantizer, BlockQuantizer):
        _refuse_pow2(quantizer.scale_pow2, "BlockQuantizer(scale_pow2=True)")
        block, group = quantizer.block, quantizer.block[1]
        if group not in GROUP_WIDTHS or block not in ((1, group), (group, group)):
            raise ValueError(f"BlockQuantizer block {block} has no device kernel: 1xG or GxG, G in {GROUP_WIDTHS}")
    elif not isinstance(quantizer, (CurrentQuantizer, DelayedQuantizer, StaticQuantizer)):
        raise ValueError(f"{type(quantizer).__name__} has no device quantization")


def _kernels():
    from megatron_fp8rl.fp8 import triton_quantize

    return triton_quantize


def _scaling():
    from megatron_fp8rl.fp8 import triton_scaling

    return triton_scaling


_FLAGS: dict = {}


def _flag(value: bool, device: torch.device) -> torch.Tensor:
    """A constant 0-d bool `value` on `device`, made once (a read-only statistics flag: a fresh
    one per call would be one more launch)."""
    key = (value, device)
    if key not in _FLAGS:
        _FLAGS[key] = torch.tensor(value, device=device)
    return _FLAGS[key]


def _tensor_result(out: dict, scale_inv: torch.Tensor) -> Fp8Tensor:
    """A per-tensor Fp8Tensor from `quantize_codes` output, its transpose attached when written."""
    result = Fp8Tensor(out["codes"], scale_inv, "tensor")
    if "codes_t" in out:
        result.transposed = Fp8Tensor(out["codes_t"], scale_inv, "tensor")
    return result


def _quantize_pass(q, x, scale, scale_inv, counts, transposed, recalibrated) -> Fp8Tensor:
    """The quantize pass with a scale computed on the device; sets q.last_stats."""
    out = _kernels().quantize_codes(x, q.fmt, "tensor", scale=scale, transposed=transposed, counts=counts)
    q.last_stats = DeviceQuantStats(counts, x.numel(), scale, q.fmt, recalibrated)
    return _tensor_result(out, scale_inv)


def _group_reduce(q):
    """The in-place MAX all-reduce the quantizer's recorded values take, or None where there is no
    collective (reduce_amax off, or fewer than two ranks in its group)."""
    if not q.spec.reduce_amax or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size(q.group) < 2:
        return None
    return lambda values: all_reduce_max_(values, q.group)


def _counters(x: torch.Tensor) -> torch.Tensor:
    """Uninitialized int64 counters: the scaling kernel that runs before the quantize pass zeroes them."""
    return torch.empty(len(_kernels().COUNTERS), dtype=torch.int64, device=x.device)


def _current(q: CurrentQuantizer, x, transposed):
    """Three launches: amax pass, scale (zeroing the counters), quantize pass."""
    counts = _counters(x)
    partial, _ = _kernels().tensor_bounds(x)
    out = _scaling().current_scale(partial, q.fmt, q.margin, counts)
    return _quantize_pass(q, x, out["scale"], out["scale_inv"], counts, transposed, _flag(True, x.device))


def _delayed(q: DelayedQuantizer, x, transposed):
    """Three launches: counters, quantize pass (with its amax), the history and scale update."""
    state, spec, tq = _on_device(q.state, x.device), q.spec, _kernels()
    counts, used = tq.new_counters(x.device), state.scale
    out = tq.quantize_codes(x, q.fmt, "tensor", scale=used, transposed=transposed, amax=True, counts=counts)
    update = _scaling().delayed_update(out["amax_partial"], counts, state, q.fmt, spec.margin,
                                       spec.amax_compute_algo == "most_recent", _group_reduce(q))
    q.last_stats = DeviceQuantStats(counts, x.numel(), used, q.fmt, _flag(False, x.device))
    return _tensor_result(out, update["scale_inv"])


def _calibrated(q: CalibratedQuantizer, x, transposed):
    """Three launches: amax pass (activations: with the overflow count under the predicted scale),
    the decision, scale and state update, quantize pass."""
    check_device_quantizer(q)
    spec, state, counts = q.spec, _on_device(q.state, x.device), _counters(x)
    if q.from_current:
        partial, _ = _kernels().tensor_bounds(x)
        out = _scaling().calibrated_weight_scale(partial, state, q.fmt, spec.margin, counts, _group_reduce(q))
        q._device_bound_scale = (out["bound"], out["scale"])  # what a weight-cache hit records again
        return _quantize_pass(q, x, out["scale"], out["scale_inv"], counts, transposed, _flag(True, x.device))
    partial, overflow = _kernels().tensor_bounds(x, state.scale.float().reshape(()), q.fmt.name)
    out = _scaling().calibrated_scale(partial, overflow, x.numel(), state, q.fmt, spec, counts, _group_reduce(q))
    return _quantize_pass(q, x, out["scale"], out["scale_inv"], counts, transposed, out["recalibrated"])


def _blockwise(q: BlockQuantizer, x, transposed):
    check_device_quantizer(q)
    (rows, group), tq = q.block, _kernels()
    counts = tq.new_counters(x.device)
    grouped = rows == 1
    out = tq.quantize_codes(x, q.fmt, "group" if grouped else "block", block=group, counts=counts,
                            colwise=transposed and grouped, transposed=transposed and not grouped)
    result = Fp8Tensor(out["codes"], out["scale_inv"], "block", q.block)
    if transposed:
        result.transposed = Fp8Tensor(out["codes_t"], out["scale_inv_t"], "block", q.block)
    q.last_stats = DeviceQuantStats(counts, x.numel(), out["scale_inv"], q.fmt, _flag(True, x.device),
                                    scales_are_inverse=True)
    return result


def _static_scales(q: StaticQuantizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's fixed (scale, scale_inv) on `device`, made there once (not at every call)."""
    cached = getattr(q, "_device_scales", None)
    if cached is None or cached[1].device != device:
        scale_inv = q.scale_inv.to(device)
        cached = q._device_scales = (scale_inv.reciprocal(), scale_inv)
    return cached


def _static(q: StaticQuantizer, x, transposed):
    """Two launches (counters, quantize pass), and the observer's quantization when it has one."""
    scale, scale_inv = _static_scales(q, x.device)
    result = _quantize_pass(q, x, scale, scale_inv, _kernels().new_counters(x.device), transposed,
                            _flag(False, x.device))
    if q.observer is not None:
        device_quantize(q.observer, x)
        q.observer.last_stats = q.last_stats
    return result


def device_quantize_rows(x: torch.Tensor, fmt: Fp8Format, margin: int = 0) -> Fp8Tensor:
    """fp8/quantize.py `quantize_per_row(x, fmt, margin)` of a 2-D x on the device path (an amax
    pass, the row scales on the device, the quantize pass): for row-wise scaled GEMMs; no recipe
    quantizes per row today. scale_inv [M, 1]."""
    scale = scale_from_bound(_kernels().row_bounds(x).amax(0), fmt.max, margin)
    out = _kernels().quantize_codes(x, fmt, "row", scale=scale)
    return Fp8Tensor(out["codes"], scale.reciprocal().reshape(-1, 1), "row")


_BY_TYPE = ((StaticQuantizer, _static), (CalibratedQuantizer, _calibrated), (DelayedQuantizer, _delayed),
            (CurrentQuantizer, _current), (BlockQuantizer, _blockwise))


def device_quantize(quantizer, x: torch.Tensor, transposed: bool = False) -> Fp8Tensor:
    """`quantizer.quantize(x)` for a 2-D x on the device path (module docstring): the same codes,
    scales, state updates and `last_stats` (a DeviceQuantStats). `transposed`: also attach, as
    `result.transposed`, the operand the backward GEMMs read ([K, M]: per tensor and GxG blocks
    the transposed codes, 1xG groups the column-wise quantization)."""
    for kind, run in _BY_TYPE:
        if isinstance(quantizer, kind):
            return run(quantizer, x if x.stride(-1) == 1 else x.contiguous(), transposed)
    raise ValueError(f"{type(quantizer).__name__} has no device quantization")


def _cacheable(quantizer) -> bool:
    """Weight quantizers whose result is reused until the weight changes (module docstring)."""
    return not isinstance(quantizer, CalibratedQuantizer) or quantizer.from_current


def weight_cache_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's values without reading them: its storage, its in-place version
    counter and the global weights generation (bumped by `quantizer.weights_updated()`)."""
    return (weight.data_ptr(), weight._version, weights_generation(), tuple(weight.shape), weight.dtype,
            weight.device)


def device_quantize_weight(quantizer, weight: torch.Tensor, transposed: bool = True) -> Fp8Tensor:
    """`device_quantize(quantizer, weight, transposed)`, reused while `weight_cache_key` is
    unchanged (module docstring); the cache lives on the quantizer (`_device_weight_cache`). A hit
    without the transposed copy a caller now asks for gets it added (`_add_transposed`)."""
    if not _cacheable(quantizer):
        return device_quantize(quantizer, weight, transposed=transposed)
    key, cached = weight_cache_key(weight), getattr(quantizer, "_device_weight_cache", None)
    if cached is None or cached[0] != key:
        result = device_quantize(quantizer, weight, transposed=transposed)
        bound_scale = getattr(quantizer, "_device_bound_scale", None) if isinstance(quantizer, CalibratedQuantizer) \
            else None
        quantizer._device_weight_cache = (key, result, quantizer.last_stats, bound_scale)
        return result
    _, result, stats, bound_scale = cached
    if bound_scale is not None:
        _scaling().calibrated_weight_hit(quantizer.state, *bound_scale, quantizer.fmt)
    quantizer.last_stats = stats
    if isinstance(quantizer, StaticQuantizer) and quantizer.observer is not None:
        device_quantize_weight(quantizer.observer, weight, transposed)
        quantizer.observer.last_stats = stats
    if transposed and result.transposed is None:
        _add_transposed(quantizer, weight, result)
    return result


def _add_transposed(quantizer, weight: torch.Tensor, result: Fp8Tensor) -> None:
    """Attach to a cached weight quantization (made by a no-grad pass) the copy the backward reads:
    per tensor the transposed codes (exact: no state moves, as the hit promised), blocks and
    groups the stateless quantizer's own pass with it."""
    if result.granularity == "tensor":
        result.transposed = Fp8Tensor(result.data.t().contiguous(), result.scale_inv, "tensor")
        return
    stats = quantizer.last_stats
    result.transposed = device_quantize(quantizer, weight, transposed=True).transposed
    quantizer.last_stats = stats
