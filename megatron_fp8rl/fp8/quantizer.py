"""Stateful quantizers: one per tensor role of an FP8 GEMM, built from a recipe spec.

Owns: the per-role quantizers (input and weight in the forward format, grad_output in the
backward format) and their scaling state; `make_quantizers(recipe, group)` picks them:
- `DelayedQuantizer`     TE delayed scaling (scaling.py): quantize with the current scale, then
                         record the amax and update (the update TE runs after each autocast).
- `CalibratedQuantizer`  our recipe (recipe.CalibratedDelayedScaling).
- `CurrentQuantizer`     tensorwise current scaling, `BlockQuantizer` blockwise current scaling.
- `StaticQuantizer`      one fixed dequant multiplier (no state, no collectives): the frozen-scale
                         mode (`frozen_quantizers`) in which the trainer recomputes logprobs with
                         exactly the bounds the rollout engine served (`next_scale` reads them).
- `HeldScaleWeightQuantizer` a weight's current-scaling scales (blockwise or tensorwise) taken from
                         the weight once and held while it moves (`held_weight_scales`: the
                         trainer holds θ_old's through a step's mini-batches).
Every `quantize` leaves `last_stats` (stats.QuantStats) for logging.
CPU speed: weight quantizers reuse their last quantization while the weight is bit-identical
(`WeightQuantCache`): a calibrated one (and the frozen StaticQuantizer built from it) while its
scale is also unchanged (14 bytes per fp32 weight element, 3.5x the weight: a copy of it, the FP8
data, its fp32 copy and their transposes), a blockwise one always (13 bytes: the copy, the FP8
data, the codes' fp32 transpose and the dequantized values); activation quantizations share one
aminmax pass, block statistics skip the expanded scales (fast paths in quantize.py / stats.py).
Results are bit-identical to the plain path (tests/fp8/test_fast_paths.py).
Collectives: with a group of more than one rank, each `quantize` of a delayed or calibrated
quantizer all-reduces once, so every rank must quantize the same roles in the same order.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_fp8rl.fp8 import recipe as recipes
from megatron_fp8rl.fp8.calibration import calibrate_bound
from megatron_fp8rl.fp8.formats import Fp8Format, recipe_formats
from megatron_fp8rl.fp8.quantize import (
    Fp8Tensor,
    amax,
    blockwise_scales,
    cpu_finite_peak,
    finite_amax,
    quantize,
    quantize_blockwise_bounded,
    quantize_finite,
    quantize_with_block_scales,
    quantize_with_scale_inv,
    scale_from_bound,
    transposed_codes,
)
from megatron_fp8rl.fp8.scaling import DelayedScalingState, all_reduce_max_, roll_amax_history_
from megatron_fp8rl.fp8.stats import QuantStats, block_quantization_stats, quantization_stats

ROLES = ("input", "weight", "grad_output")
_WEIGHTS_GENERATION = [0]


def weights_updated() -> None:
    """Declare that weights may have changed (after an optimizer step or a weight load): the
    device path's weight-quantization cache (fp8/device_quantize.py) keys on this generation as
    well as on each weight's storage and version counter, which in-place updates through `.data`
    or a shared buffer skip. The CPU tier's WeightQuantCache compares bits and needs no call."""
    _WEIGHTS_GENERATION[0] += 1


def weights_generation() -> int:
    """How many times `weights_updated()` was called in this process."""
    return _WEIGHTS_GENERATION[0]
RECIPE_TYPES = (
    recipes.CalibratedDelayedScaling,
    recipes.DelayedScaling,
    recipes.CurrentScaling,
    recipes.BlockwiseScaling,
)


