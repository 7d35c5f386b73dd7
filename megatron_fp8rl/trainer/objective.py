"""The training objective of one RL step: the policy loss with train/rollout mismatch correction per
micro-batch, its normalization, and the thresholds calibrated to the step's train/rollout noise
floor (rl.noise).

Where the noise floor Δ = log π_old − log π_rollout comes from (logged as noise/source_first_forward):
- decoupled (0): the trainer's recomputed old logprobs of the whole batch, before any update.
  With one mini-batch no recompute runs (trainer.rl_step): the update's only forward is at θ_old,
  and its detached logprobs are π_old and the noise source, as in bypass's first mini-batch (1).
- bypass (1): no recompute runs. The first mini-batch's forward happens at θ_old (no optimizer step
  yet), so each of its micro-batches estimates Δ from its own detached logprobs and clips with the
  interval widened by that estimate; later mini-batches (after an optimizer step, π_old no longer
  at hand) reuse the first mini-batch's estimate averaged over its micro-batches and DP ranks.
  A periodic recompute would cost the forward bypass exists to save, and a stale floor.

The KL penalty toward the reference policy (algorithm.kl, in the loss) is part of the policy
loss (rl.losses.policy_loss) on the reference log-probs each micro-batch carries; its kl/mean and
kl/max are averaged over micro-batches, DP ranks and mini-batches as every train metric is (kl/max:
the mean of each micro-batch's largest per-token value).

Owns: `Objective` (built once per run from AlgorithmConfig; trainer.actor.MegatronActor.update
calls its `loss` per micro-batch with the mini-batch's `MiniBatchTerms`), `effective_thresholds`.
Must not import: cli, trainer.loop, trainer.rl_step, trainer.actor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fp8rl.rl.calibrated_clipping import ClipBounds
from megatron_fp8rl.rl.common import masked_mean
from megatron_fp8rl.rl.correction import masked_importance_weights, truncated_importance_weights
from megatron_fp8rl.rl.kl import VERL_NAMES as KL_ESTIMATORS
from megatron_fp8rl.rl.losses import policy_loss, token_ratio
from megatron_fp8rl.rl.metrics import mismatch_metrics
from megatron_fp8rl.rl.noise import (
    NoiseFloor,
    calibrated_mis_band,
    calibrated_tis_cap,
    clip_attribution,
    estimate_noise,
    widened_clip,
)
from megatron_fp8rl.trainer.batch import RolloutBatch
from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig


def noise_levels(algo: AlgorithmConfig) -> tuple[float, ...]:
    """Quantile levels estimated every step: the logged ones and the tails α, 1 − α."""
    tails = {algo.noise.quantile, round(1 - algo.noise.quantile, 12)}
    return tuple(sorted(set(algo.noise.log_quantiles) | tails))


@dataclass(frozen=True)
class Thresholds:
    """The step's effective PPO epsilons and TIS/MIS thresholds (configured ones at zero noise)."""

    clip_low: float
    clip_high: float
    tis_cap: float
    mis_low: float
    mis_high: float

    def metrics(self, correction: str) -> dict[str, torch.Tensor]:
        out = {"noise/clip_low": self.clip_low, "noise/clip_high": self.clip_high}
        if correction == "tis":
            out["noise/tis_cap"] = self.tis_cap
        if correction == "mis":
            out.update({"noise/mis_low": self.mis_low, "noise/mis_high": self.mis_high})
        return {name: torch.tensor(value, dtype=torch.float64) for name, value in out.items()}


