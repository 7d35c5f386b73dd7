"""The equivalence analysis (report/equivalence.py): the t distribution against a printed t table and
numpy's Student-t sampler, the TOST and difference tests against their confidence-interval duals,
Holm against a hand-worked example, the bootstrap against the normal approximation, and the verdicts
on fake run directories: a true difference of 0 with 2 seeds is not shown, with 8 seeds it is
equivalent, a true -8 points is worse."""
import math

import numpy as np
import pytest

from megatron_fp8rl.report.equivalence import (
    EquivalenceError, SeedInterval, bootstrap_interval, compare, difference_p, holm, seed_interval, t_cdf,
    t_quantile, tost_p, verdict,
)
from megatron_fp8rl.report.study_figures import arm_figures
from tests.helpers.study_runs import correct_first, write_finished_run

P = 500
"""Held-out problems per run (issue 61's fixed set)."""
MARGIN = 0.05


@pytest.mark.parametrize("df, q95, q975", [(1, 6.314, 12.706), (2, 2.920, 4.303), (3, 2.353, 3.182),
                                           (5, 2.015, 2.571), (7, 1.895, 2.365), (30, 1.697, 2.042)])
def test_t_quantiles_match_a_printed_t_table(df, q95, q975):
    assert t_quantile(0.95, df) == pytest.approx(q95, abs=6e-4)
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=6e-4)
    assert t_quantile(0.05, df) == pytest.approx(-q95, abs=6e-4)
    assert t_cdf(0.0, df) == 0.5 and t_cdf(math.inf, df) == 1.0


@pytest.mark.parametrize("df", [1, 3, 7])
def test_t_cdf_matches_numpys_student_t_sampler(df):
    draws = np.random.default_rng(df).standard_t(df, 400_000)
    for t in (-2.5, -0.7, 0.3, 1.9, 4.0):
        assert t_cdf(t, df) == pytest.approx(float(np.mean(draws <= t)), abs=3e-3)


def test_the_seed_interval_is_the_hand_worked_t_interval():
    # d = 2, -1, 4, 1 points: mean 1.5, sd sqrt(13/3 * 1e-4) = 0.020817, se 0.0104083, t_{0.95,3} 2.353363
    interval = seed_interval([0.02, -0.01, 0.04, 0.01])
    assert (interval.mean, interval.df) == (pytest.approx(0.015), 3)
    assert interval.se == pytest.approx(0.0104083, abs=1e-7)
    assert (interval.low, interval.high) == (pytest.approx(0.015 - 0.0244946, abs=1e-6),
                                             pytest.approx(0.015 + 0.0244946, abs=1e-6))
    with pytest.raises(EquivalenceError, match="needs >= 2 seed pairs, got 1"):
        seed_interval([0.01])


def test_tost_and_difference_tests_agree_with_their_confidence_intervals():
    """TOST at alpha rejects exactly when the (1 - 2 alpha) CI lies inside the margin; the two-sided
    difference test at 2 alpha exactly when that CI excludes 0."""
    rng = np.random.default_rng(0)
    checked = {"inside": 0, "not inside": 0, "excludes 0": 0, "covers 0": 0}
    for _ in range(300):
        n = int(rng.integers(2, 9))
        d = rng.normal(rng.uniform(-0.08, 0.08), rng.uniform(0.002, 0.05), n)
        ci = seed_interval(list(d), level=0.90)
        inside = -MARGIN < ci.low and ci.high < MARGIN
        assert (tost_p(ci, MARGIN) <= 0.05) == inside
        assert (difference_p(ci) <= 0.10) == (ci.high < 0 or ci.low > 0)
        checked["inside" if inside else "not inside"] += 1
        checked["excludes 0" if ci.high < 0 or ci.low > 0 else "covers 0"] += 1
    assert min(checked.values()) > 20  # each side of both dualities was exercised


def test_identical_differences_give_an_exact_mean():
    exact = SeedInterval(-0.02, -0.02, -0.02, 0.0, 2)
    assert tost_p(exact, MARGIN) == 0.0 and difference_p(exact) == 0.0
    assert tost_p(SeedInterval(-0.06, -0.06, -0.06, 0.0, 2), MARGIN) == 1.0
    assert difference_p(SeedInterval(0.0, 0.0, 0.0, 0.0, 2)) == 1.0


def test_holm_matches_a_hand_worked_example():
    # sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> max(0.06, 0.04)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0]) and holm([0.02]) == [0.02]


@pytest.mark.parametrize("mean, tost, difference, word", [
    (-0.02, 0.01, 0.001, "equivalent"), (-0.08, 0.9, 0.01, "worse"), (0.08, 0.9, 0.01, "better"),
    (0.0, 0.2, 1.0, "not shown"), (-0.03, 0.051, 0.2, "not shown"),
])
def test_the_verdict_words(mean, tost, difference, word):
    assert verdict(mean, tost, difference) == word


