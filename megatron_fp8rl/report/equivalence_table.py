"""The equivalence verdict table (issue 61 items 2, 3, 6): per primary comparison the arm, its
reference, the paired seeds, the difference in final held-out accuracy with its 90% seed-level CI (and
the problem-level bootstrap CI beside it), the Holm-adjusted p-values, the verdict word, the arm's
extra compute per step and its projected GPU step time over a bf16 step.

Owns: `ArmCost` (an arm's passes and trainer GEMMs), `table_lines` and `write_equivalence`. The
statistics are report/equivalence.py, the pass counts rl/step_cost.py. Must not import trainer code.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_fp8rl.report.equivalence import Comparison
from megatron_fp8rl.rl.step_cost import StepPasses, projected_step_ratio

SPEEDUPS = (1.3, 1.5, 1.9)
"""FP8/bf16 GEMM speed ratios the projection is shown at (issue 61; the GPU kit's measured ratio
replaces them once it exists)."""


@dataclass(frozen=True)
class ArmCost:
    """What one step of an arm costs: its passes and its trainer's GEMMs (rl/step_cost.py)."""

    passes: StepPasses
    gemm: str


def _points(value: float) -> str:
    """A difference in points, one decimal, signed; a rounding to zero shows as +0.0, not -0.0."""
    return f"{round(100 * value, 1) + 0.0:+.1f}"


def _difference(comparison: Comparison) -> str:
    if not comparison.seeds:
        return "no runs yet"
    if comparison.interval is None:
        return f"{_points(comparison.differences[0])} (1 seed pair, no interval)"
    ci = comparison.interval
    return f"{_points(ci.mean)} [{_points(ci.low)}, {_points(ci.high)}]"


def _bootstrap(comparison: Comparison) -> str:
    return "—" if comparison.bootstrap is None else f"[{_points(comparison.bootstrap[0])}, {_points(comparison.bootstrap[1])}]"


def _p(value: float, tested: bool) -> str:
    return f"{value:.2g}" if tested else "—"


def _extra(cost: ArmCost) -> str:
    passes = cost.passes
    text = f"{passes.extra_forward:+.2f} fwd, {passes.extra_backward:+.2f} bwd ({100 * passes.extra_share:+.1f}%)"
    return text + (f"; monitor {passes.monitor:.2f} fwd" if passes.monitor else "")


def _projected(cost: ArmCost) -> str:
    if cost.gemm not in ("fp8", "bf16"):
        return "—"
    return " / ".join(f"{projected_step_ratio(cost.passes, cost.gemm, s):.2f}" for s in SPEEDUPS)


HEADER = ("| arm | vs | seeds | difference, points [90% CI] | bootstrap 90% CI | TOST p (Holm) | difference p (Holm) "
          f"| verdict | extra compute a step | GPU step / bf16 step at FP8 speed {' / '.join(map(str, SPEEDUPS))} |",
          "|---|---|---|---|---|---|---|---|---|---|")


def table_lines(comparisons: list[Comparison], costs: dict[str, ArmCost]) -> list[str]:
    """The markdown table, one row per comparison in the study's order; `costs` has every compared arm."""
    missing = sorted({c.arm for c in comparisons} - set(costs))
    if missing:
        raise KeyError(f"equivalence table: no step cost for {missing}")
    rows = list(HEADER)
    for c in comparisons:
        tested = c.interval is not None
        rows.append(f"| {c.arm} | {c.reference} | {len(c.seeds)} | {_difference(c)} | {_bootstrap(c)} "
                    f"| {_p(c.tost_holm, tested)} | {_p(c.difference_holm, tested)} | {c.verdict} "
                    f"| {_extra(costs[c.arm])} | {_projected(costs[c.arm])} |")
    return rows


def legend(margin: float, alpha: float, same_problems: bool, comparisons: int) -> str:
    """What the table's columns mean (report/equivalence.py's definitions, in words)."""
    problems = ("every seed scored on the same held-out problems" if same_problems else
                "the seeds scored on different held-out problems (the seed-level interval on the per-seed "
                "paired differences is still valid; the bootstrap resamples each seed's problems apart)")
    return (f"Final held-out greedy accuracy, arm minus reference on the same seed, in points; mean over the seeds "
            f"both ran with its 90% seed-level t-interval; {problems}. Margin ±{100 * margin:g} points; Holm over "
            f"the {comparisons} comparisons below; verdict at alpha {alpha:g}: equivalent (TOST, Holm-adjusted p <= "
            f"{alpha:g}), else worse / better (two-sided difference test, Holm-adjusted p <= {alpha:g}), else not "
            "shown. Extra compute: forward and backward passes of the step's batch beyond plain FP8's recompute + "
            "forward + backward, and their share of its 4 forward-equivalents (monitor: passes that only measure, "
            "left out of the projection). GPU step: projected time over a bf16 step (rl/step_cost.py: a step is "
            "its GEMM time, 1 recompute + 3 train forward-equivalents; shadow forwards at bf16 speed).")


def write_equivalence(out: Path, title: str, sections: list[tuple[str, str, list[str]]]) -> Path:
    """`out` (markdown): the title, then per section its heading, its text and its table."""
    lines = [f"# {title}", ""]
    for heading, text, table in sections:
        lines += [f"## {heading}", "", text, "", *table, ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out