def _per_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, recalibrated, peak=None):
    """Quantize x with one scale; returns (Fp8Tensor, QuantStats). `peak`: cpu_finite_peak(x)
    when known (then the CPU fast paths skip their own pass over x)."""
    q = quantize(x, scale, fmt) if peak is None else quantize_finite(x, scale, fmt, peak)
    stats = quantization_stats(x, scale, q, fmt, recalibrated, peak=peak)
    return Fp8Tensor(q, scale.reciprocal(), "tensor"), stats


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """a and b hold the same values bit for bit (-0 differs from 0, equal NaN payloads match)."""
    if a is None or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


class WeightQuantCache:
    """The last quantization of one weight, reused while the weight's bits (and, per tensor, the
    multiplying scale) are unchanged (weights change only at optimizer steps, yet every forward
    and frozen-scale recompute quantized them again: ~20 elementwise passes per layer).

    Holds a copy of the weight (the key: compared bit for bit, so in-place updates through
    `.data` or a shared buffer, which skip the version counter, still invalidate it), the
    quantizer's local bound of it, the FP8 data, `data.float()` and the transposes the GEMMs use
    (block weights: `blockwise`), and the statistics. Results are exactly what quantizing afresh
    gives. CPU only: on an accelerator the comparison would be a host sync, and FP8 GEMMs read
    FP8 data directly.
    """

    def __init__(self):
        self.weight = self.bound = self.scale = self.entry = self.block_entry = None

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dim() == 2 and x.dtype in _BITS_FLOAT

    def _rekey(self, x: torch.Tensor) -> None:
        """Forget everything derived from another weight than x (compared bit for bit)."""
        if not _same_bits(self.weight, x):
            self.weight, self.bound = x.detach().clone(), None
            self.scale = self.entry = self.block_entry = None

    def local_bound(self, x: torch.Tensor, compute) -> torch.Tensor:
        """`compute(x)` (the calibration bound), reused while x is bit-identical to the cached
        weight; always a fresh tensor (callers all-reduce it in place)."""
        self._rekey(x)
        if self.bound is None:  # also after a frozen-scale quantizer sharing this cache saw x first
            self.bound = compute(x).clone()
        return self.bound.clone()

    def quantize(self, x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, checked: bool = False):
        """(data, dense, data_t, dense_t, stats without `recalibrated`) of quantize(x, scale);
        `checked`: `local_bound(x)` has just compared x (skips a second comparison)."""
        if not checked:
            self._rekey(x)
        if self.entry is None or not _same_bits(self.scale, scale.detach().float().reshape(())):
            data = quantize(x, scale, fmt)
            stats = quantization_stats(x, scale, data, fmt, False)
            data_t = data.t().contiguous()
            self.scale = scale.detach().float().reshape(()).clone()
            self.entry = (data, data.float(), data_t, data_t.float(), stats)
        return self.entry

    def blockwise(self, x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int], scale_pow2: bool = False):
        """(quantize_blockwise(x, fmt, block, scale_pow2=scale_pow2) carrying its `dense_t` and
        dequantized `values`, its statistics), reused while x is bit-identical: the groupwise
        forward reads the weight's codes as [K, N] fp32, every backward its dequantized values
        (one cache serves one quantizer, so `scale_pow2` never changes under it)."""
        self._rekey(x)
        if self.block_entry is None:
            result, bounds = quantize_blockwise_bounded(x, fmt, block, scale_pow2=scale_pow2)
            result.dense_t = transposed_codes(result.data)
            result.values = result.dequantize()
            self.block_entry = (result, block_quantization_stats(x, result, fmt, bounds))
        return self.block_entry


_BITS_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _cached_tensor(entry, scale_inv: torch.Tensor) -> Fp8Tensor:
    data, dense, data_t, dense_t, _ = entry
    transposed = Fp8Tensor(data_t, scale_inv, "tensor", dense=dense_t)
    return Fp8Tensor(data, scale_inv, "tensor", dense=dense, transposed=transposed)


def _cached_stats(entry, recalibrated, device) -> QuantStats:
    return dataclasses.replace(
        entry[4], recalibrated=torch.as_tensor(recalibrated, device=device).float()
    )


