"""Our calibrated recipe as a Transformer Engine recipe, and its hook into Megatron-Core.

Owns: the translation of `megatron_fp8rl.fp8.recipe.CalibratedDelayedScaling` (a TE-free spec)
into a subclass of TE's `DelayedScaling` (a pydantic dataclass), and the Megatron-Core hook.
TE is imported lazily, inside the functions, and only here. Must not import anything above L2
(convert, rollout, data, trainer, cli).

How the TE subclass works (TE >= 2.x, checked against transformer-engine 2.20.2):
- It carries every field of the spec; `fp8_format`, `margin`, `amax_history_len` and
  `reduce_amax` are TE's own fields, the calibration fields are added. TE's `__post_init__`
  validation runs on it (e.g. pure E5M2 is rejected), and our spec's validation runs after.
- `amax_compute_algo` = `te_amax_compute` (max over the history window) and
  `scaling_factor_compute_algo` = `te_scaling_factor_compute` ((fp8_max / bound) / 2**margin,
  keeping the old scale for a bound <= 0 or non-finite): callables, so TE takes its unfused update
  path and computes every scale with the same functions our FP8 linear uses (fp8/scaling.py,
  fp8/quantize.py). Given the same amax history, both tiers produce bit-identical scales.
- Its repr lists every field, so two differently configured recipes never share TE's autocast
  key (`FP8GlobalStateManager.get_unique_autocast_key` keys amax buffers by the recipe's repr).
- What TE's hooks cannot express: TE records raw amaxes and calls the hooks after the step, so
  on the GPU tier the criterion is 'max' over the history, weights are scaled from the previous
  step's amax, and there is no immediate recalibration of an escaping tensor (our FP8 linear, the
  CPU tier, does all three). With `margin` >= 1 the predicted bound keeps 2**margin headroom.

Megatron-Core (0.16.1) plug-in: `megatron.core.fp8_utils.get_fp8_context` builds the
`fp8_autocast(fp8_recipe=get_fp8_recipe(config), fp8_group=amax-reduction group)` around each
transformer layer, looking `get_fp8_recipe` up as a module global of `megatron.core.fp8_utils` at
call time. `install_megatron_recipe(spec)` replaces that global with a function returning one
shared TE instance of our recipe for configs with `fp8_recipe == 'delayed'` (others fall back
to Megatron's own choice), and returns the function that restores it. `megatron_fp8_fields(recipe)`
gives the TransformerConfig fields (`fp8`, `fp8_recipe`, margin and amax-history fields) for our
recipe and for the baselines, which map to TE's own recipes (delayed -> DelayedScaling,
tensorwise -> Float8CurrentScaling, blockwise -> Float8BlockScaling). models.hf wires both when
`model.fp8_backend=te`. Not wired: TE >= 2.9's `CustomRecipe` (Megatron's `fp8_recipe='custom'`).
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_fp8rl.compat.versions import expect, patch, restore
from megatron_fp8rl.fp8.quantize import ACTIVATION_BLOCK, WEIGHT_BLOCK, scale_from_bound
from megatron_fp8rl.fp8.recipe import (
    BlockwiseScaling, CalibratedDelayedScaling, CurrentScaling, DelayedScaling, Fp8Recipe,
)
from megatron_fp8rl.fp8.scaling import bound_from_history

CALIBRATION_FIELDS = (
    "criterion",
    "saturation_budget",
    "overflow_tolerance",
    "calibrate_weights_every_step",
)
"""Spec fields TE's DelayedScaling does not have; the subclass adds them."""
_TE_FORMATS = {"hybrid": "HYBRID", "e4m3": "E4M3"}
_DEFAULTS = CalibratedDelayedScaling()
_classes: dict[type, type] = {}


def te_amax_compute(amax_history: torch.Tensor) -> torch.Tensor:
    """TE `amax_compute_algo` hook: the bound is the max over the history window [L, n] -> [n]."""
    return bound_from_history(amax_history, "max")


