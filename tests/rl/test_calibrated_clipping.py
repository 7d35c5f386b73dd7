"""Calibrated Clipping's math (rl/calibrated_clipping.py): hand-computed cases and properties."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8rl.rl.calibrated_clipping import (
    NOISE_LEVELS,
    budget_lower_bound,
    ClipBounds,
    ClipLimits,
    calibrate,
    calibration_values,
    clip_diagnostic,
    is_clipped,
    matched_lower_bound,
    noise_lower_bound,
    rebalanced_upper_bound,
    shadow_clip_share,
    smoothed,
    update_balance,
)
from megatron_fp8rl.rl.common import RLInputError

PLAIN = ClipBounds.from_epsilons(0.2, 0.28)
WIDE = ClipLimits(low_min=0.0, low_max=1.0, high_min=1.0, high_max=10.0)


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_hand_computed_lower_bound_and_share():
    # 5 negative tokens; the shadow clips 2 of them (0.7, 0.75 < 0.8)
    shadow = _t(0.70, 0.75, 0.85, 0.95, 1.00, 1.1)
    fp8 = _t(0.60, 0.78, 0.79, 0.90, 1.05, 1.2)
    adv = _t(-1, -1, -1, -1, -1, 2)
    alpha = shadow_clip_share(shadow, adv, PLAIN.low)
    assert alpha == pytest.approx(0.4)
    # k = round(0.4 * 5) = 2: L in (0.78, 0.79] keeps 0.60 and 0.78 below; nearest 0.8 is 0.79
    assert matched_lower_bound(fp8, adv, alpha, PLAIN.low) == pytest.approx(0.79)
    assert matched_lower_bound(fp8, adv, alpha, 0.785) == 0.785  # inside the matching interval
    assert 0.78 < matched_lower_bound(fp8, adv, alpha, 0.5) < 0.78 + 1e-12  # just above r_(k-1)
    assert matched_lower_bound(fp8, adv, 0.0, PLAIN.low) == pytest.approx(0.60)  # nothing strictly below
    assert matched_lower_bound(fp8, adv, 0.0, 0.5) == 0.5
    assert matched_lower_bound(fp8, adv, 1.0, PLAIN.low) > 1.05  # everything below
    assert matched_lower_bound(fp8, _t(1, 1, 1, 1, 1, 1), 0.5, PLAIN.low) is None
    # ties at r_(k): no L has exactly k below; r_(k) (fewer below)
    assert matched_lower_bound(_t(0.7, 0.7, 0.9), _t(-1, -1, -1), 1 / 3, PLAIN.low) == pytest.approx(0.7)
    assert shadow_clip_share(shadow, _t(1, 1, 1, 1, 1, 1), 0.8) is None


def test_hand_computed_balance_and_upper_bound():
    ratio = _t(0.9, 1.0, 1.1, 1.3, 1.5)
    adv = _t(-2, -1, 1, 1, 1)
    # active negatives: 2*0.9 + 1*1.0 = 2.8; positives up to H=1.28: 1.1 -> p = 1.1 / 2.8
    assert update_balance(ratio, adv, PLAIN) == pytest.approx(1.1 / 2.8)
    # target 2.4/2.8 (1.1 + 1.3 active): reached from H = 1.3 on, the same p up to 1.5; nearest 1.28: 1.3
    assert rebalanced_upper_bound(ratio, adv, 0.8, 2.4 / 2.8, PLAIN.high) == pytest.approx(1.3)
    assert rebalanced_upper_bound(ratio, adv, 0.8, 2.4 / 2.8, 1.4) == 1.4
    assert 1.5 - 1e-12 < rebalanced_upper_bound(ratio, adv, 0.8, 2.4 / 2.8, 2.0) < 1.5  # below 1.5's step
    # target 0.1: reached at 1.1, the same p on [1.1, 1.3): the configured 1.28 itself
    assert rebalanced_upper_bound(ratio, adv, 0.8, 0.1, PLAIN.high) == pytest.approx(1.28)
    assert rebalanced_upper_bound(ratio, adv, 0.8, 0.1, 1.05) == pytest.approx(1.1)
    assert rebalanced_upper_bound(ratio, adv, 0.8, 99.0, PLAIN.high) == pytest.approx(1.5)  # falls short
    assert rebalanced_upper_bound(ratio, adv, 0.8, 99.0, 1.7) == 1.7  # any H >= 1.5 keeps every positive
    assert rebalanced_upper_bound(ratio, adv, 0.8, 0.0, PLAIN.high) < 1.1  # none active
    assert rebalanced_upper_bound(ratio, _t(1, 1, 1, 1, 1), 0.8, 1.0, PLAIN.high) is None  # no negatives
    assert update_balance(ratio, _t(1, 1, 1, 1, 1), PLAIN) is None


def test_diagnostic_counts_overclipped_negatives():
    shadow = _t(0.9, 0.9, 0.7, 1.0, 1.5)
    fp8 = _t(0.7, 0.9, 0.9, 1.0, 1.2)
    adv = _t(-1, -1, -1, -1, 1)
    out = clip_diagnostic(fp8, shadow, adv, PLAIN, PLAIN)
    assert out["neg_overclip"] == pytest.approx(0.25)  # token 0: FP8 clips, shadow does not
    assert out["neg_underclip"] == pytest.approx(0.25)  # token 2: the reverse
    assert out["pos_overclip"] == 0.0 and out["pos_underclip"] == 1.0
    assert math.isnan(clip_diagnostic(fp8[:1], shadow[:1], adv[:1], PLAIN, PLAIN)["pos_overclip"])


def test_sequence_level_values_take_one_per_row():
    ratio = torch.tensor([[1.0, 1.2, 1.2, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.9, 0.9, 0.9]])
    adv = torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 1]])
    values, advantages = calibration_values(ratio, adv, mask, "sequence")
    assert values.tolist() == pytest.approx([1.2, 0.9]) and advantages.tolist() == [2.0, -1.0]
    values, _ = calibration_values(ratio, adv, mask, "token")
    assert values.numel() == 5
    with pytest.raises(RLInputError, match="unknown calibration level 'group'"):
        calibration_values(ratio, adv, mask, "group")


def test_smoothing_and_bad_input():
    assert smoothed(None, 0.7, 0.5) == 0.7
    assert smoothed(0.8, 0.6, 0.5) == pytest.approx(0.7)
    with pytest.raises(RLInputError, match="smoothing must be in"):
        smoothed(0.8, 0.6, 1.0)
    with pytest.raises(RLInputError, match="0 <= low <= 1 <= high"):
        ClipBounds(1.1, 1.2)


def test_non_finite_or_empty_batches_keep_the_bounds():
    current = ClipBounds(0.75, 1.3)
    ratio, adv = _t(0.9, float("nan")), _t(-1, 1)
    out = calibrate(ratio, _t(0.9, 1.0), adv, PLAIN, current, current, WIDE, 0.5)
    assert out.bounds == current and out.skipped == "non-finite ratio"
    out = calibrate(_t(), _t(), _t(), PLAIN, current, None, WIDE, 0.5)
    assert out.bounds == current and out.skipped == "no values"
    # no negative-advantage value: L stays, H still rebalances
    out = calibrate(_t(1.1, 1.2), _t(1.1, 1.2), _t(1, 1), PLAIN, current, None, WIDE, 0.0)
    assert out.bounds.low == current.low and out.skipped is None


def test_fp8_noise_moves_the_lower_bound_down_and_removes_the_overclipping():
    """The paper's failure in miniature: the shadow ratios sit inside the interval, FP8 noise
    spreads them; before calibration FP8 over-clips negatives, after it the share matches."""
    gen = torch.Generator().manual_seed(0)
    n = 4000
    adv = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    shadow = (1 + 0.05 * torch.randn(n, generator=gen)).double()
    fp8 = shadow * torch.exp(0.15 * torch.randn(n, generator=gen)).double()
    out = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, WIDE, 0.0)
    assert out.before["neg_overclip"] > 0.05
    assert out.bounds.low < PLAIN.low
    negative = adv < 0
    fp8_share = float((fp8[negative] < out.bounds.low).double().mean())
    assert fp8_share == pytest.approx(out.alpha, abs=1 / negative.sum().item() + 1e-12)
    assert out.after["neg_overclip"] < out.before["neg_overclip"] / 2
    assert out.balance_fp8 == pytest.approx(out.balance_shadow, rel=0.02)


def test_a_near_on_policy_batch_keeps_the_configured_interval():
    """α = 0 and every ratio within 1% of 1 (the first mini-batch after a small step): any L below
    the smallest ratio and any H above the largest match the shadow; the configured bounds are
    among them and stay. Before the tie-break L became the smallest ratio (~0.99) and H the
    smallest positive one, an interval that clipped the next steps' moved ratios."""
    gen = torch.Generator().manual_seed(1)
    n = 200
    adv = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    shadow = (1 + 0.003 * torch.randn(n, generator=gen)).double()
    fp8 = shadow * (1 + 0.002 * torch.randn(n, generator=gen)).double()
    out = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, WIDE, 0.0)
    assert out.alpha == 0.0
    assert out.bounds == PLAIN, out.bounds
    assert out.after["neg_overclip"] == 0.0


