"""Policy losses: PPO clipping (DAPO clip-higher, dual-clip), GSPO's sequence ratio, loss
aggregation, entropy bonus, and the KL penalty toward a reference policy (its estimators: rl/kl.py;
off unless a coefficient is given, as DAPO and GSPO drop the term).

Owns: per-token surrogate losses and their reduction to the scalar the trainer backpropagates.
Must not import: anything from megatron_fp8rl outside rl/, megatron, or model code (layer L0).

Shapes: every per-token tensor is [B, T] (B sequences, T response positions, right-padded);
`response_mask` [B, T] bool or 0/1 marks the tokens that count. Losses are to be minimized.
Naming: `logprobs` = log π_θ(y_t) under the parameters being trained (carries the gradient);
`old_logprobs` = log π_θold(y_t) recomputed by the trainer before the update (no gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fp8rl.rl.calibrated_clipping import ClipBounds, is_clipped
from megatron_fp8rl.rl.common import (
    RLInputError,
    check_finite,
    check_ndim,
    check_same_shape,
    float_mask,
)
from megatron_fp8rl.rl.kl import kl_estimate, kl_metrics
from megatron_fp8rl.rl.metrics import clip_metrics, entropy_metrics

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
_LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far outside any clip range, and no fp32 overflow.


def aggregate_loss(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    max_response_length: int | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses [B, T] to a scalar (verl's `agg_loss` modes; m = response_mask).

        token-mean               Σ_it m·L / Σ_it m                   (DAPO: every token weighs the same)
        seq-mean-token-sum       (1/B) Σ_i Σ_t m·L
        seq-mean-token-mean      (1/B) Σ_i (Σ_t m·L / Σ_t m)         (GRPO paper, GSPO)
        seq-mean-token-sum-norm  (1/B) Σ_i Σ_t m·L / L_max           (Dr. GRPO; TRL's `dr_grpo`)

    L_max is `max_response_length` (default T; pass the rollout's max new tokens so the scale does
    not vary with the batch's padding). verl's seq-mean-token-sum-norm omits the 1/B (a constant
    factor B); we follow Dr. GRPO/TRL. An all-masked row counts as a zero-loss sequence.

    Args:
        denominator: replaces Σ_it m (token-mean) or B (seq-mean-*) — pass global token/sequence
            counts when a batch is split into micro-batches or data-parallel ranks.

    Returns:
        0-dim tensor in token_losses' dtype.
    """
    check_ndim("token_losses", token_losses, 2, "[B, T]")
    mask = float_mask("response_mask", response_mask, token_losses)
    if mode not in AGGREGATION_MODES:
        raise RLInputError(f"unknown loss aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}")
    masked = token_losses * mask
    if mode == "token-mean":
        count = mask.sum().clamp(min=1) if denominator is None else denominator
        return masked.sum() / count
    per_sequence = masked.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / mask.sum(dim=1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = per_sequence / (max_response_length or token_losses.shape[1])
    count = token_losses.shape[0] if denominator is None else denominator
    return per_sequence.sum() / count


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    decision_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate per token (loss form), with separate epsilons and optional dual clip.

        L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))          (PPO; DAPO clip-higher: ε_high > ε_low)
        L = min(L, −A·c)  where A < 0, if dual_clip = c > 1        (dual-clip PPO, Ye et al. 2020)

    So a token with A > 0 and r > 1 + ε_high, or A < 0 and r < 1 − ε_low, or A < 0 and r > c, has a
    constant loss and gets no gradient. All tensors [B, T]; returns [B, T].

    `decision_ratio` (the shadow gate, algorithm.calibration.mode=gate): which tokens are clipped is
    decided on this ratio instead (the same conditions on it); a clipped token's loss is −A·clip(r)
    (−A·c for the dual clip) with no gradient, an unclipped one's −A·r, so the gradient flows
    through r wherever the decision ratio leaves the token active.
    """
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise RLInputError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise RLInputError(f"dual_clip must be > 1, got {dual_clip}")
    if decision_ratio is not None:
        check_same_shape("ratio", ratio, decision_ratio=decision_ratio)
        return _gated_surrogate(ratio, advantages, decision_ratio.detach(), clip_low, clip_high, dual_clip)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        losses = torch.where(advantages < 0, torch.minimum(losses, -advantages * dual_clip), losses)
    return losses


def _gated_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, decision: torch.Tensor, clip_low: float,
                     clip_high: float, dual_clip: float | None) -> torch.Tensor:
    """`clipped_surrogate` with the clip decided on `decision` (its docstring)."""
    negative = advantages < 0
    clipped = is_clipped(decision, advantages, ClipBounds.from_epsilons(clip_low, clip_high))
    constant = (-advantages * ratio.clamp(1 - clip_low, 1 + clip_high)).detach()
    if dual_clip is not None:
        dual = negative & (decision > dual_clip)
        clipped = clipped | dual
        constant = torch.where(dual, -advantages * dual_clip, constant)
    return torch.where(clipped, constant, -advantages * ratio)


def token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """PPO's per-token importance ratio r_t = π_θ(y_t)/π_old(y_t) = exp(logp − old_logp), [B, T].

    The log-ratio is clamped to ±20 (as verl does) so exp cannot overflow.
    """
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return log_ratio.exp()


def sequence_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's length-normalized sequence ratio, broadcast to tokens (Zheng et al. 2025, GSPO-token).

        s_i   = (π_θ(y_i)/π_old(y_i))^(1/|y_i|) = exp((1/|y_i|) Σ_t m·(logp − old_logp))
        s_i,t = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)]

    s_i,t equals s_i in value, and its gradient is s_i·∇logp_t, so with sequence-level advantages
    the gradient is GSPO's. Returns [B, T] (s_i on every position of row i).
    """
    mask = float_mask("response_mask", response_mask, logprobs)
    lengths = mask.sum(dim=1).clamp(min=1)
    mean_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1) / lengths
    mean_log_ratio = mean_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    log_ratio = mean_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    return log_ratio.exp()


