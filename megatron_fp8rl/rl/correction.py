"""Correcting for the mismatch between the rollout engine's policy and the trainer's.

The rollout engine (SGLang, FP8) samples y ~ π_rollout while the trainer's loss assumes samples
from π_train (same weights, different kernels and quantization). Two literature remedies, both
weights on the per-token loss that are *detached* (no gradient flows through them):

- truncated importance sampling, TIS (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): w = min(ρ, C);
- masked importance sampling, MIS / IcePop (Liu et al. 2025, "When speed kills stability";
  Ling team 2025, IcePop): w = ρ · 1[low <= ρ <= high], i.e. tokens whose ratio falls outside the
  band are dropped from the gradient, the others keep their importance weight.

where ρ = π_train(y)/π_rollout(y) at the *old* parameters: `train_logprobs` are the trainer's
recomputed old logprobs, `rollout_logprobs` the engine's, both for the sampled tokens, [B, T].
Levels: "token" uses ρ_t; "sequence" the product ρ_i = Π_t ρ_t (exp Σ_t m·Δ_t); "geometric" its
per-token geometric mean exp((1/|y_i|) Σ_t m·Δ_t). Sequence levels put ρ_i on every token of row i.

Owns: those weights and their metrics. Must not import: anything from megatron_fp8rl outside rl/,
megatron, or model code (layer L0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fp8rl.rl.common import RLInputError, checked_log_ratio, float_mask, masked_mean

CORRECTION_LEVELS = ("token", "sequence", "geometric")
_LOG_RATIO_LIMIT = 30.0  # exp(30) ~ 1e13: beyond any cap or band, finite in fp32.


@dataclass(frozen=True)
class ImportanceCorrection:
    """Detached per-token weights for `losses.policy_loss(correction_weights=...)` and metrics."""

    weights: torch.Tensor
    """[B, T] float, detached, 0 on positions outside response_mask."""
    metrics: dict[str, torch.Tensor]
    """Detached 0-dim tensors: tis_clip_frac (TIS) or mis_drop_frac (MIS), and the mean weight."""


def importance_log_ratio(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
) -> torch.Tensor:
    """log ρ at the requested level, [B, T], detached and clamped to ±30 (see module docstring)."""
    delta, mask = checked_log_ratio(train_logprobs, rollout_logprobs, response_mask)
    if level not in CORRECTION_LEVELS:
        raise RLInputError(f"unknown correction level {level!r}; choose one of {CORRECTION_LEVELS}")
    if level == "token":
        log_ratio = delta
    else:
        per_sequence = (delta * mask).sum(dim=1)
        if level == "geometric":
            per_sequence = per_sequence / mask.sum(dim=1).clamp(min=1)
        log_ratio = per_sequence[:, None].expand_as(delta)
    return log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)


def truncated_importance_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> ImportanceCorrection:
    """TIS: w = min(ρ, C), detached. Metrics: tis_clip_frac (fraction of tokens with ρ > C) and
    tis_weight_mean. Shapes [B, T]; see the module docstring for ρ and the levels."""
    if not cap > 0:
        raise RLInputError(f"TIS cap must be > 0, got {cap}")
    ratio = importance_log_ratio(train_logprobs, rollout_logprobs, response_mask, level).exp()
    mask = float_mask("response_mask", response_mask, ratio)
    weights = ratio.clamp(max=cap) * mask
    return ImportanceCorrection(
        weights=weights,
        metrics={
            "tis_clip_frac": masked_mean((ratio > cap).float(), mask),
            "tis_weight_mean": masked_mean(weights, mask),
        },
    )


def masked_importance_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
    reweight: bool = True,
) -> ImportanceCorrection:
    """MIS / IcePop: w = ρ · 1[low <= ρ <= high] (reweight=True) or just the indicator (False).

    Tokens outside the band get weight exactly 0 and keep their place in the loss denominator, as in
    the IcePop objective. Metrics: mis_drop_frac (fraction of response tokens dropped) and
    mis_weight_mean. Shapes [B, T]; see the module docstring for ρ and the levels.
    """
    if not 0 <= low < high:
        raise RLInputError(f"MIS bounds need 0 <= low < high, got low={low}, high={high}")
    ratio = importance_log_ratio(train_logprobs, rollout_logprobs, response_mask, level).exp()
    mask = float_mask("response_mask", response_mask, ratio)
    inside = (ratio >= low) & (ratio <= high)
    kept_value = ratio if reweight else torch.ones_like(ratio)
    weights = torch.where(inside, kept_value, torch.zeros_like(ratio)) * mask
    return ImportanceCorrection(
        weights=weights,
        metrics={
            "mis_drop_frac": masked_mean((~inside).float(), mask),
            "mis_weight_mean": masked_mean(weights, mask),
        },
    )
