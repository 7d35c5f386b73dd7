"""The train/rollout noise floor of one RL step and the trust-region thresholds calibrated to it.

The rollout engine (SGLang, often FP8) and the trainer score the same sampled tokens with the same
weights but different kernels and quantization. Per response token, the noise is

    Δ_t = log π_old(y_t) − log π_rollout(y_t)        [B, T]

with π_old the trainer's policy *before* any update of the step (its recomputed old logprobs, or
the first forward of the update while the parameters are still θ_old). Δ is pure noise: no policy
change is in it. Everything here is measured from the batch itself, before the update.

Why it matters: the ratio a PPO objective clips is r_R = π_θ/π_rollout when the rollout logprobs
serve as the old policy ("bypass"), and exactly

    log r_R = log r_T + Δ,     r_T = π_θ/π_old (the trainer-side ratio, policy change only)

so a fixed interval on r_R clips tokens whose policy barely moved whenever |Δ| is large, and TIS
caps / MIS bands on ρ = π_old/π_rollout = exp(Δ) truncate or mask tokens for noise alone.

Owns: `estimate_noise` (masked quantiles of Δ and |Δ| at token or sequence level), the calibrated
thresholds (`widened_clip`, `calibrated_tis_cap`, `calibrated_mis_band`: plain float math with the
formula in each docstring) and `clip_attribution` (clipped because of noise vs policy change).
Must not import: anything from megatron_fp8rl outside rl/, megatron, or model code (layer L0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_fp8rl.rl.common import RLInputError, check_same_shape, checked_log_ratio, float_mask, masked_mean
from megatron_fp8rl.rl.losses import sequence_ratio, token_ratio
from megatron_fp8rl.rl.metrics import _masked_quantiles  # one quantile implementation in rl/

NOISE_LEVELS = ("token", "sequence")
_EXP_LIMIT = 700.0  # |log| beyond any bound; keeps math.exp/expm1 finite (they raise past ~709).


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """Quantiles of `values` [B, T] over the positions where `mask` is set, one per level → [L].

    Linear interpolation between order statistics, as `torch.quantile` (metrics' sort-based helper,
    no host sync); zeros, not NaN, when the mask selects nothing: no evidence of noise, no widening.
    """
    if not all(0.0 <= level <= 1.0 for level in levels):
        raise RLInputError(f"quantile levels must lie in [0, 1], got {levels}")
    mask = float_mask("mask", mask, values)
    quantiles = _masked_quantiles(values.detach().float(), mask, list(levels))
    # only an empty mask becomes 0: a NaN from non-finite logprobs must reach the threshold checks
    return torch.where(mask.sum() > 0, quantiles, torch.zeros_like(quantiles))


@dataclass(frozen=True)
class NoiseFloor:
    """Quantiles of the noise Δ and of |Δ| at `levels` (see `estimate_noise`)."""

    levels: tuple[float, ...]
    """Quantile levels, each in [0, 1]."""
    delta: torch.Tensor
    """[L] float: q_level(Δ)."""
    abs_delta: torch.Tensor
    """[L] float: q_level(|Δ|)."""
    count: torch.Tensor
    """0-dim: how many tokens (token level) or sequences (sequence level) were measured."""

    def delta_at(self, level: float) -> float:
        """q_level(Δ) as a float; `level` must be one of `levels`."""
        if level not in self.levels:
            raise RLInputError(f"noise quantile level {level} was not estimated; have {self.levels}")
        return float(self.delta[self.levels.index(level)])

    def metrics(self) -> dict[str, torch.Tensor]:
        """`noise/delta_q<level>`, `noise/abs_delta_q<level>` and `noise/count`, detached 0-dim."""
        out = {"noise/count": self.count.detach().float()}
        for index, level in enumerate(self.levels):
            out[f"noise/delta_q{level:g}"] = self.delta[index].detach()
            out[f"noise/abs_delta_q{level:g}"] = self.abs_delta[index].detach()
        return out

    @classmethod
    def from_metrics(cls, metrics: dict[str, float], levels: tuple[float, ...]) -> "NoiseFloor":
        """Rebuild from `metrics()` values (e.g. after averaging over micro-batches and ranks)."""
        delta = torch.tensor([metrics[f"noise/delta_q{level:g}"] for level in levels])
        abs_delta = torch.tensor([metrics[f"noise/abs_delta_q{level:g}"] for level in levels])
        return cls(tuple(levels), delta, abs_delta, torch.tensor(float(metrics["noise/count"])))


def estimate_noise(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    levels: tuple[float, ...],
    level: str = "token",
) -> NoiseFloor:
    """The step's noise floor: quantiles of Δ = train_logprobs − rollout_logprobs and of |Δ|.

        token:     over the response tokens, Δ_t                                  (B·T values, masked)
        sequence:  over the non-empty sequences, Δ̄_i = (1/|y_i|) Σ_t m·Δ_t       (GSPO's log-ratio noise)

    `train_logprobs` must be log π_old (no update yet): recomputed old logprobs, or the detached
    logprobs of the update's first forward. Inputs [B, T]; detached; returns a `NoiseFloor`.
    """
    delta, mask = checked_log_ratio(train_logprobs, rollout_logprobs, response_mask)
    if level not in NOISE_LEVELS:
        raise RLInputError(f"unknown noise level {level!r}; choose one of {NOISE_LEVELS}")
    if level == "sequence":
        has_tokens = mask.sum(dim=1) > 0
        delta, mask = masked_mean(delta, mask, dim=1)[:, None], has_tokens.float()[:, None]
    levels = tuple(float(value) for value in levels)
    return NoiseFloor(levels, masked_quantiles(delta, mask, levels),
                      masked_quantiles(delta.abs(), mask, levels), mask.sum())


def widened_clip(
    clip_low: float,
    clip_high: float,
    noise_low: float,
    noise_high: float,
    *,
    clip_low_max: float,
    clip_high_max: float,
) -> tuple[float, float]:
    """Bypass-mode PPO epsilons: the configured interval widened by the noise tails, bounded.

        1 + ε_high' = (1 + ε_high) · exp(max(q_α(Δ), 0))          ε_high' <= clip_high_max
        1 − ε_low'  = (1 − ε_low)  · exp(min(q_{1−α}(Δ), 0))      ε_low'  <= clip_low_max

    with noise_high = q_α(Δ), noise_low = q_{1−α}(Δ) (α: the configured noise quantile, e.g. 0.9).
    Why: log r_R = log r_T + Δ, so in log space the interval on r_R that matches the configured
    trust region on the policy change r_T is that interval shifted by the noise. Widening each side
    by the α tail of Δ on that side means a token whose policy change sits exactly at the edge of
    the configured interval is clipped for noise with probability at most 1 − α per side (its Δ
    falls beyond the tail quantile), while the widening never exceeds what the noise actually
    measured this step. The interval only widens (ε' >= ε) and stays within the configured limits,
    so a burst of noise cannot remove the trust region. Computed as ε + (1 ± ε)·expm1(·), so zero
    noise returns the configured epsilons bit for bit.
    """
    _check_finite_noise(noise_low, noise_high)
    high = clip_high + (1 + clip_high) * math.expm1(min(max(noise_high, 0.0), _EXP_LIMIT))
    low = clip_low - (1 - clip_low) * math.expm1(max(min(noise_low, 0.0), -_EXP_LIMIT))
    return min(max(low, clip_low), clip_low_max), min(max(high, clip_high), clip_high_max)


def calibrated_tis_cap(cap: float, noise_high: float, *, cap_max: float) -> float:
    """Noise-calibrated TIS cap on ρ = exp(Δ):  C' = min(max(C, exp(q_α(Δ))), cap_max).

    Why: ρ's α-quantile is the weight the typical noisy token carries; a cap below it truncates
    more than a 1 − α share of tokens for noise alone. C' keeps the truncated share at most 1 − α,
    never below the configured cap C (what the user asked for at low noise) and never above
    cap_max (TIS's variance bound). Zero noise returns C exactly.
    """
    _check_finite_noise(noise_high)
    return min(max(cap, _exp(noise_high)), cap_max)


def calibrated_mis_band(
    low: float, high: float, noise_low: float, noise_high: float, *, low_min: float, high_max: float
) -> tuple[float, float]:
    """Noise-calibrated MIS/IcePop band on ρ = exp(Δ):

        low'  = max(min(low,  exp(q_{1−α}(Δ))), low_min)
        high' = min(max(high, exp(q_α(Δ))),     high_max)

    Why: the same argument as `calibrated_tis_cap` on each side: the band never masks more than
    a 1 − α share of tokens per side for noise alone, never gets narrower than the configured band
    and never wider than [low_min, high_max]. Zero noise returns (low, high) exactly.
    """
    _check_finite_noise(noise_low, noise_high)
    return max(min(low, _exp(noise_low)), low_min), min(max(high, _exp(noise_high)), high_max)


def _exp(log_value: float) -> float:
    return math.exp(min(max(log_value, -_EXP_LIMIT), _EXP_LIMIT))


def _check_finite_noise(*values: float) -> None:
    if not all(math.isfinite(value) for value in values):
        raise RLInputError(f"noise quantiles must be finite, got {values}: non-finite logprobs upstream")


@torch.no_grad()
def clip_attribution(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
) -> dict[str, torch.Tensor]:
    """Which tokens an interval clips because of noise, because of policy change, or both.

    With the trainer-side ratio r_T = π_θ/π_old (policy change only) and the rollout-side ratio
    r_R = π_θ/π_rollout (policy change and noise), both at `ratio_level` (token, or GSPO's
    sequence ratio), a token is *clipped* by an interval when PPO's clip is active on it:
    A > 0 and r > 1 + ε_high, or A < 0 and r < 1 − ε_low (as `metrics.clip_metrics`). Fractions
    of response tokens, detached 0-dim:

        noise/clip_noise_only_frac    clipped on r_R, not on r_T   (noise pushed it out)
        noise/clip_policy_only_frac   clipped on r_T, not on r_R   (noise hid a policy change)
        noise/clip_both_frac          clipped on both

    All inputs [B, T]; `logprobs` is log π_θ (detached here).
    """
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                     advantages=advantages, response_mask=response_mask)
    mask = float_mask("response_mask", response_mask, logprobs.float())
    logprobs = logprobs.detach().float()

    def clipped(reference: torch.Tensor) -> torch.Tensor:
        if ratio_level == "sequence":
            ratio = sequence_ratio(logprobs, reference.float(), mask)
        else:
            ratio = token_ratio(logprobs, reference.float())
        return ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))

    trainer_side, rollout_side = clipped(old_logprobs), clipped(rollout_logprobs)
    return {
        "noise/clip_noise_only_frac": masked_mean((rollout_side & ~trainer_side).float(), mask),
        "noise/clip_policy_only_frac": masked_mean((trainer_side & ~rollout_side).float(), mask),
        "noise/clip_both_frac": masked_mean((trainer_side & rollout_side).float(), mask),
    }
