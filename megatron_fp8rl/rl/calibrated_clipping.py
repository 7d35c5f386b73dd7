"""Calibrated Clipping ("Towards Full Pipeline FP8 Reinforcement Learning for LLMs", arXiv
2609.22870): PPO clip bounds for FP8 ratios, matched to a high-precision shadow of the same batch.

Owns: the pure math of the method: which ratios take part (`calibration_values`), the shadow's clip
share α (`shadow_clip_share`), the lower bound L matched to it (`matched_lower_bound`) or found by
our rules (`noise_lower_bound`, `budget_lower_bound`; `fp8_noise` and its quantiles), the update
balance p (`update_balance`) and the upper bound H that restores it (`rebalanced_upper_bound`),
smoothing, the paper's diagnostic (`clip_diagnostic`), and one calibration end to end
(`calibrate`). Must not import: anything of megatron_fp8rl outside rl/, megatron, model code (L0).

The failure it answers: with old and current logprobs both in FP8, quantization noise spreads the
importance ratio r = π_θ/π_old. A negative-advantage token whose high-precision ratio is above
1 − ε_low but whose FP8 ratio falls below it is clipped (no gradient): bad tokens go unpunished.

The method (notation: r_s the shadow's ratio, r the FP8 one, on the same tokens at the same θ;
N⁻ the negative-advantage tokens, N⁺ the positive ones):
- α = |{t ∈ N⁻ : r_s,t < 1 − ε_low}| / |N⁻|, the share of bad tokens high precision clips.
- L = the α-quantile of {r_t : t ∈ N⁻}: FP8 clips (r < L) the same share of them. Concretely k =
  round(α·|N⁻|) FP8 ratios lie strictly below L: every L in (r_(k−1), r_(k)] of the sorted ratios
  matches, and the one nearest the configured 1 − ε_low is taken (*our* tie-break; with ties at
  r_(k) fewer lie below). Taking the interval's top instead made a near on-policy first batch
  (α = 0, every ratio ~1) set L ≈ 0.99 (0.95 after the limit) for the steps after, whose moved
  ratios it then clipped: the over-clipping the method exists to remove (stability study,
  tensorwise_cc, 2026-12-03).
- p = Σ_{t∈N⁺, r≤H} |A_t|·r_t / Σ_{t∈N⁻, r≥L} |A_t|·r_t, the ratio of the positive to the negative
  update magnitude over the tokens the clip leaves active (*our reading* of the paper's
  "rebalanced so the positive/negative update magnitudes match"). p_shadow uses r_s with
  [1 − ε_low, 1 + ε_high]; H is where p_FP8(H) with [L, H] first reaches p_shadow. p_FP8 is a
  non-decreasing step function of H, so sorting the positive tokens by r and taking the first
  cumulative sum that reaches the target is the exact bisection; that step's p holds on
  [r_j, r_(j+1)), and H is the point of it nearest the configured 1 + ε_high (the same tie-break).
- Both bounds are kept within configured limits, smoothed over calibrations,
  b ← β·b_previous + (1 − β)·b_new (the first calibration takes b_new), and used until the next.
- Sequence level (GSPO, beyond the paper): the same matching over per-sequence ratios s_i and
  sequence advantages instead of tokens.
- At small α (high precision clips almost no bad token) the α-quantile lies below any sane floor
  and L sits at `low_min`: the lower clip is off rather than calibrated (issue 44; bf16 clipping
  ~0 of the negative-advantage tokens put L at its 0.5 limit on every step). Every calibration
  reports whether L or H sits at a limit (`Calibration.low_at_limit`, `high_at_limit`).
- rule="noise" (*ours*, beyond the paper) keeps L meaningful there: it calibrates L from the FP8
  noise instead of from α. With n_t = log r_t − log r_s,t over N⁻ (what FP8 adds to the ratio of
  a bad token), a token exactly at the configured bound 1 − ε_low has FP8 ratio (1 − ε_low)·e^n;
  L = (1 − ε_low)·exp(q_δ(n)) clips such a token with probability δ (`noise_tail`, default 0.01):
  FP8 over-clips at most δ of the tokens high precision leaves at its bound, and L does not depend
  on how many tokens high precision clips. Zero noise gives L = 1 − ε_low, plain PPO.
- rule="budget" (*ours*) targets the diagnostic itself: among the bad tokens high precision leaves
  unclipped (r_s ≥ 1 − ε_low), at most τ·|N⁻| may have an FP8 ratio below L (`overclip_budget` τ,
  default 0.01, the issue's ≤ 1% target): L is the (⌊τ·|N⁻|⌋+1)-th smallest of their FP8 ratios,
  capped at 1 − ε_low. The noise rule prices every token as if it sat at the bound; most sit near
  r_s = 1, so at the same share the budget rule's L is higher (moderate2: the noise rule's L sat
  at its 0.5 floor on 58-83% of steps). Zero noise gives 1 − ε_low.
A calibration is skipped (the previous bounds stay, the reason is returned) when any ratio is
not finite; a batch without negative-advantage tokens keeps the previous L, one without
positive-advantage tokens (or without active negative magnitude) the previous H.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megatron_fp8rl.rl.common import RLInputError, check_same_shape, float_mask


CALIBRATION_RULES = ("quantile", "noise", "budget")
"""How a calibration finds L: the paper's α-quantile, or ours from the FP8 noise or from an
over-clip budget (module docstring)."""

NOISE_LEVELS = (0.01, 0.05, 0.5, 0.95, 0.99)
"""Levels of q(n), n = log r − log r_s over N⁻, that every calibration reports (`Calibration.noise`,
logged as clip/fp8_noise_q<level>): the data a choice of `noise_tail` rests on."""


@dataclass(frozen=True)
class ClipBounds:
    """The PPO clip interval on the ratio itself: tokens with A < 0 and r < low, or A > 0 and
    r > high, are clipped (no gradient). Plain PPO: low = 1 − ε_low, high = 1 + ε_high."""

    low: float
    high: float

    def __post_init__(self):
        if not (0 <= self.low <= 1 <= self.high) or not all(map(math.isfinite, (self.low, self.high))):
            raise RLInputError(f"clip bounds need 0 <= low <= 1 <= high, finite; got [{self.low}, {self.high}]")

    @classmethod
    def from_epsilons(cls, clip_low: float, clip_high: float) -> "ClipBounds":
        return cls(1.0 - clip_low, 1.0 + clip_high)

    def epsilons(self) -> tuple[float, float]:
        """(ε_low, ε_high) with low = 1 − ε_low and high = 1 + ε_high."""
        return 1.0 - self.low, self.high - 1.0


def calibration_values(ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                       level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """The (ratio, advantage) pairs that calibration counts, as flat fp64 vectors [N].

    token: one pair per response token (mask = 1). sequence: one pair per row with a response,
    the row's first masked value (GSPO's s_i and the sequence advantage are constant on a row).
    Inputs [B, T]."""
    check_same_shape("ratio", ratio, advantages=advantages, response_mask=response_mask)
    mask = float_mask("response_mask", response_mask, ratio.float()).bool()
    if level == "token":
        return ratio.detach()[mask].double(), advantages.detach()[mask].double()
    if level != "sequence":
        raise RLInputError(f"unknown calibration level {level!r}; choose token or sequence")
    rows = mask.any(dim=1)
    first = mask.int().argmax(dim=1)
    index = torch.arange(ratio.shape[0])
    return ratio.detach()[index, first][rows].double(), advantages.detach()[index, first][rows].double()


def is_clipped(ratio: torch.Tensor, advantages: torch.Tensor, bounds: ClipBounds) -> torch.Tensor:
    """Where PPO's clip is active: (A > 0 and r > high) or (A < 0 and r < low); bool, like ratio."""
    return ((advantages > 0) & (ratio > bounds.high)) | ((advantages < 0) & (ratio < bounds.low))


