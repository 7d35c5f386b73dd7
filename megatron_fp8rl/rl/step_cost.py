"""What an RL step's trainer side costs (issue 61 item 3): the token-passes over the step's batch that a
run's settings add to (or save from) plain FP8's recompute + forward + backward, and the projected
step time against a bf16 step at a given FP8/bf16 GEMM speed ratio.

Owns: `StepShape` (the few settings that decide the passes), `step_shape` (read from a run config's
dotted keys, `dotted`), `StepPasses`, `step_passes` and `projected_step_ratio`. Pure arithmetic on plain
values: the report (from config.yaml or a study arm's overrides) and the trainer (from its RunConfig,
flattened) both call it. Must not import: anything outside the standard library (layer L0).

Counted in forwards of the step's whole batch of B rows (a mini-batch of M is 1/M of one), as the
trainer runs them (trainer/actor.py `update`, trainer/rl_step.py `_recompute_needed`):
- recompute   log π_old of the whole batch before the update: 1, or 0 where none runs (old_policy=
              bypass; one mini-batch without calibration or noise correction, whose first forward
              is at θ_old).
- train       one forward and one backward of every row (each mini-batch once).
- shadow      high-precision forwards. gate (calibration.mode=gate): log π_old of every mini-batch
              before the first optimizer step, and log π_θ of each later one just before it trains,
              (M + M - 1)/M = (2M - 1)/M a gated step; with calibration.gate_every = k one step in k
              is gated, (2M - 1)/(M·k) a step on average (k = 9 at M = 4: 0.194, 4.9%). shadow
              (the paper's Calibrated Clipping) and monitor:
              on a calibrating step (every `calibration.every` steps) log π_old and log π_θ of one
              mini-batch m*, 2/M (M >= 2; at M = 1 both are the one forward at θ_old: 1), averaged
              over steps: that / every. monitor only measures (the stability study's diagnostic), so
              its passes go to `monitor`, not `shadow`, and no projection counts them.
- TIS, MIS, clip widening, aligned rollouts: no pass of their own.

Projected step time (`projected_step_ratio`), a model and not a measurement: a step's time is its
GEMM time, a backward costs two forwards, rollout and weight sync are left out. A bf16 step is
1 recompute + 3 train forward-equivalents (forward + backward) = 4 bf16 forwards. An FP8 trainer's
recompute and train passes run `speedup` times faster than bf16's; its shadow forwards run in high
precision, at bf16 speed (on the GPU tier the shadow is the bf16 forward). So the gate at M
mini-batches costs (4 / s + (2M - 1)/M) / 4 a bf16 step: at s = 1.5, 1.04 (M = 2) and 1.10 (M = 4).
A float32 trainer is no GPU configuration this model speaks for: it refuses one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

CALIBRATION_MODES = ("none", "monitor", "shadow", "gate")
GEMMS = ("fp8", "bf16", "float32")
BF16_STEP_FORWARDS = 4.0
"""A bf16 step in bf16 forward-equivalents: 1 recompute + 1 train forward + 1 backward (= 2)."""
STEP_SHAPE_KEYS = ("train.mini_batches", "algorithm.calibration.mode", "algorithm.calibration.every",
                   "algorithm.old_policy", "algorithm.noise.correction", "model.fp8", "model.dtype")
"""The run config's dotted keys `step_shape` reads (all of them required)."""
OPTIONAL_STEP_SHAPE_KEYS = {"algorithm.calibration.gate_every": 1}
"""Keys `step_shape` also reads, with the value a run config written before they existed implies."""


class StepCostError(ValueError):
    """Settings the cost model cannot count (the message names the key or value)."""


@dataclass(frozen=True)
class StepShape:
    """The settings that decide a step's passes."""

    mini_batches: int
    """M: optimizer steps per RL step (train.mini_batches)."""
    calibration_mode: str
    """One of CALIBRATION_MODES (algorithm.calibration.mode)."""
    calibration_every: int
    """Steps between calibrations of shadow / monitor (algorithm.calibration.every)."""
    recompute: bool
    """Whether log π_old is recomputed before the update (trainer/rl_step.py `_recompute_needed`)."""
    gemm: str
    """The trainer's GEMMs, one of GEMMS: fp8 (model.fp8 set), else the model's dtype."""
    gate_every: int = 1
    """Steps between gated steps (algorithm.calibration.gate_every; gate only)."""

    def __post_init__(self):
        if self.mini_batches < 1:
            raise StepCostError(f"train.mini_batches must be >= 1, got {self.mini_batches}")
        if self.calibration_mode not in CALIBRATION_MODES:
            raise StepCostError(f"algorithm.calibration.mode {self.calibration_mode!r}: expected one of "
                                f"{CALIBRATION_MODES}")
        if self.calibration_every < 1:
            raise StepCostError(f"algorithm.calibration.every must be >= 1, got {self.calibration_every}")
        if self.gate_every < 1 or (self.gate_every > 1 and self.calibration_mode != "gate"):
            raise StepCostError(f"algorithm.calibration.gate_every must be >= 1 and is for mode=gate only, got "
                                f"{self.gate_every} with mode {self.calibration_mode!r}")
        if self.gemm not in GEMMS:
            raise StepCostError(f"trainer GEMM {self.gemm!r}: expected one of {GEMMS}")