ratios = st.lists(st.floats(0.05, 3.0), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(values=ratios, signs=st.lists(st.sampled_from([-1.0, 1.0]), min_size=60, max_size=60),
       eps=st.tuples(st.floats(0.05, 0.5), st.floats(0.05, 0.5)))
def test_identical_ratios_clip_exactly_what_the_plain_interval_clips(values, signs, eps):
    ratio, adv = _t(*values), _t(*signs[:len(values)])
    configured = ClipBounds.from_epsilons(*eps)
    out = calibrate(ratio, ratio.clone(), adv, configured, configured, None, WIDE, 0.0)
    assert torch.equal(is_clipped(ratio, adv, out.bounds), is_clipped(ratio, adv, configured))


@settings(max_examples=150, deadline=None)
@given(values=ratios, shadow=ratios, signs=st.lists(st.sampled_from([-1.0, 1.0]), min_size=60, max_size=60),
       smoothing=st.floats(0.0, 0.9))
def test_bounds_stay_within_their_limits(values, shadow, signs, smoothing):
    n = min(len(values), len(shadow))
    ratio, shadow_ratio, adv = _t(*values[:n]), _t(*shadow[:n]), _t(*signs[:n])
    limits = ClipLimits(low_min=0.6, low_max=0.9, high_min=1.1, high_max=1.5)
    out = calibrate(ratio, shadow_ratio, adv, PLAIN, PLAIN, ClipBounds(0.7, 1.4), limits, smoothing)
    assert 0.6 <= out.bounds.low <= 0.9 and 1.1 <= out.bounds.high <= 1.5


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(0.5, 1.5), min_size=4, max_size=40), spread=st.floats(1.05, 3.0))
def test_wider_fp8_lower_tail_moves_the_lower_bound_down(values, spread):
    """Stretching the FP8 ratios away from 1 (more noise) never raises the matched L."""
    shadow = _t(*values)
    adv = -torch.ones_like(shadow)
    narrow = calibrate(shadow, shadow, adv, PLAIN, PLAIN, None, WIDE, 0.0).bounds.low
    wide_ratio = torch.exp(torch.log(shadow) * spread)
    wide = calibrate(wide_ratio, shadow, adv, PLAIN, PLAIN, None, WIDE, 0.0).bounds.low
    assert wide <= narrow + 1e-12 or narrow >= 1.0