class CurrentQuantizer:
    """Tensorwise current scaling: scale = (fp8_max / finite amax(x)) / 2**margin."""

    def __init__(self, fmt: Fp8Format, margin: int = 0):
        self.fmt, self.margin = fmt, margin
        self.last_stats: QuantStats | None = None

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        scale = scale_from_bound(finite_amax(x), self.fmt.max, self.margin)
        result, self.last_stats = _per_tensor(x, scale, self.fmt, recalibrated=True)
        return result

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, name: str = "quantizer") -> None:
        return None


class BlockQuantizer:
    """Blockwise current scaling of a 2-D tensor (callers flatten activations to [tokens, K]).

    `cache`: a weight's WeightQuantCache (`make_quantizers` gives the weight role one), or None.
    A block weight's quantization depends on the weight alone, so it is reused until the weight's
    bits change (an optimizer step), with the copies its GEMMs read (`WeightQuantCache.blockwise`).
    `scale_pow2`: block scales rounded down to powers of two (recipe.BlockwiseScaling.scale_pow2)."""

    def __init__(self, fmt: Fp8Format, block: tuple[int, int], cache: WeightQuantCache | None = None,
                 scale_pow2: bool = False):
        self.fmt, self.block, self.cache, self.scale_pow2 = fmt, block, cache, scale_pow2
        self.last_stats: QuantStats | None = None

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        if self.cache is not None and WeightQuantCache.applies(x):
            result, self.last_stats = self.cache.blockwise(x, self.fmt, self.block, self.scale_pow2)
            return result
        result, bounds = quantize_blockwise_bounded(x, self.fmt, self.block, scale_pow2=self.scale_pow2)
        self.last_stats = block_quantization_stats(x, result, self.fmt, bounds)
        return result

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, name: str = "quantizer") -> None:
        return None


class DelayedQuantizer:
    """TE delayed scaling: use the scale from history, then record amax(x) and update. Here every
    call quantizes (a weight too); the device path quantizes a weight once per weight change and
    leaves the state alone on cache hits, as TE's cached FP8 weights do (fp8/device_quantize.py)."""

    def __init__(self, fmt: Fp8Format, spec: recipes.DelayedScaling, group=None):
        self.fmt, self.spec, self.group = fmt, spec, group
        self.state = DelayedScalingState(spec.amax_history_len)
        self.last_stats: QuantStats | None = None

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        self.state = _on_device(self.state, x.device)
        result, self.last_stats = _per_tensor(x, self.state.scale, self.fmt, recalibrated=False)
        self.state.record(amax(x))
        spec = self.spec
        self.state.update(spec.amax_compute_algo, self.fmt.max, spec.margin, self.group, spec.reduce_amax)
        return result

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict, name: str = "quantizer") -> None:
        self.state.load_state_dict(state, name)