@dataclass(frozen=True)
class PolicyLoss:
    """The scalar to backpropagate and detached 0-dim metrics about it."""

    loss: torch.Tensor
    """Total loss: policy-gradient term − entropy_coef·entropy + kl_coef·KL."""
    metrics: dict[str, torch.Tensor]
    """pg_loss, clip fractions, ratio min/mean/max, and entropy / kl_loss, kl/mean, kl/max when
    those terms are on."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ratio_level: str = "token",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg_mode: str = "token-mean",
    max_response_length: int | None = None,
    denominator: float | torch.Tensor | None = None,
    correction_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    decision_ratio: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> PolicyLoss:
    """GRPO / DAPO / GSPO policy loss with optional mismatch correction, entropy bonus and KL penalty.

        L_t  = w_t · max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high))  [dual clip: see clipped_surrogate]
        loss = agg(L) − entropy_coef · agg(H) + kl_coef · agg(k(logp, ref_logp))

    ρ_t is `token_ratio` (ratio_level="token": GRPO, DAPO) or `sequence_ratio` ("sequence": GSPO,
    which the paper pairs with clip 3e-4/4e-4 and agg_mode="seq-mean-token-mean"). w_t are the
    detached train/rollout mismatch weights from correction.py (TIS or MIS), 1 when None; tokens
    with w_t = 0 stay in the aggregation's denominator, as in the TIS/IcePop objectives.
    DAPO: clip_high=0.28, clip_low=0.2, agg_mode="token-mean".

    Args:
        logprobs, old_logprobs, advantages, response_mask: [B, T]. advantages must be finite.
        correction_weights, entropy: [B, T] or None. `entropy` is the policy's
            per-token entropy (differentiable, from logprobs.py); its mean is reported when given.
        agg_mode, max_response_length, denominator: see `aggregate_loss`.
        decision_ratio: [B, T] or None: the ratio that decides which tokens are clipped (the shadow
            gate; token level only, see `clipped_surrogate`); the clip_frac_* metrics count its
            decisions, ratio_* stay those of ρ.
        ref_logprobs, kl_coef, kl_estimator: log π_ref [B, T], β and the estimator (rl/kl.py) of
            the KL term, aggregated as the policy term but without the mismatch weights (verl's
            use_kl_loss); off when kl_coef is 0.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, correction_weights,
                         entropy, ratio_level)
    if kl_coef and ref_logprobs is None:
        raise RLInputError("kl_coef is set but ref_logprobs is None (the reference policy's log-probs)")
    if ratio_level == "token":
        ratio = token_ratio(logprobs, old_logprobs)
    else:
        ratio = sequence_ratio(logprobs, old_logprobs, response_mask)
    if decision_ratio is not None and ratio_level != "token":
        raise RLInputError(f"a clip decision ratio (the shadow gate) is wired for ratio_level token, not {ratio_level!r}")
    surrogate = clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high,
                                  dual_clip=dual_clip, decision_ratio=decision_ratio)
    if correction_weights is not None:
        surrogate = surrogate * correction_weights.detach()

    def aggregate(token_values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(token_values, response_mask, agg_mode,
                              max_response_length=max_response_length, denominator=denominator)

    pg_loss = aggregate(surrogate)
    loss = pg_loss
    metrics = {"pg_loss": pg_loss.detach()}
    metrics.update(clip_metrics(ratio, advantages, response_mask, clip_low=clip_low,
                                clip_high=clip_high, dual_clip=dual_clip))
    if decision_ratio is not None:  # the clip fractions are the decisions taken
        decided = clip_metrics(decision_ratio, advantages, response_mask, clip_low=clip_low,
                               clip_high=clip_high, dual_clip=dual_clip)
        metrics.update({name: value for name, value in decided.items() if "clip_frac" in name})
    if entropy_coef and entropy is None:
        raise RLInputError("entropy_coef is set but entropy is None")
    if entropy is not None:
        loss = loss - entropy_coef * aggregate(entropy)
        metrics.update(entropy_metrics(entropy, response_mask))
    if kl_coef:
        penalty = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        kl_loss = aggregate(penalty)
        loss = loss + kl_coef * kl_loss
        metrics.update({"kl_loss": kl_loss.detach(), **kl_metrics(penalty, response_mask)})
    return PolicyLoss(loss=loss, metrics=metrics)


def _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, correction_weights,
                         entropy, ratio_level) -> None:
    check_ndim("logprobs", logprobs, 2, "[B, T]")
    check_same_shape(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages,
        response_mask=response_mask, correction_weights=correction_weights, entropy=entropy,
    )
    check_finite("advantages", advantages)
    if ratio_level not in RATIO_LEVELS:
        raise RLInputError(f"unknown ratio_level {ratio_level!r}; choose one of {RATIO_LEVELS}")
