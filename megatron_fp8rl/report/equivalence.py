"""An analysis that can say "equivalent" (issue 61 item 2): each primary comparison of a study (an arm
against its reference, seed by seed) as a mean difference in final held-out greedy accuracy with a
90% CI, a two one-sided tests (TOST) equivalence test against the study's margin, a difference test,
Holm's correction over the study's primary comparisons, and one verdict word.

Owns: the statistics (`t_quantile`, `seed_interval`, `tost_p`, `difference_p`, `holm`,
`bootstrap_interval`), the verdict rule (`verdict`) and `compare` (the comparisons from run figures).
The table of them is report/equivalence_table.py. Input: per-problem correctness of each run's last
eval (study_figures.RunFigures.eval_final, from eval_correct.json). Reads no files itself; must not
import trainer code.

Primary endpoint: a run's final greedy accuracy on the held-out set. Per seed s the paired
difference d_s = acc(arm, s) - acc(reference, s) (same seed: same start, same prompt stream, the
same problems where the study's eval set is fixed). Over the n seeds both ran:
  mean d̄, standard error se = sd(d) / sqrt(n) (sd with n - 1), df = n - 1;
  90% CI            d̄ ± t_{0.95, df} · se  (seed-level t-interval: trained runs are random too);
  TOST p            max(P[T_df >= (d̄ + Δ)/se], P[T_df <= (d̄ - Δ)/se])  (nulls δ <= -Δ and δ >= +Δ);
  difference p      2 · P[T_df >= |d̄| / se]  (null δ = 0, two-sided);
  Holm              over the study's m primary comparisons, each family (TOST, difference) apart:
                    sorted p_(1) <= ... <= p_(m), adjusted p_(i) = max_{j<=i} min(1, (m - j + 1) p_(j));
                    a comparison without a test (fewer than 2 seed pairs) counts in m with p = 1.
Verdict at alpha (0.05):
  "equivalent"  Holm-adjusted TOST p <= alpha: the difference is shown inside ±Δ (the (1 - 2 alpha)
                CI, widened by the correction, lies inside the margin). It wins over "worse" and
                "better": a difference the margin calls irrelevant is not one the study acts on
                (the CI beside it shows whether it is also non-zero).
  "worse"       else Holm-adjusted difference p <= alpha and d̄ < 0: the two-sided (1 - alpha) CI,
                widened by the correction, lies entirely below 0.
  "better"      the same with d̄ > 0.
  "not shown"   else (too few seeds, or a CI that straddles a margin).
Secondary, a problem-level paired bootstrap of d̄ (seeded, numpy): the problems resampled with
replacement, one draw shared by every seed when the study's seeds are scored on the same problems,
one draw per seed otherwise. It treats the trained runs as fixed, so it is narrower than the
seed-level interval; it decides nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mpmath
import numpy as np

from megatron_fp8rl.report.study_figures import RunFigures

VERDICTS = ("equivalent", "worse", "better", "not shown")


class EquivalenceError(ValueError):
    """Runs the analysis cannot pair (the message names the arm and seed)."""


def t_cdf(t: float, df: int) -> float:
    """P[T_df <= t] of Student's t (mpmath's regularized incomplete beta); ±inf allowed."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    x = df / (df + t * t)
    tail = float(mpmath.betainc(df / 2, 0.5, 0, x, regularized=True)) / 2  # P[T >= |t|]
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom (0 < p < 1): the root of
    t_cdf(t) = p, bracketed by doubling (mpmath's Anderson-Björck solver)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t quantile needs 0 < p < 1 and df >= 1, got p = {p}, df = {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    high = 1.0
    while t_cdf(high, df) < p:
        high *= 2
    return float(mpmath.findroot(lambda t: t_cdf(float(t), df) - p, (0.0, high), solver="anderson"))


@dataclass(frozen=True)
class SeedInterval:
    """The seed-level t-interval of a mean paired difference."""

    mean: float
    low: float
    high: float
    se: float
    df: int


def seed_interval(differences: list[float], level: float = 0.90) -> SeedInterval:
    """d̄ ± t_{(1+level)/2, n-1} · sd/sqrt(n) over the per-seed differences (n >= 2)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2:
        raise EquivalenceError(f"a seed-level interval needs >= 2 seed pairs, got {d.size}")
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    half = t_quantile((1 + level) / 2, d.size - 1) * se
    return SeedInterval(mean, mean - half, mean + half, se, d.size - 1)


def _upper_tail(t: float, df: int) -> float:
    return 1.0 - t_cdf(t, df)


def _standardized(value: float, se: float) -> float:
    """value / se, with se = 0 (every seed the same difference) read as an exact mean."""
    if se > 0:
        return value / se
    return math.copysign(math.inf, value) if value != 0 else 0.0


def tost_p(interval: SeedInterval, margin: float) -> float:
    """The TOST p-value of H0: |δ| >= margin (module docstring): the larger one-sided p."""
    lower = _upper_tail(_standardized(interval.mean + margin, interval.se), interval.df)
    upper = t_cdf(_standardized(interval.mean - margin, interval.se), interval.df)
    return max(lower, upper)


def difference_p(interval: SeedInterval) -> float:
    """The two-sided p-value of H0: δ = 0."""
    t = abs(_standardized(interval.mean, interval.se))
    return 1.0 if t == 0 else min(1.0, 2 * _upper_tail(t, interval.df))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order (module docstring)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def bootstrap_interval(pairs: list[tuple[list[int], list[int]]], same_problems: bool, level: float = 0.90,
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of d̄ = mean over seeds of (arm - reference) accuracy, the problems of
    each (reference correctness, arm correctness) pair resampled with replacement (module docstring)."""
    per_problem = [np.asarray(arm, dtype=np.float64) - np.asarray(ref, dtype=np.float64) for ref, arm in pairs]
    rng = np.random.default_rng(seed)
    if same_problems:
        sizes = {d.size for d in per_problem}
        if len(sizes) != 1:
            raise EquivalenceError(f"same problems for every seed, yet the seeds scored {sorted(sizes)} problems")
        mean_over_seeds = np.mean(per_problem, axis=0)
        draws = mean_over_seeds[rng.integers(0, mean_over_seeds.size, (resamples, mean_over_seeds.size))].mean(axis=1)
    else:
        draws = np.mean([d[rng.integers(0, d.size, (resamples, d.size))].mean(axis=1) for d in per_problem], axis=0)
    tail = (1 - level) / 2
    return float(np.quantile(draws, tail)), float(np.quantile(draws, 1 - tail))


def verdict(mean: float, tost_holm: float, difference_holm: float, alpha: float = 0.05) -> str:
    """One of VERDICTS from the Holm-adjusted p-values (module docstring)."""
    if tost_holm <= alpha:
        return "equivalent"
    if difference_holm <= alpha and mean != 0:
        return "worse" if mean < 0 else "better"
    return "not shown"


@dataclass(frozen=True)
class Comparison:
    """One primary comparison: `arm` against `reference` over the seeds both ran."""

    reference: str
    arm: str
    seeds: tuple[str, ...]
    """The seeds paired (both arms finished, per-problem results on as many problems)."""
    differences: tuple[float, ...]
    """acc(arm, s) - acc(reference, s) per paired seed."""
    interval: SeedInterval | None
    """None with fewer than 2 seed pairs."""
    bootstrap: tuple[float, float] | None
    tost_p: float
    difference_p: float
    tost_holm: float
    difference_holm: float
    verdict: str


def _accuracy(run: RunFigures) -> float:
    return float(np.mean(run.eval_final))


def _paired(arms: dict[str, list[RunFigures]], reference: str, arm: str) -> list[tuple[RunFigures, RunFigures]]:
    """(reference run, arm run) of every seed both ran; an unpaired problem count is an error."""
    refs = {r.seed: r for r in arms.get(reference, []) if r.eval_final is not None}
    pairs = []
    for run in arms.get(arm, []):
        if run.eval_final is None or run.seed not in refs:
            continue
        if len(run.eval_final) != len(refs[run.seed].eval_final):
            raise EquivalenceError(f"{arm} seed {run.seed} scored {len(run.eval_final)} problems, {reference} seed "
                                   f"{run.seed} {len(refs[run.seed].eval_final)}: not the same held-out set")
        pairs.append((refs[run.seed], run))
    return sorted(pairs, key=lambda pair: int(pair[1].seed))


def compare(arms: dict[str, list[RunFigures]], comparisons: tuple[tuple[str, str], ...], margin: float,
            same_problems: bool, alpha: float = 0.05, level: float = 0.90, seed: int = 0) -> list[Comparison]:
    """Every (reference, arm) of `comparisons` (the study's primary ones, the Holm family), in order."""
    found = []
    for reference, arm in comparisons:
        pairs = _paired(arms, reference, arm)
        differences = tuple(_accuracy(run) - _accuracy(ref) for ref, run in pairs)
        interval = seed_interval(list(differences), level) if len(pairs) >= 2 else None
        boot = (bootstrap_interval([(ref.eval_final, run.eval_final) for ref, run in pairs], same_problems, level,
                                   seed=seed) if pairs else None)
        p_tost, p_diff = (tost_p(interval, margin), difference_p(interval)) if interval else (1.0, 1.0)
        found.append((reference, arm, tuple(run.seed for _, run in pairs), differences, interval, boot, p_tost, p_diff))
    tost_adjusted = holm([entry[6] for entry in found])
    difference_adjusted = holm([entry[7] for entry in found])
    return [Comparison(*entry, tost_holm=t, difference_holm=d,
                       verdict=verdict(entry[4].mean, t, d, alpha) if entry[4] else "not shown")
            for entry, t, d in zip(found, tost_adjusted, difference_adjusted)]
