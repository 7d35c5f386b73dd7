"""Quantization on the device path: each quantizer of fp8/quantizer.py run by the fused Triton kernels.

Owns: `device_quantize(quantizer, x, transposed)` (the same codes, scales, scaling-state updates
and statistics as `quantizer.quantize(x)` on the CPU, bit for bit, without a host
synchronization), `device_quantize_weight` (the same with the weight-quantization cache),
`DeviceQuantStats` (statistics left on the device until a logger reads them) and
`check_device_recipe` / `check_device_quantizer` (combinations without a device kernel, refused by
name). fp8/device_linear.py calls it; tensors are CUDA ones, or CPU ones under TRITON_INTERPRET=1
(the tests).
Per quantizer (x [M, K], one kernel pass writing codes, scales, statistics, optionally the copy
the backward reads: per tensor and 128x128 blocks the transposed codes, 1xG groups a column-wise
quantization of x^T in 1xG groups, i.e. Gx1 groups of x):
- CurrentQuantizer: an amax pass (each row's finite max |x|), the scale from it on the device,
  the quantize pass;
- DelayedQuantizer: the quantize pass with the state's scale, which also returns max |x| (NaN when
  x holds one) for the amax history, updated on the device;
- CalibratedQuantizer ('max' criterion): weights as CurrentQuantizer (the bound all-reduced);
  activations: an amax pass that also counts overflow under the predicted scale, the decision on
  the device, the quantize pass;
- BlockQuantizer: one pass, scales computed in the kernel (1xG groups, GxG blocks);
- StaticQuantizer: the quantize pass with the fixed scale (its observer runs too).
Weight cache: `device_quantize_weight` reuses a weight's quantization (with its transposed copy)
while (data_ptr, tensor._version, quantizer.weights_generation()) is unchanged; the optimizer step
and weight loads call `quantizer.weights_updated()`. A calibrated weight's cache hit still records
its bound and rolls its history as a fresh quantization does, but skips the bound's all-reduce
(every rank hits and misses at the same calls). Delayed and predicted weight scales change at every
call, so those are never cached.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch; triton through
fp8/triton_quantize.py, imported at the first quantization so importing this module stays cheap).
"""
from __future__ import annotations

import torch

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
from megatron_fp8rl.fp8.scaling import roll_amax_history_
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


def _tensor_result(out: dict, scale_inv: torch.Tensor) -> Fp8Tensor:
    """A per-tensor Fp8Tensor from `quantize_codes` output, its transpose attached when written."""
    result = Fp8Tensor(out["codes"], scale_inv, "tensor")
    if "codes_t" in out:
        result.transposed = Fp8Tensor(out["codes_t"], scale_inv, "tensor")
    return result


def _per_tensor(x, scale, fmt, transposed, recalibrated, amax=False, scale_inv=None):
    """(Fp8Tensor, DeviceQuantStats, quantize_codes output) of x quantized with one scale."""
    tq = _kernels()
    counts = tq.new_counters(x.device)
    out = tq.quantize_codes(x, fmt, "tensor", scale=scale, transposed=transposed, amax=amax, counts=counts)
    scale_inv = scale.reciprocal() if scale_inv is None else scale_inv
    stats = DeviceQuantStats(counts, x.numel(), scale, fmt, recalibrated)
    return _tensor_result(out, scale_inv), stats, out


def _finite_bound(x: torch.Tensor, scale=None, counts=None, fmt_name="e4m3") -> torch.Tensor:
    """finite_amax(x) (0-d fp32) from the amax pass (with `scale`: overflow counted into counts[0])."""
    partial = _kernels().row_bounds(x, scale, counts, fmt_name)
    return partial.amax() if partial.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def _true(device) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=device)


def _current(q: CurrentQuantizer, x, transposed):
    scale = scale_from_bound(_finite_bound(x), q.fmt.max, q.margin)
    result, q.last_stats, _ = _per_tensor(x, scale, q.fmt, transposed, _true(x.device))
    return result


def _delayed(q: DelayedQuantizer, x, transposed):
    state = _on_device(q.state, x.device)
    result, q.last_stats, out = _per_tensor(x, state.scale, q.fmt, transposed, torch.zeros((), device=x.device),
                                            amax=True)
    nan = torch.full((), float("nan"), device=x.device)
    state.record(torch.where(q.last_stats.counts[4] > 0, nan, out["amax"]))
    spec = q.spec
    state.update(spec.amax_compute_algo, q.fmt.max, spec.margin, q.group, spec.reduce_amax)
    return result


def _calibrated_weight_bound(q: CalibratedQuantizer, x):
    """(bound all-reduced, scale) of a calibrated weight quantizer (from_current)."""
    bound = q._reduce(_finite_bound(x).reshape(1))[0]
    return bound, scale_from_bound(bound, q.fmt.max, q.spec.margin, q.state.scale)