def te_scaling_factor_compute(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe
) -> torch.Tensor:
    """TE `scaling_factor_compute_algo` hook: (fp8_max / amax) / 2**recipe.margin, old scale
    kept where amax <= 0 or non-finite (fp8/quantize.scale_from_bound)."""
    return scale_from_bound(amax, fp8_max, recipe.margin, scale)


def _te_recipe_module():
    from transformer_engine.common import recipe as te_recipe  # TE only here, lazily

    return te_recipe


def te_recipe_class(te_recipe_module=None) -> type:
    """The subclass of TE's `DelayedScaling` for our recipe (built once per TE module)."""
    module = _te_recipe_module() if te_recipe_module is None else te_recipe_module
    key = module.DelayedScaling
    if key not in _classes:
        _classes[key] = _build_class(module)
    return _classes[key]


def _build_class(module) -> type:
    from pydantic.dataclasses import dataclass as pydantic_dataclass

    @pydantic_dataclass(repr=False)
    class CalibratedDelayedScaling(module.DelayedScaling):  # noqa: F811  (TE's face of the spec)
        """TE DelayedScaling with calibrated bounds (megatron_fp8rl.fp8.recipe.
        CalibratedDelayedScaling holds the meaning of every field)."""

        criterion: str = _DEFAULTS.criterion
        saturation_budget: float = _DEFAULTS.saturation_budget
        overflow_tolerance: float = _DEFAULTS.overflow_tolerance
        calibrate_weights_every_step: bool = _DEFAULTS.calibrate_weights_every_step

        def __post_init__(self) -> None:
            super().__post_init__()
            from_te_recipe(self)  # our spec's validation: ValueError naming the bad field

        def _make_repr(self) -> str:
            return (
                f"recipe_type={type(self).__name__}, margin={self.margin}, "
                f"format={self.fp8_format.name}, amax_history_len={self.amax_history_len}, "
                f"criterion={self.criterion}, saturation_budget={self.saturation_budget}, "
                f"overflow_tolerance={self.overflow_tolerance}, "
                f"calibrate_weights_every_step={self.calibrate_weights_every_step}, "
                f"reduce_amax={self.reduce_amax}, fp8_dpa={self.fp8_dpa}, "
                f"fp8_mha={self.fp8_mha}, backward_override={self.backward_override}"
            )

        def __repr__(self) -> str:
            return self._make_repr()  # TE versions before the cached repr call __repr__ directly

    return CalibratedDelayedScaling


def to_te_recipe(spec: CalibratedDelayedScaling, te_recipe_module=None, **te_fields):
    """A TE recipe instance for `spec`; `te_fields` sets TE-only fields (fp8_dpa, fp8_mha)."""
    if not isinstance(spec, CalibratedDelayedScaling):
        raise TypeError(
            f"to_te_recipe expects a CalibratedDelayedScaling spec, found {type(spec).__name__}"
        )
    module = _te_recipe_module() if te_recipe_module is None else te_recipe_module
    cls = te_recipe_class(module)
    return cls(
        margin=spec.margin,
        fp8_format=getattr(module.Format, _TE_FORMATS[spec.fp8_format]),
        amax_history_len=spec.amax_history_len,
        amax_compute_algo=te_amax_compute,
        scaling_factor_compute_algo=te_scaling_factor_compute,
        reduce_amax=spec.reduce_amax,
        **{name: getattr(spec, name) for name in CALIBRATION_FIELDS},
        **te_fields,
    )


def from_te_recipe(te_recipe) -> CalibratedDelayedScaling:
    """The spec a TE instance of our recipe stands for (validated on the way)."""
    formats = {te_name: ours for ours, te_name in _TE_FORMATS.items()}
    te_format = te_recipe.fp8_format.name
    if te_format not in formats:
        raise ValueError(
            f"fp8_format: expected one of {', '.join(formats)}, found {te_format} "
            "(pure E5M2 training is not supported)"
        )
    return CalibratedDelayedScaling(
        fp8_format=formats[te_format],
        margin=te_recipe.margin,
        amax_history_len=te_recipe.amax_history_len,
        reduce_amax=te_recipe.reduce_amax,
        **{name: getattr(te_recipe, name) for name in CALIBRATION_FIELDS},
    )