def test_noise_rule_lower_bound_is_the_configured_one_times_the_noise_tail():
    """Hand-computed: log-noise of the negatives -0.3, -0.1, 0.0, 0.2 (the positive's is ignored);
    torch.quantile's linear interpolation at 0.25 of 4 sorted values lies at position 0.75:
    -0.3 + 0.75 * 0.2 = -0.15, so L = 0.8 * exp(-0.15)."""
    shadow = _t(0.9, 1.0, 1.1, 0.7, 1.0)
    noise = _t(-0.3, -0.1, 0.0, 0.2, -2.0)
    adv = _t(-1, -1, -1, -1, 1)
    got = noise_lower_bound(shadow * torch.exp(noise), shadow, adv, 0.8, 0.25)
    assert got == pytest.approx(0.8 * math.exp(-0.15), rel=1e-12)
    assert noise_lower_bound(shadow, shadow, adv, 0.8, 0.01) == pytest.approx(0.8, rel=1e-12)  # no noise
    assert noise_lower_bound(shadow, shadow, _t(1, 1, 1, 1, 1), 0.8, 0.01) is None
    with pytest.raises(RLInputError, match="noise tail"):
        noise_lower_bound(shadow, shadow, adv, 0.8, 0.5)


def _heavy_tailed(shadow_spread: float, n: int = 4000):
    """(FP8 ratio, shadow ratio, advantage) [n]: shadow ratios N(1, spread²) (α = 0 at clip 0.2),
    FP8 noise log-normal with σ = 0.1 and 0.5% of the values off by e^-1.5; signs at random."""
    gen = torch.Generator().manual_seed(1)
    adv = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    shadow = (1 + shadow_spread * torch.randn(n, generator=gen)).double()
    noise = 0.1 * torch.randn(n, generator=gen).double()
    noise[::200] = -1.5
    return shadow * torch.exp(noise), shadow, adv


