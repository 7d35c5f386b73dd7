"""The train/rollout noise floor and the thresholds calibrated to it: quantiles recovered from a known
noise distribution within their sampling error, hand-worked thresholds and attribution, bounds that
hold under any noise (hypothesis)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.noise import (
    NoiseFloor,
    calibrated_mis_band,
    calibrated_tis_cap,
    clip_attribution,
    estimate_noise,
    masked_quantiles,
    widened_clip,
)

LEVELS = (0.01, 0.1, 0.5, 0.9, 0.99)


def test_masked_quantiles_match_torch_quantile_on_the_kept_values():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(7, 13, generator=generator)
    mask = torch.rand(7, 13, generator=generator) < 0.6
    expected = torch.quantile(values[mask], torch.tensor(LEVELS))
    torch.testing.assert_close(masked_quantiles(values, mask, LEVELS), expected)
    assert torch.equal(masked_quantiles(values, torch.zeros_like(mask), LEVELS), torch.zeros(len(LEVELS)))


def _bisect_quantile(cdf, level: float, low: float = -50.0, high: float = 50.0) -> float:
    """Inverse of a continuous increasing cdf by bisection (float64)."""
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if cdf(middle) < level else (low, middle)
    return 0.5 * (low + high)


@pytest.mark.parametrize("distribution", [
    torch.distributions.Normal(torch.tensor(0.03, dtype=torch.float64), torch.tensor(0.15, dtype=torch.float64)),
    torch.distributions.Laplace(torch.tensor(-0.02, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)),
], ids=["normal", "laplace"])
def test_estimate_recovers_known_noise_quantiles_within_sampling_error(distribution):
    """Δ drawn from a known law on the kept tokens: each estimated quantile of Δ and of |Δ| lies
    within 5 standard errors of the true one, SE = sqrt(p(1 − p)/n) / f(q_p) (the asymptotic
    standard error of a sample quantile; f the density of Δ or |Δ| at the true quantile)."""
    torch.manual_seed(1)
    shape = (400, 64)
    mask = torch.rand(shape) < 0.7
    delta = distribution.sample(shape)
    rollout = -torch.rand(shape, dtype=torch.float64) * 5  # any logprobs: only Δ matters
    train = rollout + delta
    noise = estimate_noise(train.float(), rollout.float(), mask, LEVELS)
    count = int(mask.sum())
    assert int(noise.count) == count

    def density(x: float) -> float:
        return float(distribution.log_prob(torch.tensor(x, dtype=torch.float64)).exp())

    def cdf(x: float) -> float:
        return float(distribution.cdf(torch.tensor(x, dtype=torch.float64)))

    for index, level in enumerate(LEVELS):
        true_delta = float(distribution.icdf(torch.tensor(level, dtype=torch.float64)))
        se = math.sqrt(level * (1 - level) / count) / density(true_delta)
        assert abs(float(noise.delta[index]) - true_delta) < 5 * se, (level, true_delta)
        # |Δ|: cdf(x) = F(x) − F(−x), density f(x) + f(−x)
        true_abs = _bisect_quantile(lambda x: cdf(x) - cdf(-x), level, 0.0, 50.0)
        se_abs = math.sqrt(level * (1 - level) / count) / (density(true_abs) + density(-true_abs))
        assert abs(float(noise.abs_delta[index]) - true_abs) < 5 * se_abs, (level, true_abs)


def test_sequence_level_uses_each_sequences_mean_noise():
    rollout = torch.zeros(3, 4)
    train = torch.tensor([[0.1, 0.3, 9.0, 9.0], [-0.4, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    noise = estimate_noise(train, rollout, mask, (0.0, 0.5, 1.0), level="sequence")
    # per-sequence means over kept tokens: 0.2 and −0.1; the empty third row does not count
    torch.testing.assert_close(noise.delta, torch.tensor([-0.1, 0.05, 0.2]))
    torch.testing.assert_close(noise.abs_delta, torch.tensor([0.1, 0.15, 0.2]))
    assert float(noise.count) == 2


def test_noise_floor_round_trips_through_its_metrics():
    noise = estimate_noise(torch.randn(4, 5), torch.zeros(4, 5), torch.ones(4, 5), (0.1, 0.9))
    values = {name: float(value) for name, value in noise.metrics().items()}
    assert set(values) == {"noise/count", "noise/delta_q0.1", "noise/delta_q0.9",
                           "noise/abs_delta_q0.1", "noise/abs_delta_q0.9"}
    rebuilt = NoiseFloor.from_metrics(values, (0.1, 0.9))
    assert rebuilt.delta_at(0.9) == pytest.approx(noise.delta_at(0.9))
    with pytest.raises(RLInputError, match="level 0.5 was not estimated"):
        rebuilt.delta_at(0.5)


def test_bad_inputs_are_named():
    with pytest.raises(RLInputError, match="rollout_logprobs has shape"):
        estimate_noise(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), LEVELS)
    with pytest.raises(RLInputError, match="unknown noise level 'group'"):
        estimate_noise(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), LEVELS, level="group")
    with pytest.raises(RLInputError, match=r"quantile levels must lie in \[0, 1\]"):
        estimate_noise(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), (1.5,))
    with pytest.raises(RLInputError, match="must be finite"):
        widened_clip(0.2, 0.28, float("nan"), 0.1, clip_low_max=0.5, clip_high_max=1.0)


def test_thresholds_hand_worked():
    # upper side: (1 + 0.28)·e^0.1 − 1; lower side: 1 − (1 − 0.2)·e^−0.05
    low, high = widened_clip(0.2, 0.28, -0.05, 0.1, clip_low_max=0.5, clip_high_max=1.0)
    assert high == pytest.approx(1.28 * math.exp(0.1) - 1, abs=1e-15)
    assert low == pytest.approx(1 - 0.8 * math.exp(-0.05), abs=1e-15)
    # a tail on the "wrong" side does not narrow the interval
    assert widened_clip(0.2, 0.28, 0.3, -0.3, clip_low_max=0.5, clip_high_max=1.0) == (0.2, 0.28)
    # limits
    assert widened_clip(0.2, 0.28, -5.0, 5.0, clip_low_max=0.5, clip_high_max=1.0) == (0.5, 1.0)
    assert calibrated_tis_cap(2.0, math.log(3.0), cap_max=10.0) == pytest.approx(3.0)
    assert calibrated_tis_cap(2.0, 0.1, cap_max=10.0) == 2.0
    assert calibrated_mis_band(0.5, 2.0, math.log(0.25), math.log(4.0), low_min=0.3, high_max=3.0) == (
        0.3, 3.0)
    band = calibrated_mis_band(0.5, 2.0, math.log(0.4), 0.2, low_min=0.1, high_max=3.0)
    assert band == (pytest.approx(0.4), 2.0)


def test_zero_noise_returns_the_configured_thresholds_bit_for_bit():
    for clip_low, clip_high in [(0.2, 0.28), (0.1, 0.3), (3e-4, 4e-4), (0.7, 0.05)]:
        assert widened_clip(clip_low, clip_high, 0.0, 0.0, clip_low_max=0.9, clip_high_max=2.0) == (
            clip_low, clip_high)
    assert calibrated_tis_cap(2.0, 0.0, cap_max=10.0) == 2.0
    assert calibrated_mis_band(0.5, 2.0, 0.0, 0.0, low_min=0.1, high_max=10.0) == (0.5, 2.0)


EXTREME = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(clip_low=st.floats(1e-4, 0.95), clip_high=st.floats(1e-4, 10.0), extra_low=st.floats(0.0, 1.0),
       extra_high=st.floats(0.0, 100.0), noise_low=EXTREME, noise_high=EXTREME)
def test_widened_clip_stays_within_its_bounds_under_any_noise(clip_low, clip_high, extra_low, extra_high,
                                                              noise_low, noise_high):
    low_max = clip_low + (0.999 - clip_low) * extra_low
    high_max = clip_high + extra_high
    low, high = widened_clip(clip_low, clip_high, noise_low, noise_high, clip_low_max=low_max,
                             clip_high_max=high_max)
    assert clip_low <= low <= low_max < 1 and clip_high <= high <= high_max
    # more noise never narrows the interval
    wider = widened_clip(clip_low, clip_high, noise_low - 1, noise_high + 1, clip_low_max=low_max,
                         clip_high_max=high_max)
    assert wider[0] >= low and wider[1] >= high


@settings(max_examples=300, deadline=None)
@given(cap=st.floats(1.0, 20.0), extra=st.floats(0.0, 1e3), low=st.floats(0.0, 1.0), low_min_share=st.floats(0, 1),
       high=st.floats(1.0, 20.0), extra_high=st.floats(0.0, 1e3), noise_low=EXTREME, noise_high=EXTREME)
def test_calibrated_corrections_stay_within_their_bounds_under_any_noise(
        cap, extra, low, low_min_share, high, extra_high, noise_low, noise_high):
    calibrated = calibrated_tis_cap(cap, noise_high, cap_max=cap + extra)
    assert cap <= calibrated <= cap + extra
    low_min, high_max = low * low_min_share, high + extra_high
    band_low, band_high = calibrated_mis_band(low, high, noise_low, noise_high, low_min=low_min,
                                              high_max=high_max)
    assert low_min <= band_low <= low and high <= band_high <= high_max


def test_estimated_thresholds_bounded_under_extreme_logprob_noise():
    """End to end from logprobs: rollout logprobs of −1e4 against trainer logprobs near 0."""
    rollout = torch.full((4, 8), -1e4)
    rollout[:2] = 0.0
    train = torch.zeros(4, 8)
    train[1] = -1e4  # Δ per row: 0, −1e4, +1e4, +1e4
    noise = estimate_noise(train, rollout, torch.ones(4, 8), (0.1, 0.9))
    low, high = widened_clip(0.2, 0.28, noise.delta_at(0.1), noise.delta_at(0.9), clip_low_max=0.5,
                             clip_high_max=1.0)
    assert (low, high) == (0.5, 1.0)
    assert calibrated_tis_cap(2.0, noise.delta_at(0.9), cap_max=10.0) == 10.0


def test_clip_attribution_hand_case():
    """r_T = π_θ/π_old, r_R = π_θ/π_rollout; interval [0.8, 1.28]."""
    ln = math.log
    logprobs = torch.zeros(1, 6)
    #            noise only   policy only  both        policy (A<0) none (A>0, low)  masked
    r_trainer = [1.0,         1.5,         1.5,        0.5,         0.5,             1.0]
    r_rollout = [1.5,         1.0,         2.0,        0.9,         0.5,             1.5]
    old = torch.tensor([[-ln(r) for r in r_trainer]])
    rollout = torch.tensor([[-ln(r) for r in r_rollout]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    fractions = clip_attribution(logprobs, old, rollout, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert float(fractions["noise/clip_noise_only_frac"]) == pytest.approx(1 / 5)
    assert float(fractions["noise/clip_policy_only_frac"]) == pytest.approx(2 / 5)
    assert float(fractions["noise/clip_both_frac"]) == pytest.approx(1 / 5)


def test_clip_attribution_sequence_level():
    # one sequence: geometric-mean r_T = 1 (inside), r_R = e^{0.5} ≈ 1.65 (outside): noise only
    logprobs = torch.zeros(1, 2)
    old = torch.zeros(1, 2)
    rollout = torch.full((1, 2), -0.5)
    fractions = clip_attribution(logprobs, old, rollout, torch.ones(1, 2), torch.ones(1, 2),
                                 clip_low=0.2, clip_high=0.28, ratio_level="sequence")
    assert float(fractions["noise/clip_noise_only_frac"]) == 1.0
    assert float(fractions["noise/clip_both_frac"]) == 0.0


def test_non_finite_logprobs_are_not_mistaken_for_zero_noise():
    train = torch.zeros(2, 3)
    train[0, 1] = float("nan")
    noise = estimate_noise(train, torch.zeros(2, 3), torch.ones(2, 3), (0.1, 0.9))
    with pytest.raises(RLInputError, match="must be finite"):
        calibrated_tis_cap(2.0, noise.delta_at(0.9), cap_max=10.0)