def effective_thresholds(algo: AlgorithmConfig, noise: NoiseFloor,
                         clip_bounds: ClipBounds | None = None) -> Thresholds:
    """bypass: the clip interval widened by the noise tails (rl.noise.widened_clip); decoupled: the
    configured one (its ratio has no noise). `clip_bounds`: Calibrated Clipping's bounds, which
    replace both (trainer/clip_calibration.py). noise.correction: calibrated TIS cap and MIS band."""
    low_tail = noise.delta_at(round(1 - algo.noise.quantile, 12))
    high_tail = noise.delta_at(algo.noise.quantile)
    clip_low, clip_high = algo.clip.low, algo.clip.high
    if clip_bounds is not None:
        clip_low, clip_high = clip_bounds.epsilons()
    elif algo.old_policy == "bypass":
        clip_low, clip_high = widened_clip(clip_low, clip_high, low_tail, high_tail,
                                           clip_low_max=algo.noise.clip_low_max,
                                           clip_high_max=algo.noise.clip_high_max)
    tis_cap, mis_low, mis_high = algo.tis_cap, algo.mis_low, algo.mis_high
    if algo.noise.correction:
        tis_cap = calibrated_tis_cap(tis_cap, high_tail, cap_max=algo.noise.tis_cap_max)
        mis_low, mis_high = calibrated_mis_band(mis_low, mis_high, low_tail, high_tail,
                                                low_min=algo.noise.mis_low_min,
                                                high_max=algo.noise.mis_high_max)
    return Thresholds(clip_low, clip_high, tis_cap, mis_low, mis_high)


def _correction(algo: AlgorithmConfig, old, rollout, mask, limits: Thresholds):
    if algo.correction == "tis":
        return truncated_importance_weights(old, rollout, mask, cap=limits.tis_cap)
    if algo.correction == "mis":
        return masked_importance_weights(old, rollout, mask, low=limits.mis_low, high=limits.mis_high)
    return None


@dataclass(frozen=True)
class MiniBatchTerms:
    """What one mini-batch's loss needs beside its micro-batches (MegatronActor.update sets it)."""

    denominator: float
    """The mini-batch's loss aggregate per micro-batch share (`Objective.denominator`)."""
    noise: NoiseFloor | None = None
    """The step's noise floor; None only for the first mini-batch without a recompute, which
    estimates it per micro-batch from its forward at θ_old (module docstring)."""
    at_old_policy: bool = False
    """The update's first mini-batch (θ = θ_old): also log the training forward's own noise against
    π_old, noise/train_forward_abs_delta_{mean,max} = |log π_θ − log π_old| over response tokens;
    nonzero means the PPO ratio carries that noise."""
    clip_bounds: ClipBounds | None = None
    """Calibrated Clipping's bounds in force (None: the configured interval)."""
    capture: list | None = None
    """A list that receives (logprobs, π_old, advantages, response_mask), detached [B, S], per
    micro-batch: the FP8 ratio's terms a calibration needs (trainer/clip_calibration.py)."""


