"""Study v3's verdict across its regimes (issue 44): the issue's targets checked on the committed runs,
every arm of the original jobs side by side over the regimes, and each remedy against what it remedies,
pooled over seeds and regimes.

Owns: `write_verdict` (verdict.md) and its parts. Input: {regime: {arm: [RunFigures]}} (the runs each
regime's report kept, study_figures.arm_figures) and what each arm is (`ArmKind`, from the study's
settings). Reads no logs itself and must not import trainer code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_fp8rl.fp8.serving import RolloutFp8
from megatron_fp8rl.report.study_figures import (
    MATCH_P, OVERCLIP_THRESHOLD, RunFigures, arm_summary, fmt_spread, pooled_test, seed_pairs, standing,
)


@dataclass(frozen=True)
class ArmKind:
    """What an arm is, as far as the issue's targets care."""

    fp8: bool
    """Its trainer or its rollouts compute in FP8 (the arms the targets are about)."""
    probe: bool
    """It changes the job (learning rate, frozen norms): it answers why, not whether a target is met."""
    aligned_float32: bool
    """Aligned FP8 rollouts with float32 outside the GEMMs: the rollout must equal the trainer bit for bit."""


def arm_kind(overrides: tuple[str, ...], probe_overrides: tuple[str, ...]) -> ArmKind:
    """An arm's kind from its `train` overrides ('key=value'); `probe_overrides`: those that change the job."""
    values = dict(o.split("=", 1) for o in overrides)
    fp8 = any(values.get(key, "none") != "none" for key in ("model.fp8", "rollout.fp8"))
    aligned = RolloutFp8(values.get("rollout.fp8", "none")) is RolloutFp8.ALIGNED
    return ArmKind(fp8=fp8, probe=any(o in overrides for o in probe_overrides),
                   aligned_float32=aligned and values.get("model.dtype") != "bfloat16")


Regimes = dict[str, dict[str, list[RunFigures]]]
"""{regime: {arm: [RunFigures per seed]}}."""
ALIGNED_FIX = ("a195390", 1796430832.0)
"""The commit (and its time, 2026-12-05 00:33:52 UTC) that made aligned rollouts bit-identical to the
trainer's recompute whatever the call shape (issue 44 item 1: every attention row one SDPA call on both
sides, the lm_head in 16-row tiles); before it an aligned run logged a small mismatch (1e-7 to 1e-5 a
token). Runs that started before it are reported apart: they show the defect, not the current code."""


def _pooled(arms: dict[str, list[RunFigures]], reference: str, name: str) -> dict | None:
    pairs = seed_pairs(arms, reference, name)
    return pooled_test(pairs) if pairs else None


def _test_text(test: dict | None) -> str:
    return "no paired test" if test is None else f"+{test['gained']:.0f}/−{test['lost']:.0f}, p = {test['mcnemar_p']:.2g}"


def _against(arms: dict[str, list[RunFigures]], reference: str, name: str) -> tuple[str, str, str]:
    """(where, standing, text) of arm `name` against `reference`'s seed range and pooled paired test."""
    test = _pooled(arms, reference, name)
    where, verdict = standing(arm_summary(arms[name])["accuracy"][0], arm_summary(arms[reference])["accuracy"], test)
    return where, verdict, f"{where} {reference}'s range {fmt_spread(arm_summary(arms[reference])['accuracy'])}, " \
                           + _test_text(test)


def _accuracy(runs: list[RunFigures]) -> str:
    return f"{fmt_spread(arm_summary(runs)['accuracy'])} ({_seeds(runs)})"