class CalibratedQuantizer:
    """Our recipe for one role (see recipe.CalibratedDelayedScaling for the rules)."""

    def __init__(
        self, fmt: Fp8Format, spec: recipes.CalibratedDelayedScaling, is_weight: bool, group=None
    ):
        self.fmt, self.spec, self.group = fmt, spec, group
        self.from_current = is_weight and spec.calibrate_weights_every_step
        self.state = DelayedScalingState(spec.amax_history_len)
        self.last_stats: QuantStats | None = None
        self.cache = WeightQuantCache() if self.from_current else None

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_max_(values, self.group) if self.spec.reduce_amax else values

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        spec, state = self.spec, _on_device(self.state, x.device)
        cache = self.cache if self.cache is not None and WeightQuantCache.applies(x) else None
        calibrate = lambda t: calibrate_bound(t, spec.criterion, self.fmt, spec.saturation_budget)  # noqa: E731
        peak = None
        if cache is None:
            peak = cpu_finite_peak(x)  # = finite_amax(x): the 'max' bound, reused by the checks
            bound = peak.clone() if peak is not None and spec.criterion == "max" else calibrate(x)
        else:
            bound = cache.local_bound(x, calibrate)
        if self.from_current:
            bound = self._reduce(bound.reshape(1))[0]
            recalibrate = torch.ones((), dtype=torch.bool, device=x.device)
        else:
            # No bound yet: an empty window *and* TE's initial scale. The window alone is not
            # enough: with amax_history_len=1 the roll empties it after every step, which made
            # every step recalibrate (bench/fp8_recipes.py: 100% recalibrated).
            no_bound = ((state.amax_history.amax() <= 0) & (state.scale == 1.0)).float()
            decision = self._reduce(torch.stack([bound, self._overflow(x, peak), no_bound]))
            bound = decision[0]
            recalibrate = (decision[2] > 0) | (decision[1] > spec.overflow_tolerance)
        fresh = scale_from_bound(bound, self.fmt.max, spec.margin, state.scale)
        scale = torch.where(recalibrate, fresh, state.scale)
        if cache is not None:
            entry = cache.quantize(x, scale, self.fmt, checked=True)
            result = _cached_tensor(entry, scale.reciprocal())
            self.last_stats = _cached_stats(entry, recalibrate, x.device)
        else:
            result, self.last_stats = _per_tensor(x, scale, self.fmt, recalibrate, peak)
        state.record(bound)
        if self.from_current:
            state.scale = scale
            roll_amax_history_(state.amax_history)
        else:
            state.update("max", self.fmt.max, spec.margin, reduce=False)  # reduced above
        return result

    def _overflow(self, x: torch.Tensor, peak: torch.Tensor | None = None) -> torch.Tensor:
        """Fraction of x that would saturate under the predicted scale (0 without a pass over x
        when a finite CPU x's peak does not saturate: fl(|x| * s) is monotone in |x|)."""
        scale = self.state.scale
        peak = cpu_finite_peak(x) if peak is None else peak
        if peak is not None and bool(torch.isfinite(scale) & (scale > 0)):
            if not bool(peak * scale.float() > self.fmt.rounding_limit):
                return torch.zeros((), dtype=torch.float32, device=x.device)
        scaled = (x.detach().float() * self.state.scale).abs()
        saturated = (torch.isfinite(scaled) & (scaled > self.fmt.rounding_limit)).sum()
        return saturated.float() / max(x.numel(), 1)

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict, name: str = "quantizer") -> None:
        self.state.load_state_dict(state, name)


class StaticQuantizer:
    """Per-tensor quantization with a fixed dequant multiplier `scale_inv` (fp8 quantize.py
    `quantize_with_scale_inv`); records statistics but never updates any state of its own.

    `observer`: the live quantizer this one stands in for, or None. When set, every `quantize`
    also runs `observer.quantize(x)` (its result discarded) so the live scaling state advances
    exactly as if the live quantizer had served the pass (amax history, recalibration, and its
    collective, in the same order on every rank), and the observer's `last_stats` become this
    pass's statistics. For training forwards computed with frozen scales (the aligned first
    mini-batch): without it, an activation's bound would never move again while every forward
    ran frozen. Cost: one more quantization of x."""

    def __init__(self, fmt: Fp8Format, scale_inv: torch.Tensor, cache: WeightQuantCache | None = None,
                 observer=None):
        self.fmt, self.scale_inv = fmt, scale_inv.detach().float().reshape(())
        self.last_stats: QuantStats | None = None
        self.cache = cache
        """A weight's WeightQuantCache (shared with its calibrated quantizer), or None."""
        self.observer = observer

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        result = self._quantize(x)
        if self.observer is not None:
            self.observer.quantize(x)
            self.observer.last_stats = self.last_stats
        return result

    def _quantize(self, x: torch.Tensor) -> Fp8Tensor:
        if self.cache is not None and WeightQuantCache.applies(x):
            scale_inv = self.scale_inv.to(x.device)
            entry = self.cache.quantize(x, scale_inv.reciprocal(), self.fmt)
            self.last_stats = _cached_stats(entry, False, x.device)
            return _cached_tensor(entry, scale_inv)
        result = quantize_with_scale_inv(x, self.scale_inv.to(x.device), self.fmt)
        self.last_stats = quantization_stats(x, result.scale_inv.reciprocal(), result.data, self.fmt,
                                             recalibrated=False)
        return result

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, name: str = "quantizer") -> None:
        return None