def shadow_clip_share(shadow_ratio: torch.Tensor, advantages: torch.Tensor, low: float) -> float | None:
    """α = share of negative-advantage values whose shadow ratio is below `low`; None without any."""
    negative = advantages < 0
    if not bool(negative.any()):
        return None
    return float((shadow_ratio[negative] < low).double().mean())


def matched_lower_bound(ratio: torch.Tensor, advantages: torch.Tensor, alpha: float,
                        prefer: float) -> float | None:
    """L such that round(α·|N⁻|) negative-advantage ratios lie strictly below it, the one nearest
    `prefer` (the configured lower bound; module docstring); None without negative-advantage
    values."""
    if not 0 <= alpha <= 1:
        raise RLInputError(f"alpha must be in [0, 1], got {alpha}")
    negative = torch.sort(ratio[advantages < 0]).values
    if negative.numel() == 0:
        return None
    k = round(alpha * negative.numel())
    above = float(negative[k]) if k < negative.numel() else math.inf  # L <= this
    below = float(negative[k - 1]) if k > 0 else -math.inf  # L > this
    if below >= above:  # ties at r_(k): no L has exactly k below; fewer
        return above
    return min(max(prefer, math.nextafter(below, math.inf)), above)


def noise_lower_bound(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor,
                      configured_low: float, tail: float) -> float | None:
    """rule="noise" (module docstring): (1 − ε_low)·exp(q_tail(log r − log r_s)) over the
    negative-advantage values; None without any."""
    if not 0 < tail < 0.5:
        raise RLInputError(f"noise tail must be in (0, 0.5), got {tail}")
    noise = fp8_noise(ratio, shadow_ratio, advantages)
    if noise.numel() == 0:
        return None
    return configured_low * math.exp(float(torch.quantile(noise, tail)))