def _seeds(runs: list[RunFigures]) -> str:
    seeds = sorted(int(r.seed) for r in runs)
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def target_lines(regimes: Regimes, kinds: dict[str, ArmKind], default: str, reference: str) -> list[str]:
    """The issue's four targets, each with its figures and met / not met."""
    lines = []
    moderate = {name: arms for name, arms in regimes.items() if name.startswith("moderate")}
    parts, met = [], []
    for name, arms in moderate.items():
        if default in arms and reference in arms:
            _, verdict, text = _against(arms, reference, default)
            met.append(verdict != "short")
            parts.append(f"{name}: {_accuracy(arms[default])}, {text}: {'met' if verdict != 'short' else 'not met'}"
                         + (f" ({verdict} {reference})" if verdict in ("beats", "ahead") else ""))
    lines.append(f"- **Moderate target** (the default `{default}` not below {reference}'s seed range, pooled p > "
                 f"{MATCH_P:g} or ahead on the same problems, at 2 and at 4 mini-batches): "
                 + ("; ".join(parts) if parts else "no runs") + ". "
                 + ("**Met.**" if met and all(met) and len(met) == len(moderate) else "**Not met.**"))
    for name, arms in regimes.items():
        if name.startswith("moderate") or reference not in arms:
            continue
        candidates = {arm: _against(arms, reference, arm) for arm in arms
                      if kinds.get(arm) and kinds[arm].fp8 and not kinds[arm].probe}
        meeting = [arm for arm, (_, verdict, _) in candidates.items() if verdict != "short"]
        closest = max(candidates, key=lambda arm: arm_summary(arms[arm])["accuracy"][0], default=None)
        lines.append(f"- **{name.capitalize()} target** (some FP8 arm of the same job not below {reference}'s seed "
                     f"range, pooled p > {MATCH_P:g}): "
                     + (f"**met** by {', '.join(f'{arm} ({candidates[arm][2]})' for arm in meeting)}." if meeting else
                        f"**not met**: no FP8 arm; the highest median, {closest} {_accuracy(arms[closest])}, is "
                        f"{candidates[closest][2]}." if closest else "**not met**: no FP8 arm ran."))
    lines.append(_overclip_line(regimes, kinds))
    lines.append(_mismatch_line(regimes, kinds))
    return lines


def _overclip_line(regimes: Regimes, kinds: dict[str, ArmKind]) -> str:
    parts = []
    for name, arms in regimes.items():
        under = [f"{arm} {fmt_spread(arm_summary(runs)['overclip'], percent=True)}" for arm, runs in arms.items()
                 if kinds.get(arm) and kinds[arm].fp8 and not kinds[arm].probe
                 and arm_summary(runs)["overclip"][0] <= OVERCLIP_THRESHOLD]
        parts.append(f"{name}: {', '.join(under) if under else 'none'}")
    return (f"- **Over-clip diagnostic ≤ {OVERCLIP_THRESHOLD:.0%}** (median over seeds of the share of A<0 tokens "
            "the arm's ratio clips and its high-precision shadow's does not), FP8 arms at or under it: "
            + "; ".join(parts) + ".")


def _mismatch_line(regimes: Regimes, kinds: dict[str, ArmKind]) -> str:
    """Per arm with aligned rollouts and float32 outside the FP8 GEMMs: its runs, and the largest
    per-step mean |Δ log p| any of them logged (0: bit-identical on every step of every run)."""
    commit, fixed_at = ALIGNED_FIX
    by_arm: dict[tuple[str, bool], list[tuple[str, RunFigures]]] = {}
    for name, arms in regimes.items():
        for arm, found in arms.items():
            if kinds.get(arm) and kinds[arm].aligned_float32:
                for run in found:
                    if math.isfinite(run.values["mismatch_max"]):
                        by_arm.setdefault((arm, run.started < fixed_at), []).append((name, run))
    parts = {False: [], True: []}
    off = []
    for (arm, before_fix), runs in by_arm.items():
        worst = max(run.values["mismatch_max"] for _, run in runs)
        where = ", ".join(sorted({name for name, _ in runs}))
        parts[before_fix].append(f"{arm} ({len(runs)} run{'s' * (len(runs) > 1)}, {where}): "
                                 + ("0" if worst == 0 else f"up to {worst:.2g}"))
        off += [arm] if worst != 0 and not before_fix else []
    earlier = (f" Runs trained before {commit}, the fix of the post-eval mismatch: {'; '.join(parts[True])}."
               if parts[True] else "")
    return ("- **Mismatch exactly 0 on every step of an aligned run** (train/mismatch_abs_logprob_diff_mean, "
            "the mean |Δ log p| a token between rollout and trainer recompute, its largest value over every step "
            f"of every run of the arms with aligned rollouts and float32 outside the FP8 GEMMs, trained since {commit}): "
            + ("; ".join(parts[False]) or "no run") + ". " + (f"**Not met** by {', '.join(off)}." if off else "**Met.**")
            + earlier)


