"""The FP8 serving contract: what a pair (trainer recipe model.fp8, rollout mode rollout.fp8) means
for the checkpoint the rollout serves, the tensors each weight sync sends and the trainer's recompute.

Owns: `RolloutFp8` (rollout.fp8's modes), `ROLLOUT_FP8` (their names), `Fp8ServingPlan` and
`plan_for` (the one plan per pair, built from fp8/recipe.py's `RecipePromises`; an unsupported pair
is refused here, naming model.fp8), and `served_layouts` (the FP8 checkpoint layouts SGLang may
load for a mode). The run config exposes the plan (`RunConfig.fp8_plan`); the actor, the loop, the
weight publisher, trainer/rollout_fp8.py and the SGLang settings read it instead of comparing names.
A mode is a string only in the config (YAML): the config turns it into a `RolloutFp8` once, and
from there modules pass the enum or the plan; `plan_for`, `served_layouts` and `require_plan` raise
TypeError naming the expected type when handed a string.
Recipe names and mode strings are compared here and in fp8/recipe.py only (tests/fp8/test_serving.py
greps for it).
Must not import: anything of megatron_fp8rl above fp8/ (models, convert, rollout, trainer, ...).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Optional

from megatron_fp8rl.fp8.recipe import PROMISES, RecipePromises, aligned_recipe_names


class RolloutFp8(enum.StrEnum):
    """rollout.fp8: how the rollout engine serves FP8 (a str, so YAML values compare equal)."""

    NONE = "none"
    """Serve the high-precision weights in rollout.dtype."""
    BLOCKWISE = "blockwise"
    """The exporter's 128x128 weight blocks, 1x128 dynamic activation groups (SGLang's native)."""
    PER_TENSOR = "per_tensor"
    """The exporter's per-tensor weights; activations per rollout.activation_scheme."""
    ALIGNED = "aligned"
    """The trainer's own FP8 arithmetic (its shared scales, or its row groups recomputed)."""

    @property
    def own_quantization(self) -> bool:
        """Whether the rollout serves its own FP8 quantization of the high-precision weights
        (blockwise, per_tensor, as the exporter makes it): its dtype need not be the trainer's."""
        return self in (RolloutFp8.BLOCKWISE, RolloutFp8.PER_TENSOR)


ROLLOUT_FP8 = tuple(mode.value for mode in RolloutFp8)
"""The names of the rollout FP8 modes (plain strings, for messages and YAML)."""


@dataclass(frozen=True)
class Fp8ServingPlan:
    """What one (trainer recipe, rollout mode) pair promises; build it with `plan_for`."""

    rollout: RolloutFp8
    """rollout.fp8."""
    trainer_fp8: str
    """model.fp8 ('none' or a recipe name of fp8/recipe.py)."""
    shares_scales: bool = False
    """Aligned with a shared-scale recipe: the rollout serves the trainer's per-tensor weight and
    input scales, frozen by the trainer's recompute (trainer/rollout_fp8.py)."""
    row_group: Optional[int] = None
    """Aligned with a row-group recipe: G of its 1 x G weight groups, which the served checkpoint
    holds and the rollout recomputes for tokens; None otherwise."""

    @property
    def fp8(self) -> bool:
        """Whether the rollout serves an FP8 checkpoint (the run writes one at start)."""
        return self.rollout is not RolloutFp8.NONE

    @property
    def aligned(self) -> bool:
        """Whether the rollout serves the trainer's own FP8 arithmetic (the old-logprob recompute
        runs as served; the trainer's FP8 GEMM is the batch-invariant one)."""
        return self.rollout is RolloutFp8.ALIGNED

    @property
    def trainer_gemm(self) -> str:
        """The GEMM of the trainer's FP8 linears (fp8.gemm.GEMMS): batch_invariant when aligned."""
        return "batch_invariant" if self.aligned else "auto"

    def static_per_tensor(self, activation_scheme: str) -> bool:
        """Whether the rollout serves per-tensor FP8 with static input scales of its own (measured
        by the actor's calibration forward and sent with the start checkpoint)."""
        return self.rollout is RolloutFp8.PER_TENSOR and activation_scheme == "static"

    def needs_calibration(self, activation_scheme: str) -> bool:
        """Whether the start checkpoint needs a calibration forward: static input scales (aligned
        with a shared-scale recipe, or per_tensor static)."""
        return self.shares_scales or self.static_per_tensor(activation_scheme)

    def layout(self, activation_scheme: str) -> tuple[str, str]:
        """The (scheme 'block'|'tensor', activation scheme) of the FP8 checkpoint this pair serves
        (the exporter's layout); ValueError for rollout.fp8=none."""
        if not self.fp8:
            raise ValueError("rollout.fp8=none serves no FP8 checkpoint")
        if self.rollout is RolloutFp8.BLOCKWISE or self.row_group is not None:
            return "block", "dynamic"
        return "tensor", "static" if self.aligned or activation_scheme == "static" else "dynamic"