def test_at_small_alpha_the_quantile_rule_sits_at_its_limit_and_the_noise_rule_calibrates():
    """Issue 44's failure: the shadow clips no bad token (α = 0), FP8 noise spreads the ratios
    with a heavy tail (0.5% of tokens off by e^-1.5). The α-quantile puts L below every FP8
    ratio, at low_min, flagged; the noise rule puts L where 1% of tokens at the configured bound
    would be over-clipped, inside the limits."""
    fp8, shadow, adv = _heavy_tailed(shadow_spread=0.02)
    limits = ClipLimits(low_min=0.5, low_max=0.95, high_min=1.05, high_max=1.5)
    plain = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, limits, 0.0)
    assert plain.alpha == 0.0 and plain.bounds.low == 0.5 and plain.low_at_limit
    noise = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, limits, 0.0, rule="noise", noise_tail=0.01)
    assert not noise.low_at_limit and 0.5 < noise.bounds.low < PLAIN.low
    # q_0.01 of the noise: the 0.5% outliers, then N(0, 0.1^2)'s 0.005-quantile (-2.576 sigma)
    assert noise.bounds.low == pytest.approx(PLAIN.low * math.exp(-2.576 * 0.1), rel=0.04)
    with pytest.raises(RLInputError, match="calibration rule"):
        calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, limits, 0.0, rule="median")


def test_every_calibration_reports_the_fp8_noise_quantiles_over_negative_advantages():
    """Calibration.noise: q(log r − log r_s) over the A<0 values only, at NOISE_LEVELS, against
    numpy's quantile (the same linear interpolation); positive-advantage noise does not enter."""
    gen = torch.Generator().manual_seed(3)
    n = 1001
    adv = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    shadow = (1 + 0.05 * torch.randn(n, generator=gen)).double()
    noise = 0.2 * torch.randn(n, generator=gen).double()
    noise[adv > 0] += 10.0  # would move every quantile if A>0 values took part
    out = calibrate(shadow * torch.exp(noise), shadow, adv, PLAIN, PLAIN, None, ClipLimits(), 0.0)
    expected = np.quantile(noise[adv < 0].numpy(), NOISE_LEVELS)
    assert list(out.noise) == [f"q{level:g}" for level in NOISE_LEVELS]
    assert list(out.noise.values()) == pytest.approx(expected.tolist(), rel=1e-9, abs=1e-12)
    no_negative = calibrate(shadow, shadow, torch.ones(n, dtype=torch.float64), PLAIN, PLAIN, None, ClipLimits(), 0.0)
    assert no_negative.noise == {}


def test_high_at_limit_is_flagged():
    """H clamped to high_max is reported, an interior H is not."""
    shadow = _t(1.0, 1.0, 1.0, 1.0)
    adv = _t(-1, -1, 1, 1)
    fp8 = _t(1.0, 1.0, 3.0, 3.0)  # the positives' FP8 ratios far above: H rebalances up to them
    limits = ClipLimits(low_min=0.5, low_max=0.95, high_min=1.05, high_max=1.5)
    out = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, limits, 0.0)
    assert out.bounds.high == 1.5 and out.high_at_limit
    inside = calibrate(shadow, shadow, adv, PLAIN, PLAIN, None, limits, 0.0)
    assert 1.05 < inside.bounds.high < 1.5 and not inside.high_at_limit


