"""Per-step RL metrics of docs/design.md's RL step that come from per-token tensors.

Owns: clip fractions, importance-ratio statistics, train/rollout mismatch statistics (with the
quantiles of the train/rollout importance ratio), the entropy mean, and the paired change of a
greedy eval (`paired_eval_change`, plain floats from per-problem results). The per-token functions
return dicts of detached 0-dim tensors (no host sync); the trainer turns them into tensorboard
scalars. Tokens outside `response_mask` never count; with no token
left, means are 0 and min/max are NaN (nothing to report).
Must not import: anything from megatron_fp8rl outside rl/, megatron, or model code (layer L0).
"""
from __future__ import annotations

import math

import torch

from megatron_fp8rl.rl.common import check_same_shape, float_mask, masked_mean


def _masked_extrema(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = mask.bool()
    nan = values.new_tensor(float("nan"))
    any_kept = keep.any()
    smallest = torch.where(keep, values, float("inf")).amin()
    largest = torch.where(keep, values, float("-inf")).amax()
    return torch.where(any_kept, smallest, nan), torch.where(any_kept, largest, nan)


@torch.no_grad()
def clip_metrics(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> dict[str, torch.Tensor]:
    """Which tokens the PPO clip silenced, and the spread of the ratio. All inputs [B, T].

        clip_frac_high  fraction of tokens with A > 0 and r > 1 + ε_high   (upper clip active)
        clip_frac_low   fraction of tokens with A < 0 and r < 1 − ε_low    (lower clip active)
        dual_clip_frac  fraction of tokens with A < 0 and r > c            (0 without dual clip)
        ratio_min / ratio_mean / ratio_max over the response tokens
    """
    check_same_shape("ratio", ratio, advantages=advantages, response_mask=response_mask)
    ratio = ratio.detach().float()
    mask = float_mask("response_mask", response_mask, ratio)
    positive, negative = advantages > 0, advantages < 0
    high = (positive & (ratio > 1 + clip_high)).float()
    low = (negative & (ratio < 1 - clip_low)).float()
    dual = (negative & (ratio > dual_clip)).float() if dual_clip is not None else torch.zeros_like(ratio)
    ratio_min, ratio_max = _masked_extrema(ratio, mask)
    return {
        "clip_frac_high": masked_mean(high, mask),
        "clip_frac_low": masked_mean(low, mask),
        "dual_clip_frac": masked_mean(dual, mask),
        "ratio_min": ratio_min,
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": ratio_max,
    }


# Quantiles of the train/rollout importance ratio exp(Δ) that mismatch_metrics reports.
RATIO_QUANTILES = (("min", 0.0), ("p01", 0.01), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9),
                   ("p99", 0.99), ("max", 1.0))


@torch.no_grad()
def mismatch_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's and the rollout engine's logprobs of the sampled tokens disagree.

    With Δ_t = log π_train(y_t) − log π_rollout(y_t) on the tokens the rollout sampled ([B, T]):
        mismatch_abs_logprob_diff_mean / _max   mean and max of |Δ|
        mismatch_k3_kl    KL(π_rollout ‖ π_train) by the k3 estimator: mean of exp(Δ) − 1 − Δ
        mismatch_prob_error   token multiplicative probability error exp(mean |Δ|)
        mismatch_ratio_{min,p01,p10,p50,p90,p99,max}   quantiles of the importance ratio
                          ρ = exp(Δ) = π_train/π_rollout (Δ clamped at 20); NaN with no token.
                          The trainer averages them over micro-batches and DP ranks.
    """
    check_same_shape("train_logprobs", train_logprobs, rollout_logprobs=rollout_logprobs,
                     response_mask=response_mask)
    delta = (train_logprobs.detach() - rollout_logprobs.detach()).float()
    mask = float_mask("response_mask", response_mask, delta)
    abs_delta = delta.abs()
    mean_abs = masked_mean(abs_delta, mask)
    _, max_abs = _masked_extrema(abs_delta, mask)
    k3 = torch.expm1(delta.clamp(max=20.0)) - delta
    ratio = delta.clamp(max=20.0).exp()
    quantiles = _masked_quantiles(ratio, mask, [q for _, q in RATIO_QUANTILES])
    return {
        "mismatch_abs_logprob_diff_mean": mean_abs,
        "mismatch_abs_logprob_diff_max": max_abs,
        "mismatch_k3_kl": masked_mean(k3, mask),
        "mismatch_prob_error": mean_abs.exp(),
        **{f"mismatch_ratio_{name}": value for (name, _), value in zip(RATIO_QUANTILES, quantiles)},
    }


def _masked_quantiles(values: torch.Tensor, mask: torch.Tensor, qs: list[float]) -> torch.Tensor:
    """[len(qs)] quantiles of `values` where mask is set, interpolated linearly between order
    statistics as torch.quantile does; NaN when no element is kept. Without a host sync: kept
    values sort first (the rest become +inf) and indices come from the kept count on device.
    `values` must be finite where kept."""
    keep = mask.bool().flatten()
    ordered = torch.where(keep, values.flatten(), float("inf")).sort().values
    count = keep.sum()
    position = values.new_tensor(qs) * (count - 1).clamp(min=0)
    low, high = position.floor().long(), position.ceil().long()
    below, above = ordered[low], ordered[high]
    interpolated = below + (above - below) * (position - low)
    # kept values are finite, so the inf filler is reached only when nothing is kept
    return torch.where(count > 0, interpolated, values.new_tensor(float("nan")))


@torch.no_grad()
def entropy_metrics(entropy: torch.Tensor, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean per-token policy entropy (nats) over the response tokens; entropy is [B, T]."""
    check_same_shape("entropy", entropy, response_mask=response_mask)
    entropy = entropy.detach().float()
    return {"entropy": masked_mean(entropy, float_mask("response_mask", response_mask, entropy))}


def paired_eval_change(before: list[bool], after: list[bool]) -> dict[str, float]:
    """How a greedy eval on the same problems changed: problems gained (wrong -> right), lost
    (right -> wrong), and the exact two-sided McNemar p-value, p = min(1, 2 Σ_{k<=min(g,l)}
    C(g+l, k) / 2^(g+l)): the chance of a split at least this lopsided if gains and losses were
    equally likely (1.0 when nothing changed). A paired test: far more sensitive than comparing
    two accuracies, whose binomial noise is mostly shared by the same problems."""
    if len(before) != len(after):
        raise ValueError(f"paired eval needs the same problems: {len(before)} results before, {len(after)} after")
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    n = gained + lost
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2 ** n if n else 0.5
    return {"gained": float(gained), "lost": float(lost), "mcnemar_p": min(1.0, 2 * tail)}


def eval_verdict(summary: dict, alpha: float = 0.01) -> str:
    """One plain sentence on whether a run's held-out greedy accuracy changed, read from the run
    summary (eval/accuracy_start, eval/accuracy, eval/gained, eval/lost, eval/mcnemar_p): it
    learned or got worse only when the paired McNemar test says so at `alpha`."""
    keys = ("eval/accuracy_start", "eval/accuracy", "eval/gained", "eval/lost", "eval/mcnemar_p")
    if any(key not in summary for key in keys):
        return "verdict: no held-out eval ran at both the start and the end (data.eval_size or train.eval_every), so no verdict"
    start, end, gained, lost, p = (summary[key] for key in keys)
    change = (f"held-out greedy accuracy {start:.3f} -> {end:.3f} ({int(gained)} problems gained, "
              f"{int(lost)} lost, McNemar p = {p:.2g})")
    if p >= alpha:
        return f"verdict: no significant change at p < {alpha:g}: {change}"
    return f"verdict: {'the model learned' if gained > lost else 'the model got worse'}: {change}"


def garbled_flags(text: str, token_ids: list[int], ngram: int = 3, repeats: int = 3) -> tuple[bool, bool]:
    """Whether one response looks garbled (the stability study's rate): (no number: its text has
    no digit, so no numeric answer can be read from it; repetitive: some `ngram` of its tokens
    occurs `repeats` times or more, the loop a collapsing policy falls into)."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(token_ids) - ngram + 1):
        key = tuple(token_ids[i:i + ngram])
        counts[key] = counts.get(key, 0) + 1
    return not any(c.isdigit() for c in text), max(counts.values(), default=0) >= repeats
