"""FP8 recipe specs: one small frozen dataclass per scaling strategy, validated where it is made.

Owns: `CalibratedDelayedScaling` (our recipe, see docs/design.md "Calibrated delayed scaling") and the
baselines our FP8 linear offers: `DelayedScaling` (TE semantics; `te_default_delayed()` = history
1024 'max', `megatron_default_delayed()` = history 1 'most_recent'), `CurrentScaling` (tensorwise,
from each tensor's own amax) and `BlockwiseScaling` (128x128 weights, 1x128 activations and
gradients; `groupwise()`: 1x128 weight groups too). These specs are TE-free: our FP8 linear reads them directly, and
megatron_fp8rl/models/te_recipe.py translates `CalibratedDelayedScaling` into a subclass of TE's
`DelayedScaling`, so both tiers compute scales from the same fields with the same functions.
Also owns the recipe names (`RECIPE_NAMES`, `recipe_by_name`), what each named recipe promises the
rollout (`RecipePromises`, `promises`; fp8/serving.py builds the serving plan from them: no other
module compares recipe names) and `RecipeOverrides`, the run config's typed overlay of every recipe
field (trainer/config.py nests it as model.fp8_recipe).
Must not import: megatron, transformer_engine, megatron_fp8rl.compat or anything above layer L0.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Optional, Union

from megatron_fp8rl.fp8.calibration import check_criterion
from megatron_fp8rl.fp8.formats import recipe_formats
from megatron_fp8rl.fp8.quantize import ACTIVATION_BLOCK, WEIGHT_BLOCK
from megatron_fp8rl.fp8.scaling import check_amax_compute_algo


def _check_common(fp8_format: str, margin: int) -> None:
    recipe_formats(fp8_format)
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be an integer >= 0, found {margin!r}")


@dataclass(frozen=True)
class CalibratedDelayedScaling:
    """Calibrated delayed scaling: bounds calibrated against the high-precision tensors.

    Every quantized tensor gets a bound c (the value that maps to fp8_max / 2**margin) and the
    scale (fp8_max / c) / 2**margin (TE's formula). Weights (when `calibrate_weights_every_step`)
    take c = criterion(current weight) at every use. Activations and gradients take the bound
    predicted before the tensor is seen: the max over the last `amax_history_len` recorded
    criterion values; the live tensor is checked, and when more than `overflow_tolerance` of its
    elements would saturate (or no bound exists yet) it is re-quantized at once with
    c = criterion(live tensor). Recorded values and decisions are all-reduced (MAX) over the
    amax-reduction group when `reduce_amax`. Scales update in no-grad passes too, so nothing
    depends on a training forward having run first.
    """

    fp8_format: str = "hybrid"
    """'hybrid' (E4M3 forward, E5M2 gradients) or 'e4m3'."""
    margin: int = 1
    """Headroom 2**margin above the bound; 1 keeps predicted bounds 2x above the recorded
    ones, inside the range where E4M3's error is flat (docs/design.md's measurement)."""
    amax_history_len: int = 4
    """Window: how many recorded steps the predicted bound takes the max over. 4 by measurement
    (bench/fp8_recipes.py, SmolLM2-135M, 20 RL steps): with 16 a stale maximum held one layer's
    bound ~1.5% above 2x its slowly falling amax, moving its single dominant outlier (|x| ~3000)
    off the FP8 grid point it hits exactly when the bound tracks the amax; activation MSE went
    to 1.11x tensorwise current scaling (4: 1.02x; 1: 1.01x but 5-10x more recalibrations)."""
    criterion: str = "max"
    """Calibration criterion: 'max', 'percentile' (saturation budget) or 'mse' (least error)."""
    saturation_budget: float = 0.0
    """'percentile': fraction of elements allowed above the bound, in [0, 1)."""
    overflow_tolerance: float = 0.0
    """Fraction of a live tensor allowed to saturate under the predicted bound before it is
    recalibrated at once; must be >= saturation_budget, in [0, 1)."""
    calibrate_weights_every_step: bool = True
    """Weights: bound from the current values at every use (False: predicted like activations)."""
    reduce_amax: bool = True
    """All-reduce (MAX) recorded bounds over the amax-reduction group."""

    def __post_init__(self) -> None:
        _check_common(self.fp8_format, self.margin)
        check_criterion(self.criterion)
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, found {self.amax_history_len}")
        for name in ("saturation_budget", "overflow_tolerance"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), found {getattr(self, name)}")
        if self.overflow_tolerance < self.saturation_budget:
            raise ValueError(
                f"overflow_tolerance ({self.overflow_tolerance}) must be >= saturation_budget "
                f"({self.saturation_budget}), or every step saturating within budget would "
                "trigger a recalibration"
            )


@dataclass(frozen=True)
class DelayedScaling:
    """TE's delayed scaling: scale from amax_compute_algo over an amax history, updated after
    each use (row 0 latest); the first use of a quantizer runs with scale 1."""

    fp8_format: str = "hybrid"
    """'hybrid' or 'e4m3'."""
    margin: int = 0
    """scale = (fp8_max / amax) / 2**margin."""
    amax_history_len: int = 1024
    """History length (TE default 1024; Megatron-Core default 1)."""
    amax_compute_algo: str = "max"
    """'max' over the history or 'most_recent'."""
    reduce_amax: bool = True
    """All-reduce (MAX) amaxes over the amax-reduction group before the update."""

    def __post_init__(self) -> None:
        _check_common(self.fp8_format, self.margin)
        check_amax_compute_algo(self.amax_compute_algo)
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, found {self.amax_history_len}")


@dataclass(frozen=True)
class CurrentScaling:
    """Tensorwise current scaling: each tensor's scale from its own amax (TE's
    Float8CurrentScaling)."""

    fp8_format: str = "hybrid"
    """'hybrid' or 'e4m3'."""
    margin: int = 0
    """scale = (fp8_max / amax) / 2**margin."""

    def __post_init__(self) -> None:
        _check_common(self.fp8_format, self.margin)


@dataclass(frozen=True)
class BlockwiseScaling:
    """Blockwise current scaling (TE's Float8BlockScaling, DeepSeek's checkpoint layout)."""

    fp8_format: str = "e4m3"
    """'e4m3' or 'hybrid'."""
    weight_block: tuple[int, int] = WEIGHT_BLOCK
    """Block of weights [N, K]."""
    activation_block: tuple[int, int] = ACTIVATION_BLOCK
    """Block of activations and gradients flattened to [tokens, channels]."""
    scale_pow2: bool = False
    """Round every block's scale down to a power of two (UE8M0, as MXFP8 and DeepSeek-V3.1 store
    them): a block's scale then moves only when its max |x| crosses a power of two, not at every
    small update (fp32 scales shift all of a block's codes' rounding). CPU tier, no aligned rollout
    (the rollout's quantization does not round its scales); bench/ratio_noise.py measures it."""

    def __post_init__(self) -> None:
        _check_common(self.fp8_format, 0)
        if not isinstance(self.scale_pow2, bool):
            raise ValueError(f"scale_pow2 must be true or false, found {self.scale_pow2!r}")
        for name in ("weight_block", "activation_block"):
            block = tuple(getattr(self, name))
            if len(block) != 2 or min(block) < 1:
                raise ValueError(f"{name} must be two positive integers, found {block!r}")
            object.__setattr__(self, name, block)


Fp8Recipe = Union[CalibratedDelayedScaling, DelayedScaling, CurrentScaling, BlockwiseScaling]


def te_default_delayed(fp8_format: str = "hybrid") -> DelayedScaling:
    """TE's DelayedScaling defaults: history 1024, 'max', margin 0."""
    return DelayedScaling(fp8_format=fp8_format, amax_history_len=1024, amax_compute_algo="max")


def megatron_default_delayed(fp8_format: str = "hybrid") -> DelayedScaling:
    """Megatron-Core's delayed defaults (fp8_amax_history_len=1, 'most_recent')."""
    return DelayedScaling(
        fp8_format=fp8_format, amax_history_len=1, amax_compute_algo="most_recent"
    )


def groupwise(fp8_format: str = "e4m3", group: int = ACTIVATION_BLOCK[1]) -> BlockwiseScaling:
    """Blockwise current scaling with 1 x `group` weight groups (each output channel's K in groups
    of 128 by default) as well as 1 x `group` activation and gradient groups. Every scale belongs
    to one row, so any split of a weight's rows (fused q/k/v and gate/up, column-parallel TP
    shards) quantizes exactly as its parts do alone, and a token's quantization depends on that
    token only: what aligned rollouts need of a recipe that keeps no state. Accuracy:
    bench/fp8_accuracy.py."""
    return BlockwiseScaling(fp8_format=fp8_format, weight_block=(1, group), activation_block=(1, group))


def groupwise32(fp8_format: str = "e4m3") -> BlockwiseScaling:
    """`groupwise` with 1x32 groups (MXFP8's block length, with fp32 scales): 4x the scales of
    1x128, and on the CPU demo's add/mul task the served model's step-0 accuracy within a point of
    float32 where 1x128 weight groups cost ~4 points (bench/fp8_accuracy.py, docs/fp8.md). The
    'exact' and 'tiled' GEMMs take any group width; the Triton kernel (GPU) takes 1x32 and 1x128."""
    return groupwise(fp8_format, 32)


RECIPE_NAMES = {
    "calibrated": CalibratedDelayedScaling,
    "te_delayed": te_default_delayed,
    "megatron_delayed": megatron_default_delayed,
    "tensorwise": CurrentScaling,
    "blockwise": BlockwiseScaling,
    "groupwise": groupwise,
    "groupwise32": groupwise32,
}
"""Recipe name -> factory of the named recipe (its own values; `recipe_by_name` replaces fields)."""
FIXED_FIELDS = {"groupwise": ("weight_block", "activation_block"),
                "groupwise32": ("weight_block", "activation_block")}
"""Fields a name fixes: they are what the name means (groupwise's 1x128 and groupwise32's 1x32
row groups are what aligned rollouts recompute; other blocks are the blockwise recipe)."""


@dataclass(frozen=True)
class RecipePromises:
    """What a named recipe promises the rollout that serves its FP8 arithmetic (rollout.fp8=aligned)."""

    shares_scales: bool = False
    """One per-tensor weight and input scale per linear, which the rollout serves as the trainer's
    (frozen by its recompute; trainer/rollout_fp8.py)."""
    row_group: Optional[int] = None
    """G when weights and tokens are quantized in stateless 1 x G row groups from their own values:
    the rollout recomputes them, nothing to share; None otherwise."""
    not_aligned_because: str = ""
    """Why an aligned rollout cannot serve it, when neither of the above holds ('' gives no reason)."""

    @property
    def servable_aligned(self) -> bool:
        """Whether rollout.fp8=aligned can serve this recipe (shared scales or row groups)."""
        return self.shares_scales or self.row_group is not None


_BLOCKWISE_NOT_ALIGNED = ("blockwise's 128x128 weight blocks cut across the q/k/v rows Megatron fuses and "
                          "interleaves, so SGLang's per-tensor blocks differ; groupwise's 1x128 groups do not")
PROMISES = {
    "calibrated": RecipePromises(shares_scales=True),
    "te_delayed": RecipePromises(shares_scales=True),
    "megatron_delayed": RecipePromises(shares_scales=True),
    "tensorwise": RecipePromises(),
    "blockwise": RecipePromises(not_aligned_because=_BLOCKWISE_NOT_ALIGNED),
    "groupwise": RecipePromises(row_group=groupwise().weight_block[1]),
    "groupwise32": RecipePromises(row_group=groupwise32().weight_block[1]),
}
"""Recipe name -> what it promises; the row groups are the named recipes' own (FIXED_FIELDS)."""


def promises(name: str) -> RecipePromises:
    """What the recipe called `name` promises the rollout; ValueError listing the valid names."""
    if name not in PROMISES:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid: {', '.join(RECIPE_NAMES)}")
    return PROMISES[name]


def aligned_recipe_names() -> tuple[str, ...]:
    """The recipe names an aligned rollout can serve, in RECIPE_NAMES order."""
    return tuple(name for name in RECIPE_NAMES if PROMISES[name].servable_aligned)


class RecipeFieldError(ValueError):
    """A field override that a named recipe does not have or refuses; `fields` names the fields
    at fault (several when only their combination is refused)."""

    def __init__(self, message: str, fields: tuple[str, ...]):
        super().__init__(message)
        self.fields = fields


def recipe_fields(name: str) -> tuple[str, ...]:
    """The fields `recipe_by_name(name, ...)` may replace: its recipe class's, less FIXED_FIELDS."""
    if name not in RECIPE_NAMES:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid: {', '.join(RECIPE_NAMES)}")
    fixed = FIXED_FIELDS.get(name, ())
    return tuple(f.name for f in dataclasses.fields(RECIPE_NAMES[name]()) if f.name not in fixed)


def recipe_by_name(name: str, **fields) -> Fp8Recipe:
    """The recipe called `name` (see RECIPE_NAMES) with `fields` replacing its own values, checked
    by the recipe's class. ValueError listing the valid names; RecipeFieldError naming a field the
    recipe does not have (listing those it has) or the field(s) whose value it refuses."""
    accepted = recipe_fields(name)
    unknown = [key for key in fields if key not in accepted]
    if unknown:
        raise RecipeFieldError(f"not a field of the {name!r} recipe (fields: {', '.join(accepted)})", (unknown[0],))
    base = RECIPE_NAMES[name]()
    try:
        return dataclasses.replace(base, **fields)
    except (TypeError, ValueError) as exc:
        raise RecipeFieldError(str(exc), _refused_fields(base, fields)) from None


def _refused_fields(base: Fp8Recipe, fields: dict) -> tuple[str, ...]:
    """The first field `base` refuses on its own, else all of `fields` (their combination)."""
    for key, value in fields.items():
        try:
            dataclasses.replace(base, **{key: value})
        except (TypeError, ValueError):
            return (key,)
    return tuple(fields)


def _set_fields(overrides) -> dict[str, object]:
    """The fields of a RecipeOverrides that are set (not None), for `recipe_by_name`."""
    return {key: value for key, value in dataclasses.asdict(overrides).items() if value is not None}


def _overlay_fields() -> dict[str, object]:
    """Every field of every recipe class -> its type; a name must mean one type in all."""
    types: dict[str, object] = {}
    for cls in typing.get_args(Fp8Recipe):
        for key, hint in typing.get_type_hints(cls).items():
            if types.setdefault(key, hint) != hint:
                raise TypeError(f"recipe field {key!r} is {types[key]} in one recipe and {hint} in {cls.__name__}")
    return types


RecipeOverrides = dataclasses.make_dataclass(
    "RecipeOverrides",
    [(key, Optional[hint], dataclasses.field(default=None)) for key, hint in _overlay_fields().items()],
    namespace={"__module__": __name__, "__doc__": (
        "Values that replace a named recipe's own: one optional field per field of the recipe classes "
        "above (same name, type and meaning; generated from them, so the two cannot drift). None keeps "
        "the named recipe's value. `set_fields()` gives the ones set, for `recipe_by_name`."),
        "set_fields": _set_fields},
)