class HeldScaleWeightQuantizer:
    """A weight quantizer with the scales its live current-scaling quantizer (`BlockQuantizer` or
    `CurrentQuantizer`) gave `weight` when this one was made, held for every later weight: a code
    then changes only where its own element crosses a rounding boundary, not where its block's
    max |w| moved. On the weight it was made from it quantizes exactly as the live one (same
    codes, same multipliers). Saturating: an element grown past its block's old bound maps to
    +-fp8_max (counted in `last_stats`). No state, no collectives; CPU tier only (the device path
    refuses it). ValueError naming any other live quantizer."""

    def __init__(self, live, weight: torch.Tensor):
        self.fmt, self.live = live.fmt, live
        weight = weight.detach()
        if isinstance(live, BlockQuantizer):
            self.block = live.block
            self.scale = blockwise_scales(weight, live.fmt, live.block, scale_pow2=live.scale_pow2)
        elif isinstance(live, CurrentQuantizer):
            self.block, self.scale = None, scale_from_bound(finite_amax(weight), live.fmt.max, live.margin)
        else:
            raise ValueError(f"held weight scales are wired for current scaling (blockwise / groupwise / "
                             f"tensorwise recipes), not for {type(live).__name__}")
        self.last_stats: QuantStats | None = None

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        scale = self.scale.to(x.device)
        if self.block is None:
            result, self.last_stats = _per_tensor(x, scale, self.fmt, recalibrated=False)
            return result
        result = quantize_with_block_scales(x, scale, self.fmt, self.block)
        self.last_stats = block_quantization_stats(x, result, self.fmt)
        return result

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, name: str = "quantizer") -> None:
        return None


def held_weight_scales(quantizers: "Fp8Quantizers", weight: torch.Tensor) -> "Fp8Quantizers":
    """`quantizers` with the weight role's scales held at those of `weight` (HeldScaleWeightQuantizer);
    input and grad_output keep their live quantizers."""
    return Fp8Quantizers(quantizers.input, HeldScaleWeightQuantizer(quantizers.weight, weight),
                         quantizers.grad_output)


def next_scale(quantizer, x: torch.Tensor | None = None) -> torch.Tensor:
    """The per-tensor scale `quantizer`'s next quantization would use, without changing its state:
    a calibrated weight quantizer derives it from `x` (the current weight; all-reduced over its
    group, so every rank of that group must call this in the same order), delayed and calibrated
    activation quantizers use their predicted scale. ValueError for quantizers without one
    (current or blockwise scaling) or with no bound recorded yet."""
    if isinstance(quantizer, CalibratedQuantizer) and quantizer.from_current:
        if x is None:
            raise ValueError("a calibrated weight quantizer needs the current weight to give its scale")
        spec = quantizer.spec
        bound = calibrate_bound(x, spec.criterion, quantizer.fmt, spec.saturation_budget)
        bound = quantizer._reduce(bound.reshape(1).to(quantizer.state.scale.device))[0]
        return scale_from_bound(bound, quantizer.fmt.max, spec.margin, quantizer.state.scale)
    if isinstance(quantizer, (CalibratedQuantizer, DelayedQuantizer)):
        state = quantizer.state
        if bool((state.amax_history.amax() <= 0) & (state.scale == 1.0)):
            raise ValueError("the quantizer has no bound yet: run a forward pass (calibration) first")
        return state.scale.clone()
    raise ValueError(
        f"{type(quantizer).__name__} has no fixed per-tensor scale to share: aligned rollouts need "
        "a per-tensor stateful recipe (calibrated, te_delayed or megatron_delayed)"
    )