def _calibrated(q: CalibratedQuantizer, x, transposed):
    check_device_quantizer(q)
    spec, state = q.spec, _on_device(q.state, x.device)
    if q.from_current:
        bound, scale = _calibrated_weight_bound(q, x)
        result, q.last_stats, _ = _per_tensor(x, scale, q.fmt, transposed, _true(x.device))
        _record_weight(q, bound, scale)
        q._device_bound_scale = (bound, scale)  # what a weight-cache hit records again
        return result
    overflow = _kernels().new_counters(x.device)
    bound = _finite_bound(x, state.scale.float().reshape(()), overflow, q.fmt.name)
    fraction = overflow[0].float() / max(x.numel(), 1)
    no_bound = ((state.amax_history.amax() <= 0) & (state.scale == 1.0)).float()
    decision = q._reduce(torch.stack([bound, fraction, no_bound]))
    bound = decision[0]
    recalibrate = (decision[2] > 0) | (decision[1] > spec.overflow_tolerance)
    fresh = scale_from_bound(bound, q.fmt.max, spec.margin, state.scale)
    scale = torch.where(recalibrate, fresh, state.scale)
    result, q.last_stats, _ = _per_tensor(x, scale, q.fmt, transposed, recalibrate)
    state.record(bound)
    state.update("max", q.fmt.max, spec.margin, reduce=False)
    return result


def _record_weight(q: CalibratedQuantizer, bound, scale) -> None:
    """A calibrated weight quantization's state update (quantizer.CalibratedQuantizer.quantize)."""
    q.state.record(bound)
    q.state.scale = scale
    roll_amax_history_(q.state.amax_history)


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
    q.last_stats = DeviceQuantStats(counts, x.numel(), out["scale_inv"], q.fmt, _true(x.device),
                                    scales_are_inverse=True)
    return result


def _static_scale_inv(q: StaticQuantizer, device) -> torch.Tensor:
    """The quantizer's fixed scale_inv on `device`, copied there once (not at every call)."""
    cached = getattr(q, "_device_scale_inv", None)
    if cached is None or cached.device != device:
        cached = q._device_scale_inv = q.scale_inv.to(device)
    return cached


def _static(q: StaticQuantizer, x, transposed):
    scale_inv = _static_scale_inv(q, x.device)
    result, stats, _ = _per_tensor(x, scale_inv.reciprocal(), q.fmt, transposed,
                                   torch.zeros((), device=x.device), scale_inv=scale_inv)
    q.last_stats = stats
    if q.observer is not None:
        device_quantize(q.observer, x)
        q.observer.last_stats = stats
    return result


def device_quantize_rows(x: torch.Tensor, fmt: Fp8Format, margin: int = 0) -> Fp8Tensor:
    """fp8/quantize.py `quantize_per_row(x, fmt, margin)` of a 2-D x on the device path (an amax
    pass, the row scales on the device, the quantize pass): for row-wise scaled GEMMs; no recipe
    quantizes per row today. scale_inv [M, 1]."""
    partial = _kernels().row_bounds(x, fmt_name=fmt.name)
    scale = scale_from_bound(partial.amax(0), fmt.max, margin)
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
    """Weight quantizers whose result depends on the weight alone (module docstring)."""
    return (isinstance(quantizer, (BlockQuantizer, CurrentQuantizer, StaticQuantizer))
            or (isinstance(quantizer, CalibratedQuantizer) and quantizer.from_current))


def weight_cache_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's values without reading them: its storage, its in-place version
    counter and the global weights generation (bumped by `quantizer.weights_updated()`)."""
    return (weight.data_ptr(), weight._version, weights_generation(), tuple(weight.shape), weight.dtype,
            weight.device)


def device_quantize_weight(quantizer, weight: torch.Tensor) -> Fp8Tensor:
    """`device_quantize(quantizer, weight, transposed=True)`, reused while `weight_cache_key` is
    unchanged (module docstring); the cache lives on the quantizer (`_device_weight_cache`)."""
    if not _cacheable(quantizer):
        return device_quantize(quantizer, weight, transposed=True)
    key, cached = weight_cache_key(weight), getattr(quantizer, "_device_weight_cache", None)
    if cached is not None and cached[0] == key:
        _, result, stats, bound_scale = cached
        if bound_scale is not None:
            _record_weight(quantizer, *bound_scale)
        quantizer.last_stats = stats
        if isinstance(quantizer, StaticQuantizer) and quantizer.observer is not None:
            device_quantize_weight(quantizer.observer, weight)
            quantizer.observer.last_stats = stats
        return result
    result = device_quantize(quantizer, weight, transposed=True)
    calibrated = isinstance(quantizer, CalibratedQuantizer)
    bound_scale = getattr(quantizer, "_device_bound_scale", None) if calibrated else None
    quantizer._device_weight_cache = (key, result, quantizer.last_stats, bound_scale)
    return result