class Objective:
    """The RL objective of a run, built once from its AlgorithmConfig: the policy loss with
    mismatch correction per micro-batch, its normalization, and the step's noise floor."""

    def __init__(self, algo: AlgorithmConfig, max_response_length: int):
        """`max_response_length`: rollout.max_new_tokens (the seq-mean-token-sum-norm divisor)."""
        self.algo, self.max_response_length = algo, max_response_length
        self.levels = noise_levels(algo)

    def denominator(self, mini: RolloutBatch, micro_batch_size: int, dp_size: int) -> float:
        """Makes each micro-batch's loss a share of the mini-batch aggregate: Megatron divides by
        the number of micro-batches and DDP averages over DP ranks, so scale both back in."""
        micro_per_rank = mini.size // dp_size // micro_batch_size
        if self.algo.agg_mode == "token-mean":
            count = float(mini.response_mask.sum())
        else:
            count = float((mini.response_mask.sum(dim=1) > 0).sum())
        return max(count, 1.0) / (micro_per_rank * dp_size)

    def noise_floor(self, batch: RolloutBatch, old_logprobs: torch.Tensor) -> NoiseFloor:
        """Decoupled mode: the noise floor of the whole batch from the recomputed old logprobs
        [B, S] (token level; per-sequence mean Δ for GSPO, whose ratio is a per-sequence geometric
        mean)."""
        return estimate_noise(old_logprobs, batch.rollout_logprobs, batch.response_mask, self.levels,
                              self.algo.ratio_level)

    def loss(self, terms: MiniBatchTerms, mb: RolloutBatch, logprobs: torch.Tensor,
             entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) of micro-batch `mb` given the policy's `logprobs` and `entropy` [B, S]:
        mismatch and noise metrics, TIS/MIS weights, the policy loss. Decoupled micro-batches carry
        `old_logprobs`; bypass ones use `rollout_logprobs` as π_old. ValueError when decoupled
        `terms` lack the noise floor only a recompute (or a forward at θ_old) gives."""
        algo = self.algo
        bypass, ratio_level = algo.old_policy == "bypass", algo.ratio_level
        if terms.noise is None and not (bypass or terms.at_old_policy):
            raise ValueError("decoupled mode needs the step's noise floor from the recomputed old logprobs "
                             "(only the update's first forward, at θ_old, can estimate its own)")
        mask, rollout = mb.response_mask, mb.rollout_logprobs
        # log π_old where it is known: the recompute, or this forward before any update (bypass;
        # decoupled without a recompute, where this is the first and only mini-batch)
        from_forward = terms.noise is None
        if bypass:
            trainer_old = logprobs.detach() if from_forward else None
        else:
            trainer_old = logprobs.detach() if from_forward else mb.old_logprobs
        floor = terms.noise if not from_forward else estimate_noise(trainer_old, rollout, mask, self.levels,
                                                                    ratio_level)
        limits = effective_thresholds(algo, floor, terms.clip_bounds)
        metrics = {**floor.metrics(), **limits.metrics(algo.correction),
                   "noise/source_first_forward": torch.tensor(float(bypass or from_forward))}
        weights = None
        if trainer_old is not None:
            metrics.update(mismatch_metrics(trainer_old, rollout, mask))
        correction = None if bypass else _correction(algo, trainer_old, rollout, mask, limits)
        if correction is not None:
            weights = correction.weights
            metrics.update(correction.metrics)
        old = rollout if bypass else trainer_old
        if terms.capture is not None:
            terms.capture.append(tuple(t.detach() for t in (logprobs, old, mb.advantages, mask)))
        decision = None  # the shadow gate: the clip decided on the shadow's ratio (calibration.mode=gate)
        if mb.shadow_logprobs is not None:
            decision = token_ratio(mb.shadow_logprobs.double(), mb.shadow_old_logprobs.double()).to(logprobs.dtype)
        out = policy_loss(logprobs, old, mb.advantages, mask, ratio_level=ratio_level,
                          clip_low=limits.clip_low, clip_high=limits.clip_high, agg_mode=algo.agg_mode,
                          max_response_length=self.max_response_length, denominator=terms.denominator,
                          correction_weights=weights, entropy=entropy, entropy_coef=algo.entropy_coef,
                          dual_clip=algo.clip.dual or None, decision_ratio=decision,
                          **self._kl_loss_terms(mb))
        if terms.at_old_policy:
            metrics.update(_train_forward_noise(logprobs, old, mask))
        if trainer_old is not None:
            metrics.update(clip_attribution(logprobs, trainer_old, rollout, mb.advantages, mask,
                                            clip_low=limits.clip_low, clip_high=limits.clip_high,
                                            ratio_level=ratio_level))
        return out.loss, {**out.metrics, **metrics}


    def _kl_loss_terms(self, mb: RolloutBatch) -> dict:
        """policy_loss's KL arguments: the KL in the loss (algorithm.kl.coef, not in_reward) toward
        the reference's log-probs the micro-batch carries (trainer/reference.py); none otherwise."""
        kl = self.algo.kl
        if not kl.enabled or kl.in_reward:
            return {}
        return {"ref_logprobs": mb.ref_logprobs, "kl_coef": kl.coef, "kl_estimator": KL_ESTIMATORS[kl.estimator]}


def _train_forward_noise(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor):
    """|log π_θ − log π_old| [B, S] at θ = θ_old over the response tokens: mean and max."""
    delta = (logprobs.detach().float() - old_logprobs.float()).abs() * mask
    return {"noise/train_forward_abs_delta_mean": masked_mean(delta, mask),
            "noise/train_forward_abs_delta_max": delta.max()}