_MEGATRON_RECIPES = {CalibratedDelayedScaling: "delayed", DelayedScaling: "delayed",
                     CurrentScaling: "tensorwise", BlockwiseScaling: "blockwise"}
"""Our recipe spec -> Megatron's `fp8_recipe`, whose TE recipe Megatron's get_fp8_recipe builds
(DelayedScaling, Float8CurrentScaling, Float8BlockScaling; ours after install_megatron_recipe)."""


def megatron_fp8_fields(recipe: Fp8Recipe) -> dict[str, object]:
    """The TransformerConfig fields under which Megatron's TE layers run `recipe` through TE's
    autocast. ValueError naming a field Megatron's TE recipes cannot carry (they have no
    reduce_amax switch; Float8CurrentScaling no margin; Float8BlockScaling fixed blocks)."""
    if not getattr(recipe, "reduce_amax", True):
        raise ValueError("reduce_amax=False: Megatron's TE recipes always reduce amaxes")
    fields: dict[str, object] = {"fp8": recipe.fp8_format, "fp8_recipe": _MEGATRON_RECIPES[type(recipe)]}
    if isinstance(recipe, (CalibratedDelayedScaling, DelayedScaling)):
        algo = getattr(recipe, "amax_compute_algo", "max")  # calibrated: te_amax_compute, 'max'
        fields.update(fp8_margin=recipe.margin, fp8_amax_history_len=recipe.amax_history_len,
                      fp8_amax_compute_algo=algo)
    elif isinstance(recipe, CurrentScaling) and recipe.margin:
        raise ValueError(f"margin={recipe.margin}: TE's Float8CurrentScaling, as Megatron builds "
                         "it, has no margin; use margin=0")
    elif isinstance(recipe, BlockwiseScaling) and recipe.scale_pow2:
        raise ValueError("scale_pow2=True is not wired to TE (its Float8BlockScaling picks power-of-two "
                         "scales by an environment variable, not by the recipe); use fp8_backend=ours")
    elif isinstance(recipe, BlockwiseScaling) and (recipe.weight_block, recipe.activation_block) != (
            WEIGHT_BLOCK, ACTIVATION_BLOCK):
        raise ValueError(f"blocks {recipe.weight_block}/{recipe.activation_block}: TE's "
                         f"Float8BlockScaling uses {WEIGHT_BLOCK}/{ACTIVATION_BLOCK} only")
    return fields


def install_megatron_recipe(spec: CalibratedDelayedScaling) -> Callable[[], None]:
    """Make Megatron-Core's fp8 recipe selection return our recipe for `fp8_recipe='delayed'`.

    Returns a function that restores Megatron's own `get_fp8_recipe`. See the module docstring.
    """
    from megatron.core import fp8_utils

    # a second install replaces the first instead of wrapping it
    current = expect(fp8_utils, "get_fp8_recipe", dist="megatron-core", params=("config",))
    original = getattr(current, "megatron_original", current)
    te_recipe = to_te_recipe(spec)

    def get_fp8_recipe(config):
        chosen = getattr(config, "fp8_recipe", None)
        if getattr(chosen, "value", chosen) != "delayed":
            return original(config)
        if config.fp8 not in (None, spec.fp8_format):
            raise ValueError(
                f"config.fp8 is {config.fp8!r} but the calibrated recipe's fp8_format is "
                f"{spec.fp8_format!r}; set them equal"
            )
        return te_recipe

    get_fp8_recipe.megatron_original = original
    patch(fp8_utils, "get_fp8_recipe", get_fp8_recipe, dist="megatron-core", params=("config",))
    return restore_megatron_recipe


def restore_megatron_recipe() -> None:
    """Undo `install_megatron_recipe` (no-op when Megatron's own selection is in place)."""
    from megatron.core import fp8_utils

    restore(fp8_utils, "get_fp8_recipe", getattr(fp8_utils.get_fp8_recipe, "megatron_original",
                                                 fp8_utils.get_fp8_recipe))