def frozen_quantizers(
    quantizers: "Fp8Quantizers", weight_scale_inv: torch.Tensor, input_scale_inv: torch.Tensor,
    observe: bool = False,
) -> "Fp8Quantizers":
    """Quantizers that quantize the weight and the input with these fixed dequant multipliers
    (the grad_output quantizer is kept); for passes that must reproduce a rollout's FP8 exactly.
    `observe`: the live input/weight quantizers still see every tensor and advance their state
    (StaticQuantizer.observer), as a training forward needs; False (logprob passes) touches no state."""
    forward = quantizers.weight.fmt
    cache = getattr(quantizers.weight, "cache", None)
    live_input, live_weight = (quantizers.input, quantizers.weight) if observe else (None, None)
    return Fp8Quantizers(StaticQuantizer(forward, input_scale_inv, observer=live_input),
                         StaticQuantizer(forward, weight_scale_inv, cache, observer=live_weight),
                         quantizers.grad_output)


def _on_device(state: DelayedScalingState, device: torch.device) -> DelayedScalingState:
    """Move the scaling state to the device of the tensors it scales (lazily, once)."""
    if state.scale.device != device:
        state.amax_history = state.amax_history.to(device)
        state.scale = state.scale.to(device)
    return state


@dataclass
class Fp8Quantizers:
    """The three quantizers of one FP8 linear layer."""

    input: object
    """Quantizer of the layer input (forward format)."""
    weight: object
    """Quantizer of the weight (forward format)."""
    grad_output: object
    """Quantizer of the output gradient (backward format)."""

    def state_dict(self) -> dict:
        """{role: quantizer state} (empty dicts for stateless quantizers)."""
        return {role: getattr(self, role).state_dict() for role in ROLES}

    def load_state_dict(self, state: dict, name: str = "fp8") -> None:
        """Restore every role from `state_dict()`; KeyError naming a missing role."""
        for role in ROLES:
            if role not in state:
                raise KeyError(f"{name}: FP8 scaling state has no {role!r} entry; found {sorted(state)}")
            getattr(self, role).load_state_dict(state[role], f"{name}.{role}")

    def stats(self) -> dict[str, QuantStats]:
        """{role: statistics of its last quantization}, for roles that quantized already."""
        found = {role: getattr(self, role).last_stats for role in ROLES}
        return {role: stats for role, stats in found.items() if stats is not None}


def make_quantizers(recipe: recipes.Fp8Recipe, group=None) -> Fp8Quantizers:
    """The input / weight / grad_output quantizers `recipe` prescribes; `group` is the
    amax-reduction process group (None: the default group, when torch.distributed runs)."""
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(
            f"unknown FP8 recipe type {type(recipe).__name__}; expected one of "
            f"{', '.join(t.__name__ for t in RECIPE_TYPES)} (megatron_fp8rl.fp8.recipe)"
        )
    forward, backward = recipe_formats(recipe.fp8_format)
    if isinstance(recipe, recipes.CalibratedDelayedScaling):
        make = lambda fmt, is_weight: CalibratedQuantizer(fmt, recipe, is_weight, group)  # noqa: E731
    elif isinstance(recipe, recipes.DelayedScaling):
        make = lambda fmt, is_weight: DelayedQuantizer(fmt, recipe, group)  # noqa: E731
    elif isinstance(recipe, recipes.CurrentScaling):
        make = lambda fmt, is_weight: CurrentQuantizer(fmt, recipe.margin)  # noqa: E731
    else:
        make = lambda fmt, is_weight: BlockQuantizer(  # noqa: E731
            fmt, recipe.weight_block if is_weight else recipe.activation_block,
            WeightQuantCache() if is_weight else None, recipe.scale_pow2,
        )
    return Fp8Quantizers(make(forward, False), make(forward, True), make(backward, False))