def _require_mode(mode: RolloutFp8, where: str) -> RolloutFp8:
    if not isinstance(mode, RolloutFp8):
        raise TypeError(f"{where}: the rollout FP8 mode must be a RolloutFp8 (fp8/serving.py; the config "
                        f"converts rollout.fp8 once), found {type(mode).__name__} {mode!r}")
    return mode


def require_plan(plan: Fp8ServingPlan, where: str) -> Fp8ServingPlan:
    """`plan`, once it is an Fp8ServingPlan; TypeError naming `where` and what was passed
    otherwise (a mode string, the old way, or a bare RolloutFp8)."""
    if not isinstance(plan, Fp8ServingPlan):
        raise TypeError(f"{where}: expected an Fp8ServingPlan (fp8/serving.py plan_for; a run's is "
                        f"RunConfig.fp8_plan), found {type(plan).__name__} {plan!r}")
    return plan


def served_layouts(mode: RolloutFp8, activation_scheme: str) -> tuple[tuple[str, str], ...]:
    """The (scheme, activation scheme) layouts a checkpoint served in `mode` may have; () for
    none. aligned: per-tensor static (a shared-scale trainer recipe) or block dynamic (a row-group
    recipe's 1 x G weight groups)."""
    _require_mode(mode, "served_layouts")
    if mode is RolloutFp8.NONE:
        return ()
    if mode is RolloutFp8.BLOCKWISE:
        return (("block", "dynamic"),)
    if mode is RolloutFp8.ALIGNED:
        return ("tensor", "static"), ("block", "dynamic")
    return (("tensor", activation_scheme),)


def _promised(trainer_fp8: str) -> RecipePromises:
    return PROMISES.get(trainer_fp8, RecipePromises())


@functools.lru_cache(maxsize=None, typed=True)  # typed: a str equal to a mode is no cache hit
def plan_for(rollout: RolloutFp8, trainer_fp8: str) -> Fp8ServingPlan:
    """The serving plan of rollout mode `rollout` for trainer recipe `trainer_fp8` (built once per
    pair). ValueError naming model.fp8 when rollout.fp8=aligned cannot serve the recipe; TypeError
    for a mode that is not a RolloutFp8."""
    _require_mode(rollout, "plan_for")
    if rollout is not RolloutFp8.ALIGNED:
        return Fp8ServingPlan(rollout, trainer_fp8)
    promised = _promised(trainer_fp8)
    if not promised.servable_aligned:
        reason = f" ({promised.not_aligned_because})" if promised.not_aligned_because else ""
        raise ValueError(f"model.fp8: rollout.fp8=aligned serves the trainer's own FP8 quantization: model.fp8 "
                         f"must be one of {aligned_recipe_names()}, found {trainer_fp8!r}{reason}")
    return Fp8ServingPlan(rollout, trainer_fp8, promised.shares_scales, promised.row_group)