def test_the_bootstrap_is_seeded_and_as_wide_as_the_normal_approximation():
    rng = np.random.default_rng(3)
    pairs = [(list(rng.integers(0, 2, P)), list(rng.integers(0, 2, P))) for _ in range(4)]
    low, high = bootstrap_interval(pairs, same_problems=True, resamples=4000)
    assert (low, high) == bootstrap_interval(pairs, same_problems=True, resamples=4000)
    per_problem = np.mean([np.subtract(arm, ref) for ref, arm in pairs], axis=0)
    normal_half = 1.645 * per_problem.std(ddof=1) / math.sqrt(P)
    assert (high - low) / 2 == pytest.approx(normal_half, rel=0.1)
    assert low < per_problem.mean() < high
    independent = bootstrap_interval(pairs, same_problems=False, resamples=4000)
    assert independent != (low, high)
    with pytest.raises(EquivalenceError, match=r"the seeds scored \[10, 500\] problems"):
        bootstrap_interval([*pairs, ([0] * 10, [1] * 10)], same_problems=True)


def _write_arm(root, arm: str, corrects: list[int]) -> dict[str, object]:
    return {str(seed): write_finished_run(root / arm / f"seed{seed}", correct_first(count, P))
            for seed, count in enumerate(corrects, 1)}


def _study(root, reference: list[int], arms: dict[str, list[int]]):
    runs = {"float32": _write_arm(root, "float32", reference)}
    runs.update({arm: _write_arm(root, arm, corrects) for arm, corrects in arms.items()})
    return arm_figures(runs)


REFERENCE = [300, 320, 280, 310, 290, 305, 295, 315]
"""The reference's problems right per seed (of P): seeds differ by several points."""
NOISE = [8, -8, 5, -5, 9, -9, 3, -3]
"""Per-seed noise of the arm's difference, in problems (1 point = 5 problems): sd ~ 1.4 points."""


def test_no_difference_with_two_seeds_is_not_shown_and_with_eight_is_equivalent(tmp_path):
    two = _study(tmp_path / "two", REFERENCE[:2], {"same": [r + e for r, e in zip(REFERENCE[:2], NOISE[:2])]})
    found, = compare(two, (("float32", "same"),), MARGIN, same_problems=True)
    assert found.seeds == ("1", "2") and found.differences == pytest.approx((8 / P, -8 / P))
    assert found.interval.low < -MARGIN and found.verdict == "not shown"  # t_{0.95,1} = 6.31 widens it
    eight = _study(tmp_path / "eight", REFERENCE, {"same": [r + e for r, e in zip(REFERENCE, NOISE)]})
    found, = compare(eight, (("float32", "same"),), MARGIN, same_problems=True)
    assert found.verdict == "equivalent" and -MARGIN < found.interval.low < found.interval.high < MARGIN
    assert found.interval.mean == pytest.approx(0.0)


def test_a_true_loss_of_eight_points_is_worse_and_holm_counts_the_whole_family(tmp_path):
    arms = {"loses": [r - 40 + e for r, e in zip(REFERENCE[:6], NOISE[:6])],
            "same": [r + e for r, e in zip(REFERENCE[:6], NOISE[:6])],
            "small_loss": [r - 10 + e for r, e in zip(REFERENCE[:6], NOISE[:6])]}
    figures = _study(tmp_path, REFERENCE[:6], arms)
    family = (("float32", "loses"), ("float32", "same"), ("float32", "small_loss"))
    loses, same, small = compare(figures, family, MARGIN, same_problems=True)
    assert loses.verdict == "worse" and loses.interval.high < 0 and loses.interval.mean == pytest.approx(-0.08)
    assert same.verdict == "equivalent"
    assert small.tost_holm == pytest.approx(holm([loses.tost_p, same.tost_p, small.tost_p])[2])
    assert small.difference_holm >= small.difference_p and small.tost_holm >= small.tost_p
    alone, = compare(figures, (("float32", "small_loss"),), MARGIN, same_problems=True)
    assert alone.tost_holm == alone.tost_p  # a family of one: nothing to correct


def test_unpaired_runs_are_skipped_and_a_different_problem_count_is_refused(tmp_path):
    figures = _study(tmp_path, REFERENCE[:2], {"one": [300]})
    found, = compare(figures, (("float32", "one"), ), MARGIN, same_problems=True)
    assert found.seeds == ("1",) and found.interval is None and found.verdict == "not shown"
    nothing, = compare(figures, (("float32", "absent"),), MARGIN, same_problems=True)
    assert nothing.seeds == () and nothing.bootstrap is None and nothing.verdict == "not shown"
    figures["short"] = arm_figures({"short": {"1": write_finished_run(tmp_path / "s", [1] * 10)}})["short"]
    with pytest.raises(EquivalenceError, match="short seed 1 scored 10 problems, float32 seed 1 500"):
        compare(figures, (("float32", "short"),), MARGIN, same_problems=True)