def budget_lower_bound(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor,
                       configured_low: float, budget: float) -> float | None:
    """rule="budget" (module docstring): the largest L <= `configured_low` under which at most
    ⌊budget·|N⁻|⌋ of the negative-advantage values that the shadow leaves unclipped (r_s >=
    configured_low) have r < L; None without negative-advantage values."""
    if not 0 <= budget < 1:
        raise RLInputError(f"over-clip budget must be in [0, 1), got {budget}")
    negative = advantages < 0
    count = int(negative.sum())
    if count == 0:
        return None
    kept = torch.sort(ratio[negative & (shadow_ratio >= configured_low)].double()).values
    allowed = math.floor(budget * count)  # values that may lie strictly below L
    return configured_low if allowed >= kept.numel() else min(configured_low, float(kept[allowed]))


def fp8_noise(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """n = log r − log r_s over the negative-advantage values (float64; empty without any): what
    FP8 adds to the log-ratio of a bad token."""
    negative = advantages < 0
    return torch.log(ratio[negative].double()) - torch.log(shadow_ratio[negative].double())


def noise_quantiles(noise: torch.Tensor, levels: tuple[float, ...] = NOISE_LEVELS) -> dict[str, float]:
    """{'q<level>': q_level(noise)} (linear interpolation, as numpy's default), {} when empty."""
    if noise.numel() == 0:
        return {}
    values = torch.quantile(noise, torch.tensor(levels, dtype=noise.dtype))
    return {f"q{level:g}": float(value) for level, value in zip(levels, values)}


def update_balance(ratio: torch.Tensor, advantages: torch.Tensor, bounds: ClipBounds) -> float | None:
    """p = Σ_{A>0, r≤high} |A|·r / Σ_{A<0, r≥low} |A|·r; None when the denominator is 0."""
    weight = advantages.abs() * ratio
    positive = ((advantages > 0) & (ratio <= bounds.high)).double()
    negative = ((advantages < 0) & (ratio >= bounds.low)).double()
    denominator = float((weight * negative).sum())
    return float((weight * positive).sum()) / denominator if denominator > 0 else None


def rebalanced_upper_bound(ratio: torch.Tensor, advantages: torch.Tensor, low: float,
                           target: float, prefer: float) -> float | None:
    """H for the interval [low, H] where p(H) first reaches `target`, the point nearest `prefer`
    (the configured upper bound) among those with that step's p (module docstring); for a
    target of 0, below the smallest positive ratio (none active); at or above the largest when
    even that falls short; None without positive-advantage values or without active negative
    magnitude."""
    negative = (advantages < 0) & (ratio >= low)
    denominator = float((advantages.abs() * ratio)[negative].sum())
    positive = advantages > 0
    if denominator <= 0 or not bool(positive.any()):
        return None
    order = torch.argsort(ratio[positive])
    sorted_ratio = ratio[positive][order]
    if target <= 0:  # nothing may stay active: below the smallest positive ratio
        return min(prefer, math.nextafter(float(sorted_ratio[0]), -math.inf))
    cumulative = torch.cumsum((advantages[positive].abs() * ratio[positive])[order], dim=0)
    # relative slack: p·denominator round-trips through a division (1 ulp must not skip a token)
    reached = (cumulative >= target * denominator * (1 - 1e-12)).nonzero()
    j = int(reached[0, 0]) if reached.numel() else sorted_ratio.numel() - 1
    first = float(sorted_ratio[j])  # H >= this
    larger = sorted_ratio[sorted_ratio > first]
    limit = math.nextafter(float(larger[0]), -math.inf) if larger.numel() else math.inf  # same p up to here
    return min(max(prefer, first), limit)


def smoothed(previous: float | None, new: float, smoothing: float) -> float:
    """β·previous + (1 − β)·new; `new` when there is no previous value."""
    if not 0 <= smoothing < 1:
        raise RLInputError(f"smoothing must be in [0, 1), got {smoothing}")
    return new if previous is None else smoothing * previous + (1 - smoothing) * new


def clip_diagnostic(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor,
                    bounds: ClipBounds, shadow_bounds: ClipBounds) -> dict[str, float]:
    """The paper's diagnostic, as shares of the negative (or positive) advantage values:
    neg_overclip   clipped on the FP8 ratio with `bounds`, not on the shadow's with `shadow_bounds`
                   (the failure: bad tokens FP8 silences that high precision would punish)
    neg_underclip  the reverse; pos_overclip / pos_underclip likewise for A > 0.
    NaN for a sign without values."""
    fp8, shadow = is_clipped(ratio, advantages, bounds), is_clipped(shadow_ratio, advantages, shadow_bounds)
    out = {}
    for sign, where in (("neg", advantages < 0), ("pos", advantages > 0)):
        count = int(where.sum())
        for name, mask in (("overclip", fp8 & ~shadow), ("underclip", shadow & ~fp8)):
            out[f"{sign}_{name}"] = float((mask & where).sum()) / count if count else math.nan
    return out


@dataclass
class ClipLimits:
    """Where calibrated bounds may go: low in [low_min, low_max], high in [high_min, high_max].
    The run config holds it as algorithm.calibration.limits (trainer/algorithm_config.py checks it against
    the configured clip interval); not frozen, so that the config loader can fill it."""

    low_min: float = 0.5
    """Lowest calibrated lower bound L (a ratio, not an epsilon)."""
    low_max: float = 0.95
    """Highest calibrated lower bound L (<= 1)."""
    high_min: float = 1.05
    """Lowest calibrated upper bound H (>= 1)."""
    high_max: float = 1.5
    """Highest calibrated upper bound H. When the FP8 ratios cannot reach the shadow's update
    balance, H rises to the largest positive-advantage ratio of the batch; at 2.0 (the default
    before) the stability study's tensorwise_cc run (seed 1, 2026-12-03) let H reach 2.0 by step 16,
    after which entropy rose 0.78 -> 2.2-2.7, 75-100% of answers held no number and held-out
    accuracy fell 0.234 -> 0.000. 1.5 is about 1 + 2·clip.high at the default clip.high."""

    def clamp(self, bounds: ClipBounds) -> ClipBounds:
        return ClipBounds(min(max(bounds.low, self.low_min), self.low_max),
                          min(max(bounds.high, self.high_min), self.high_max))


@dataclass(frozen=True)
class Calibration:
    """One calibration's outcome: the bounds to use from now on and what led to them."""

    bounds: ClipBounds
    """Bounds in force after this calibration (the previous ones when skipped)."""
    skipped: str | None
    """Why nothing changed (non-finite values, no values), else None."""
    alpha: float
    """Shadow clip share of the negative-advantage values (NaN without any)."""
    balance_shadow: float
    """p of the shadow at the configured bounds (NaN when undefined)."""
    balance_fp8: float
    """p of the FP8 ratios at the new bounds (NaN when undefined)."""
    before: dict[str, float]
    """clip_diagnostic with the bounds in force before this calibration."""
    after: dict[str, float]
    """clip_diagnostic with the new bounds."""
    low_at_limit: bool = False
    """Whether the new L sits at low_min or low_max (the rule's value lay at or beyond it)."""
    high_at_limit: bool = False
    """Whether the new H sits at high_min or high_max."""
    noise: dict[str, float] = field(default_factory=dict)
    """`noise_quantiles` of n = log r − log r_s over N⁻ ({} without negative-advantage values)."""


def calibrate(ratio: torch.Tensor, shadow_ratio: torch.Tensor, advantages: torch.Tensor,
              configured: ClipBounds, current: ClipBounds, previous: ClipBounds | None,
              limits: ClipLimits, smoothing: float, rule: str = "quantile", noise_tail: float = 0.01,
              overclip_budget: float = 0.01) -> Calibration:
    """One Calibrated Clipping update from flat [N] FP8 ratios, shadow ratios and advantages
    (`calibration_values`). `configured`: the plain PPO interval the shadow is clipped with;
    `current`: the FP8 bounds in force (diagnostic 'before'); `previous`: the last calibrated
    bounds (None before the first calibration: no smoothing); `rule`: how L is found, 'quantile'
    (the paper's α-quantile), 'noise' (with `noise_tail`) or 'budget' (with `overclip_budget`; module
    docstring)."""
    if rule not in CALIBRATION_RULES:
        raise RLInputError(f"unknown calibration rule {rule!r}; choose {' or '.join(CALIBRATION_RULES)}")
    check_same_shape("ratio", ratio, shadow_ratio=shadow_ratio, advantages=advantages)
    nan = math.nan
    if ratio.numel() == 0 or not bool(torch.isfinite(ratio).all() & torch.isfinite(shadow_ratio).all()):
        reason = "no values" if ratio.numel() == 0 else "non-finite ratio"
        return Calibration(current, reason, nan, nan, nan, {}, {})
    before = clip_diagnostic(ratio, shadow_ratio, advantages, current, configured)
    alpha = shadow_clip_share(shadow_ratio, advantages, configured.low)
    if rule == "noise":
        low = noise_lower_bound(ratio, shadow_ratio, advantages, configured.low, noise_tail)
    elif rule == "budget":
        low = budget_lower_bound(ratio, shadow_ratio, advantages, configured.low, overclip_budget)
    else:
        low = None if alpha is None else matched_lower_bound(ratio, advantages, alpha, configured.low)
    low = current.low if low is None else low
    low = min(max(smoothed(previous and previous.low, low, smoothing), limits.low_min), limits.low_max)
    target = update_balance(shadow_ratio, advantages, configured)
    high = None if target is None else rebalanced_upper_bound(ratio, advantages, low, target, configured.high)
    high = current.high if high is None else smoothed(previous and previous.high, high, smoothing)
    bounds = limits.clamp(ClipBounds(low, max(high, 1.0)))
    after = clip_diagnostic(ratio, shadow_ratio, advantages, bounds, configured)
    balance = update_balance(ratio, advantages, bounds)
    return Calibration(bounds, None, nan if alpha is None else alpha, nan if target is None else target,
                       nan if balance is None else balance, before, after,
                       low_at_limit=bounds.low in (limits.low_min, limits.low_max),
                       high_at_limit=bounds.high in (limits.high_min, limits.high_max),
                       noise=noise_quantiles(fp8_noise(ratio, shadow_ratio, advantages)))
