"""The equivalence analysis of a study's committed runs (issue 61): each regime's primary comparisons
(study/arms.py `Equivalence`) judged by report/equivalence.py, with each arm's cost per step
(rl/step_cost.py), written as a markdown table and printed. `megatron-fp8rl stability --equivalence`
(bench/stability.py) reruns it from the logs: issue 61's study (pre-registered,
results/equivalence/equivalence.md; rows say "no runs yet" until its runs exist) and study v3's regimes
re-analysed (post hoc, results/stability_v3/equivalence.md).

Owns: `arm_cost`, `regime_section`, `write_regime_equivalence`, `run_equivalence`. Must not import
trainer code (the runs' logs and config.yaml are read as files).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from megatron_fp8rl.config.renamed import OLD_KEYS
from megatron_fp8rl.report.equivalence import compare
from megatron_fp8rl.report.equivalence_table import ArmCost, legend, table_lines, write_equivalence
from megatron_fp8rl.report.study_figures import arm_figures, kept_arms
from megatron_fp8rl.rl.step_cost import dotted, step_passes, step_shape
from megatron_fp8rl.study.arms import REGIMES, V3_REGIMES, Equivalence, Regime, Setting, post_hoc_equivalence
from megatron_fp8rl.study.runner import REPO, run_dir_of

EQUIVALENCE_FILE = "equivalence.md"
"""Beside a pre-registered regime's study directory (results/equivalence/equivalence.md)."""
V3_EQUIVALENCE = "results/stability_v3/equivalence.md"
"""Study v3's regimes re-analysed."""


def finished_runs(regime: Regime, study_dir: Path) -> dict[str, dict[str, Path]]:
    """{arm: {seed: run_dir}} of the regime's finished runs (summary.json present), under its seeds."""
    found = {arm.name: {str(seed): run_dir_of(study_dir, arm, seed) for seed in regime.seeds[:arm.seeds]}
             for arm in regime.arms}
    return {arm: kept for arm, dirs in found.items()
            if (kept := {seed: d for seed, d in dirs.items() if (d / "summary.json").is_file()})}


def arm_cost(regime: Regime, arm: Setting, run_dirs: dict[str, Path]) -> ArmCost:
    """The arm's step cost: from its first finished run's config.yaml (what ran; a key saved under its
    name before a rename, config/renamed.py, read under the new one), else from the study's definition
    (the regime's shared overrides, sizes and the arm's own; every key the cost reads must be written
    there, rl/step_cost.py refuses a missing one by name)."""
    if run_dirs:
        first = run_dirs[min(run_dirs, key=int)] / "config.yaml"
        saved = dotted(yaml.safe_load(first.read_text()))
        values = {**{new: saved[old] for new, old in OLD_KEYS.items() if old in saved}, **saved}
    else:
        values = {**regime.common, **regime.sizes, **dict(o.split("=", 1) for o in arm.overrides)}
    shape = step_shape(values)
    return ArmCost(step_passes(shape), shape.gemm)


def regime_section(regime: Regime, equivalence: Equivalence, study_dir: Path) -> tuple[str, str, list[str]]:
    """(heading, text, table) of one regime's comparisons."""
    runs = finished_runs(regime, study_dir)
    figures = kept_arms(arm_figures(runs)) if runs else {}
    comparisons = compare(figures, equivalence.comparisons, equivalence.margin, equivalence.same_problems,
                          equivalence.alpha)
    arms = {arm.name: arm for arm in regime.arms}
    costs = {name: arm_cost(regime, arms[name], runs.get(name, {})) for _, name in equivalence.comparisons}
    when = ("Pre-registered: the margin and the primary comparisons were written in study/arms.py before any run."
            if equivalence.preregistered else
            "Post hoc: a re-analysis of runs made before this analysis existed; the comparisons (every arm that "
            "keeps the job against float32) were chosen after the runs.")
    text = f"{regime.about} {when} " + legend(equivalence.margin, equivalence.alpha, equivalence.same_problems,
                                              len(comparisons))
    return regime.name, text, table_lines(comparisons, costs)


def write_regime_equivalence(regime: Regime, study_dir: Path) -> Path:
    """The pre-registered regime's table, beside its study directory (EQUIVALENCE_FILE), printed."""
    section = regime_section(regime, regime.equivalence, study_dir)
    out = write_equivalence(study_dir.parent / EQUIVALENCE_FILE,
                            f"Equivalence study, regime {regime.name}: each arm against its reference", [section])
    print("\n".join(section[2]))
    print(f"[stability] equivalence: {out}")
    return out


def run_equivalence() -> int:
    """Every pre-registered regime's table, then study v3's regimes re-analysed (V3_EQUIVALENCE)."""
    for regime in REGIMES.values():
        if regime.equivalence is not None:
            write_regime_equivalence(regime, REPO / regime.study_dir)
    sections = [regime_section(REGIMES[name], post_hoc_equivalence(REGIMES[name]), REPO / REGIMES[name].study_dir)
                for name in V3_REGIMES]
    out = write_equivalence(REPO / V3_EQUIVALENCE, "Study v3 re-analysed for equivalence to float32 (issue 61)",
                            sections)
    for heading, _, table in sections:
        print(f"{heading}:\n" + "\n".join(table))
    print(f"[stability] equivalence: {out}")
    return 0
