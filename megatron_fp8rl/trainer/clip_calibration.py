"""Calibrated Clipping in the trainer (algorithm.calibration.mode=shadow): when a step calibrates,
on which rows, the clip bounds in force, and the calibration from the gathered logprobs.

Owns: `ClipCalibrator`. The math is rl/calibrated_clipping.py. Must not import: cli, trainer.loop,
trainer.rl_step.

When the two shadow forwards run, so that the FP8 and the shadow ratio are taken at the same θ: a
calibrating step with M mini-batches calibrates on mini-batch m* = 1 if M >= 2, else 0. Before the
step's first optimizer step the shadow (every FP8 linear in high precision, compat
`high_precision_fp8_linears`) computes log π_old of m*'s rows; just before m* trains, after m*
optimizer steps (θ = θ_m*), it computes log π_θ of the same rows. The FP8 ratio is the one m*'s own
training forward feeds the loss, π_θ/π_old at that same θ_m* (π_old: the recompute, or the rollout
logprobs under old_policy=bypass). With one mini-batch θ_m* = θ_old: the shadow ratio is exactly 1
and one shadow forward serves both. The bounds a calibration yields hold from the next step on
(the calibrating step trains with the bounds in force) until the next calibration. Bounds before
the first calibration are the configured ones, passed on as None so that the loss is bit-identical
to calibration.mode=none.

calibration.mode=monitor runs the same shadow forwards and reports the same diagnostic (the paper's
share of negative-advantage tokens the FP8 ratio clips and the shadow's does not, `clip/neg_overclip_
before`) but keeps the configured bounds: the measurement of a plain-FP8 run (the stability study).
calibration.mode=gate (ours) keeps the configured bounds too, but the loss takes every token's clip
decision on the shadow's ratio (actor.update runs the shadow on every mini-batch): the diagnostic
of the decisions taken is then the shadow's against itself, logged as clip/*_before (0 over-clip
by construction), and what the FP8 ratio would have clipped goes to clip/*_fp8. With
calibration.gate_every = k the gate runs on steps 1, k + 1, ... only (`gates`); the steps between
train as mode=none (no shadow forward, clip decided on the FP8 ratio), logged as clip/gated 0.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from megatron_fp8rl.rl.calibrated_clipping import (
    Calibration,
    ClipBounds,
    ClipLimits,
    calibrate,
    calibration_values,
    clip_diagnostic,
)
from megatron_fp8rl.rl.losses import sequence_ratio, token_ratio
from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig


class ClipCalibrator:
    """The Calibrated Clipping state of a run (the same on every rank)."""

    def __init__(self, algo: AlgorithmConfig, record_dir: Path | None = None):
        """`record_dir`: where each calibration's values go (algorithm.calibration.record), or None."""
        self.every, self.level, self.smoothing = algo.calibration.every, algo.ratio_level, algo.calibration.smoothing
        self.configured = ClipBounds.from_epsilons(algo.clip.low, algo.clip.high)
        self.limits: ClipLimits = algo.calibration.limits
        self.applies = algo.calibration.mode == "shadow"
        """Whether calibrations set the bounds (shadow) or are only reported (monitor, gate)."""
        self.gated = algo.calibration.mode == "gate"
        """The loss takes its clip decisions on the shadow's ratio (actor.update): the diagnostic of
        the decisions taken is the shadow's own (no over-clip), the FP8 ratio's goes to clip/*_fp8."""
        self.gate_every = algo.calibration.gate_every
        self.rule, self.noise_tail = algo.calibration.rule, algo.calibration.noise_tail
        self.overclip_budget = algo.calibration.overclip_budget
        self.calibrated: ClipBounds | None = None
        """The bounds in force after the last successful calibration; None before the first."""
        self.calibrations = self.skipped = 0
        self.last: Calibration | None = None
        self.record_dir = record_dir

    def gates(self, step: int) -> bool:
        """Whether RL step `step` (1-based) runs the gate (mode=gate; the first step, then every
        `gate_every` steps)."""
        return self.gated and (step - 1) % self.gate_every == 0

    def due(self, step: int) -> bool:
        """Whether RL step `step` (1-based) calibrates: the first, then every `every` steps; under
        the gate only a gated step (its shadow forwards are the ones the diagnostic reads)."""
        return (step - 1) % self.every == 0 and (not self.gated or self.gates(step))

    @staticmethod
    def batch_index(mini_batches: int) -> int:
        """m*, the mini-batch a calibrating step calibrates on (module docstring)."""
        return 1 if mini_batches >= 2 else 0

    @property
    def bounds(self) -> ClipBounds:
        return self.calibrated or self.configured

    def update(self, fp8: torch.Tensor, fp8_old: torch.Tensor, shadow: torch.Tensor, shadow_old: torch.Tensor,
               advantages: torch.Tensor, mask: torch.Tensor, step: int = 0) -> dict[str, float]:
        """All ranks (collective): calibrate from this rank's rows of m* ([b, S] each; empty [0, S]
        where the rank computes no loss) and return the calibration metrics; RL step `step` names
        the record file."""
        ratio_fn = sequence_ratio if self.level == "sequence" else token_ratio
        args = (mask,) if self.level == "sequence" else ()
        fp8_ratio = ratio_fn(fp8.double(), fp8_old.double(), *args)
        shadow_ratio = ratio_fn(shadow.double(), shadow_old.double(), *args)
        ratio, adv = calibration_values(fp8_ratio, advantages, mask, self.level)
        shadow_values, _ = calibration_values(shadow_ratio, advantages, mask, self.level)
        ratio, shadow_values, adv = _gathered(torch.stack([ratio, shadow_values, adv]))
        if self.record_dir is not None and dist.get_rank() == 0:
            _record(self.record_dir / f"step_{step:05d}.safetensors", ratio, shadow_values, adv)
        previous = self.bounds
        self.last = calibrate(ratio, shadow_values, adv, self.configured, previous, self.calibrated,
                              self.limits, self.smoothing, self.rule, self.noise_tail, self.overclip_budget)
        if self.last.skipped:
            self.skipped += 1
        else:
            self.calibrations += 1
            if self.applies:
                self.calibrated = self.last.bounds
        out = {"clip/calibrated": 1.0, "clip/calibration_values": float(ratio.numel()),
               "clip/neg_values": float((adv < 0).sum())}  # what clip/neg_* shares are shares of
        for when, diagnostic in (("before", self.last.before), ("after", self.last.after)):
            out.update({f"clip/{name}_{when}": value for name, value in diagnostic.items()})
        if self.gated and not self.last.skipped:  # the loss decides the clip on the shadow's ratio (gate)
            out.update({f"clip/{name}_fp8": value for name, value in self.last.before.items()})
            decided = clip_diagnostic(shadow_values, shadow_values, adv, self.configured, self.configured)
            out.update({f"clip/{name}_before": value for name, value in decided.items()})
        out.update({f"clip/fp8_noise_{name}": value for name, value in self.last.noise.items()})
        return out

    def metrics(self) -> dict[str, float]:
        """Every step: the bounds in force, the last calibration's α and balances, counts."""
        last = self.last
        return {"clip/low": self.bounds.low, "clip/high": self.bounds.high,
                "clip/alpha": last.alpha if last else math.nan,
                "clip/balance_shadow": last.balance_shadow if last else math.nan,
                "clip/balance_fp8": last.balance_fp8 if last else math.nan,
                "clip/low_at_limit": float(last.low_at_limit) if last else math.nan,
                "clip/high_at_limit": float(last.high_at_limit) if last else math.nan,
                "clip/calibrations": float(self.calibrations), "clip/calibrations_skipped": float(self.skipped)}

    def state_dict(self) -> dict:
        """For checkpoints (JSON-friendly)."""
        bounds = self.calibrated
        return {"calibrated": None if bounds is None else [bounds.low, bounds.high],
                "calibrations": self.calibrations, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        bounds = state["calibrated"]
        self.calibrated = None if bounds is None else ClipBounds(*bounds)
        self.calibrations, self.skipped = int(state["calibrations"]), int(state["skipped"])


def _record(path: Path, ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor) -> None:
    """One calibration's values as `calibrate` takes them, written atomically (temporary, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({"ratio": ratio.contiguous(), "shadow_ratio": shadow_ratio.contiguous(),
               "advantages": advantages.contiguous()}, str(partial))
    os.replace(partial, path)


def _gathered(values: torch.Tensor) -> torch.Tensor:
    """`values` [k, n] of every rank that computes the loss once (TP rank 0 of the last pipeline
    stage), concatenated along n in rank order, on every rank (one collective)."""
    owner = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
             and parallel_state.get_tensor_model_parallel_rank() == 0)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, values.cpu() if owner else values[:, :0].cpu())
    return torch.cat(parts, dim=1)