def test_budget_lower_bound_by_hand():
    """τ = 0.25 of 8 negative values: 2 of the shadow-unclipped ones may lie below L, so L is their
    third smallest FP8 ratio; the shadow-clipped ones (r_s < 0.8) and the positives do not count."""
    shadow = _t(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.6, 1.0)
    fp8 = _t(0.55, 0.60, 0.65, 0.90, 1.00, 1.10, 0.10, 0.20, 0.01)
    adv = _t(-1, -1, -1, -1, -1, -1, -1, -1, 1)
    assert budget_lower_bound(fp8, shadow, adv, 0.8, 0.25) == pytest.approx(0.65)
    assert budget_lower_bound(fp8, shadow, adv, 0.8, 0.0) == pytest.approx(0.55)  # none below
    assert budget_lower_bound(fp8, shadow, adv, 0.8, 0.5) == pytest.approx(0.8)  # 1.00 capped at 1 − ε_low
    assert budget_lower_bound(fp8, shadow, adv, 0.8, 0.9) == pytest.approx(0.8)  # every kept value may lie below
    assert budget_lower_bound(shadow, shadow, adv, 0.8, 0.01) == pytest.approx(0.8)  # no noise: plain PPO
    assert budget_lower_bound(fp8, shadow, _t(*[1] * 9), 0.8, 0.01) is None
    with pytest.raises(RLInputError, match="over-clip budget"):
        budget_lower_bound(fp8, shadow, adv, 0.8, 1.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.3, 2.0), st.floats(-1.0, 1.0), st.sampled_from([-1.0, 1.0])),
                min_size=1, max_size=60),
       st.floats(0.0, 0.3))
def test_budget_rule_keeps_the_in_sample_overclip_within_its_budget(rows, budget):
    """Unclamped, the budget rule's L over-clips at most τ of the A<0 values against the shadow at
    the configured bound, and any higher L up to the configured bound would exceed it (it is the
    highest such L)."""
    shadow, noise, adv = (torch.tensor(c, dtype=torch.float64) for c in zip(*rows))
    fp8 = shadow * torch.exp(noise)
    low = budget_lower_bound(fp8, shadow, adv, 0.8, budget)
    if not bool((adv < 0).any()):
        assert low is None
        return
    diagnostic = clip_diagnostic(fp8, shadow, adv, ClipBounds(low, 1.28), ClipBounds(0.8, 1.28))
    negatives = int((adv < 0).sum())
    assert low <= 0.8 and diagnostic["neg_overclip"] * negatives <= math.floor(budget * negatives) + 1e-9
    if low < 0.8:
        higher = clip_diagnostic(fp8, shadow, adv, ClipBounds(math.nextafter(low, 1.0), 1.28), ClipBounds(0.8, 1.28))
        assert higher["neg_overclip"] * negatives > math.floor(budget * negatives)


def test_at_small_alpha_the_budget_rule_sets_a_higher_bound_than_the_noise_rule():
    """The case of the noise test (α = 0, heavy-tailed FP8 noise), but with the shadow's ratios
    spread around 1 as in a run: both rules calibrate inside the limits, the budget rule's L is
    the higher one (it prices tokens where they are, not at the bound), and its over-clip on the
    same values is within the budget."""
    fp8, shadow, adv = _heavy_tailed(shadow_spread=0.05)
    limits = ClipLimits(low_min=0.5, low_max=0.95, high_min=1.05, high_max=1.5)
    by_noise = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, limits, 0.0, rule="noise", noise_tail=0.01)
    by_budget = calibrate(fp8, shadow, adv, PLAIN, PLAIN, None, limits, 0.0, rule="budget", overclip_budget=0.01)
    assert not by_budget.low_at_limit and by_noise.bounds.low < by_budget.bounds.low < PLAIN.low
    assert by_budget.after["neg_overclip"] <= 0.01