TABLE_HEADER = ("| arm | regime | seeds | final accuracy | vs bf16 | vs float32 | diagnostic | s/step |",
                "|---|---|---|---|---|---|---|---|")


def side_by_side(regimes: Regimes, kinds: dict[str, ArmKind], references: tuple[str, str]) -> list[str]:
    """One row per arm of the original jobs (no probes) and regime: final accuracy, the pooled paired
    tests against both references, the diagnostic and the mean seconds of an RL step (evals excluded)."""
    first = sorted(regimes, key=lambda name: not name.startswith("moderate"))  # the issue's regimes' arms first
    order = list(dict.fromkeys([*references, *(arm for name in first for arm in regimes[name]
                                                if not (kinds.get(arm) and kinds[arm].probe))]))
    rows = list(TABLE_HEADER)
    for arm in order:
        for name, arms in regimes.items():
            if arm not in arms:
                continue
            s = arm_summary(arms[arm])
            tests = [_test_text(_pooled(arms, ref, arm)) if ref in arms and ref != arm else "—" for ref in references]
            rows.append(f"| {arm} | {name} | {len(arms[arm])} | {fmt_spread(s['accuracy'])} | {tests[0]} | {tests[1]} "
                        f"| {fmt_spread(s['overclip'], percent=True)} | {fmt_spread(s['step_s'], digits=0)} |")
    return rows


def remedy_lines(regimes: Regimes, remedies: tuple[tuple[str, str], ...]) -> list[str]:
    """Each (base, remedy) pair on the same seeds: per regime, and pooled over every regime's pairs."""
    lines = []
    for base, remedy in remedies:
        parts, pairs = [], []
        for name, arms in regimes.items():
            found = seed_pairs(arms, base, remedy)
            if found:
                pairs += found
                parts.append(f"{name} {fmt_spread(arm_summary([r for _, r in found])['accuracy'])} against "
                             f"{fmt_spread(arm_summary([b for b, _ in found])['accuracy'])}, {_test_text(pooled_test(found))}")
        if pairs:
            lines.append(f"- **{remedy} against {base}**, same seeds: " + "; ".join(parts)
                         + (f"; all regimes: {_test_text(pooled_test(pairs))}" if len(parts) > 1 else "") + ".")
    return lines


def recommended_line(regimes: Regimes, kinds: dict[str, ArmKind], references: tuple[str, str]) -> str:
    """The FP8 arms that, in every moderate regime, stand with both references (not below either's
    seed range, no paired loss at MATCH_P) and keep the diagnostic at or under OVERCLIP_THRESHOLD."""
    moderate = [arms for name, arms in regimes.items() if name.startswith("moderate")]
    fp8 = [arm for arm, kind in kinds.items() if kind.fp8 and not kind.probe]

    def passes(arm: str) -> bool:
        return bool(moderate) and all(
            arm in arms and all(ref in arms and _against(arms, ref, arm)[1] != "short" for ref in references)
            and arm_summary(arms[arm])["overclip"][0] <= OVERCLIP_THRESHOLD for arms in moderate)

    chosen = [arm for arm in fp8 if passes(arm)]
    return ("- **FP8 arms that meet every moderate criterion** (in each moderate regime: not below "
            f"{references[0]}'s nor {references[1]}'s seed range with no paired loss at p <= {MATCH_P:g}, and the "
            f"diagnostic ≤ {OVERCLIP_THRESHOLD:.0%}): " + (", ".join(chosen) if chosen else "none") + ".")


def write_verdict(regimes: Regimes, kinds: dict[str, ArmKind], out: Path, default: str,
                  references: tuple[str, str], remedies: tuple[tuple[str, str], ...], preamble: str) -> Path:
    """verdict.md at `out`: the targets, the arms meeting every moderate criterion, the remedies and the
    side-by-side table; returns its path."""
    lines = ["# FP8 stability study v3: the verdict across regimes", "", preamble, "", "## The issue's targets", "",
             *target_lines(regimes, kinds, default, references[0]), recommended_line(regimes, kinds, references), "",
             "## Remedies against what they remedy (same seeds; pooled McNemar)", "", *remedy_lines(regimes, remedies),
             "", "## Every arm of the original jobs, by regime (median [min, max] over seeds; pooled McNemar)", "",
             *side_by_side(regimes, kinds, references), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out