def _flag(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise StepCostError(f"{key}: expected true or false, found {value!r}")


def dotted(tree: Mapping, prefix: str = "") -> dict[str, object]:
    """A nested config (config.yaml loaded, or a dataclass tree through dataclasses.asdict) as
    {dotted key: leaf value}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def step_shape(values: Mapping[str, object]) -> StepShape:
    """The StepShape of a run config given as {dotted key: value} (every STEP_SHAPE_KEYS key; values
    as config.yaml or `key=value` overrides hold them). The recompute rule is trainer/rl_step.py's
    `_recompute_needed`: none under old_policy=bypass, else with M > 1, calibration on or noise
    correction on."""
    missing = [key for key in STEP_SHAPE_KEYS if key not in values]
    if missing:
        raise StepCostError(f"run config lacks {missing} (the step cost reads {list(STEP_SHAPE_KEYS)})")
    mini_batches, mode = int(values["train.mini_batches"]), str(values["algorithm.calibration.mode"])
    bypass = str(values["algorithm.old_policy"]) == "bypass"
    noise = _flag("algorithm.noise.correction", values["algorithm.noise.correction"])
    recompute = not bypass and (mini_batches > 1 or mode != "none" or noise)
    fp8, dtype = str(values["model.fp8"]), str(values["model.dtype"])
    gemm = "fp8" if fp8 != "none" else {"bfloat16": "bf16", "float32": "float32"}.get(dtype)
    if gemm is None:
        raise StepCostError(f"model.dtype {dtype!r} with model.fp8=none: expected bfloat16 or float32")
    key = "algorithm.calibration.gate_every"
    gate_every = int(values.get(key, OPTIONAL_STEP_SHAPE_KEYS[key]))
    return StepShape(mini_batches, mode, int(values["algorithm.calibration.every"]), recompute, gemm, gate_every)


@dataclass(frozen=True)
class StepPasses:
    """A step's passes over its whole batch, in forwards of the batch (module docstring)."""

    recompute: float
    train_forward: float
    train_backward: float
    shadow: float
    """High-precision forwards the method needs (gate, Calibrated Clipping)."""
    monitor: float
    """High-precision forwards that only measure (calibration.mode=monitor); not in the projection."""

    @property
    def extra_forward(self) -> float:
        """Forwards beyond plain FP8's recompute + train forward (negative: saved)."""
        return self.recompute - 1.0 + self.train_forward - 1.0 + self.shadow

    @property
    def extra_backward(self) -> float:
        """Backwards beyond plain FP8's one."""
        return self.train_backward - 1.0

    @property
    def extra_share(self) -> float:
        """The extra passes in forward-equivalents (a backward = 2) over plain FP8's 4."""
        return (self.extra_forward + 2.0 * self.extra_backward) / BF16_STEP_FORWARDS


def step_passes(shape: StepShape) -> StepPasses:
    """The passes of one step of `shape` (module docstring), calibrations averaged over steps."""
    m = shape.mini_batches
    if shape.calibration_mode == "gate":
        high_precision = (2 * m - 1) / m / shape.gate_every
    elif shape.calibration_mode in ("shadow", "monitor"):
        high_precision = (2 / m if m >= 2 else 1.0) / shape.calibration_every
    else:
        high_precision = 0.0
    measured = shape.calibration_mode == "monitor"
    return StepPasses(recompute=float(shape.recompute), train_forward=1.0, train_backward=1.0,
                      shadow=0.0 if measured else high_precision, monitor=high_precision if measured else 0.0)


def projected_step_ratio(passes: StepPasses, gemm: str, speedup: float) -> float:
    """Projected time of a step over a bf16 step's (module docstring): FP8 GEMMs `speedup` times
    faster than bf16's, shadow forwards at bf16 speed, monitor passes left out."""
    if speedup <= 0:
        raise StepCostError(f"FP8/bf16 GEMM speed ratio must be > 0, got {speedup}")
    if gemm not in ("fp8", "bf16"):
        raise StepCostError(f"projected step time: a {gemm!r} trainer is not modelled (fp8 or bf16 GEMMs only)")
    trained = passes.recompute + passes.train_forward + 2.0 * passes.train_backward
    return (trained / (speedup if gemm == "fp8" else 1.0) + passes.shadow) / BF16_STEP_FORWARDS
