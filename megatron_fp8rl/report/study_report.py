"""The stability study's report (issue 23): every arm over its seeds, against the bf16 arm.

Owns: the verdict of one regime (`verdict_lines`), its arms table, its plots and `write_study_report`
(report.md, curves.png, accuracy.png), from the figures of report/study_figures.py. Reads run
directories only through those; must not import trainer code.
"""
from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import numpy as np

from megatron_fp8rl.report.study_figures import (
    CURVES, ENTROPY_SURGE, GARBLE_RISE, MATCH_P, OVERCLIP_THRESHOLD, REWARD_COLLAPSE, TAIL, RunFigures, arm_figures,
    arm_summary, fmt_spread, kept_arms, paired_against, pooled_test, seed_pairs, spread, standing,
)

POOLED = "all"
"""The key of `_paired_tests`' test over every shared seed's problems together."""


def verdict_lines(arms: dict[str, list[RunFigures]], reference: str, also_against: tuple[str, ...] = ()) -> list[str]:
    """The report's answers to the issue's four questions, from the figures (medians over seeds,
    [min, max] where an arm has more than one seed); the "which arms match" line is repeated against
    each arm of `also_against` that has runs (a second reference, float32)."""
    summaries = {name: arm_summary(runs) for name, runs in arms.items()}
    ref = summaries.get(reference)
    lines = []
    measured = {n: s for n, s in summaries.items() if math.isfinite(s["overclip"][0])}
    over = [n for n, s in measured.items() if s["overclip"][0] > OVERCLIP_THRESHOLD]
    if not measured:
        lines.append("- **Over-clipping**: no arm measured the diagnostic (no FP8 trainer arm finished).")
    else:
        listed = ", ".join(f"{n} {fmt_spread(measured[n]['overclip'], percent=True)}"
                           + (f" (pooled over its A<0 values: {fmt_spread(measured[n]['overclip_pooled'], percent=True)})"
                              if math.isfinite(measured[n]["overclip_pooled"][0]) else "")
                           for n in sorted(measured, key=lambda n: -measured[n]["overclip"][0]))
        lines.append(f"- **Over-clipping** (mean share of A<0 tokens clipped by the arm's ratio and not by "
                     f"the shadow's; > {OVERCLIP_THRESHOLD:.0%} counts): "
                     + (f"{', '.join(over)} over-clip" if over else "no arm over-clips") + f". All: {listed}.")
    if ref is not None:
        for name in over:
            s = summaries[name]
            garbled = max(s["no_number"][0] - ref["no_number"][0], s["repetitive"][0] - ref["repetitive"][0])
            surge = s["entropy_drift"][0] > ENTROPY_SURGE
            order = ", ".join(f"{what} from step {fmt_spread(s[key], digits=0)}" for what, key in
                              (("over-clipping", "overclip_from"), ("entropy surge", "surge_from"),
                               ("garbling", "garble_from")) if math.isfinite(s[key][0]))
            lines.append(
                f"- **{name}: does entropy/garbling follow?** entropy drift {fmt_spread(s['entropy_drift'])} "
                f"({reference}: {fmt_spread(ref['entropy_drift'])}), garbled shares no-number "
                f"{fmt_spread(s['no_number'], percent=True)} / repetitive {fmt_spread(s['repetitive'], percent=True)} ({reference}: "
                f"{fmt_spread(ref['no_number'], percent=True)} / {fmt_spread(ref['repetitive'], percent=True)}): "
                + ("entropy surges" if surge else "no entropy surge") + " and "
                + ("output garbles" if garbled > GARBLE_RISE else "no garbling beyond the reference")
                + f" (first seen, median over seeds: {order})" + ".")
    lines.append(_collapse_line(arms))
    for name in sorted(summaries):
        calibrated = f"{name}_cc"
        if calibrated not in summaries or ref is None:
            continue
        plain, cc = summaries[name], summaries[calibrated]
        lines.append(f"- **Calibrated Clipping on {name}**: diagnostic {fmt_spread(plain['overclip'], percent=True)} -> "
                     f"{fmt_spread(cc['overclip'], percent=True)} (with bounds calibrated on the same step: "
                     f"{fmt_spread(cc['overclip_after'], percent=True)}); held-out accuracy {fmt_spread(plain['accuracy'])} -> "
                     f"{fmt_spread(cc['accuracy'])} ({reference}: {fmt_spread(ref['accuracy'])}); "
                     + _paired_text(arms, reference, calibrated) + "; " + _paired_text(arms, name, calibrated)
                     + _limits_text(cc) + ".")
    for name in sorted(summaries):
        base, _, rule = name.rpartition("_cc_")
        if base and f"{base}_cc" in summaries and rule:
            plain_cc, remedy = summaries[f"{base}_cc"], summaries[name]
            lines.append(f"- **{name} (CC with the {rule} rule) against {base}_cc, same seeds**: diagnostic "
                         f"{fmt_spread(plain_cc['overclip'], percent=True)} -> {fmt_spread(remedy['overclip'], percent=True)}; "
                         f"accuracy {fmt_spread(plain_cc['accuracy'])} -> {fmt_spread(remedy['accuracy'])}; "
                         + _paired_text(arms, f"{base}_cc", name) + _limits_text(remedy)
                         + f" (plain CC{_limits_text(plain_cc)[1:] or ': no limit flags logged'}).")
    for suffix, remedy_line in (("_gate", _gate_line), (BF16_SUFFIX, partial(_on_bf16_line, reference=reference)),
                                (TIS_SUFFIX, partial(_tis_line, reference=reference))):
        for name in sorted(summaries):  # `<recipe><suffix>` against `<recipe>`, same seeds
            base, _, tail = name.rpartition(suffix)
            if base and not tail and base in summaries:
                lines.append(remedy_line(arms, summaries, base, name))
    lines += _probe_lines(arms, summaries, (reference, *also_against))
    for against in (reference, *also_against):
        if (match := _match_line(arms, summaries, against)) is not None:
            lines.append(match)
    for name in ("aligned", "aligned_cc"):
        if name in summaries:
            s = summaries[name]
            lines.append(f"- **{name}**: first-forward |log π_θ − log π_old| max "
                         f"{fmt_spread(s['train_forward_delta_max'], digits=2)} (0: the first mini-batch's ratio is "
                         f"exactly 1), diagnostic on the later mini-batch {fmt_spread(s['overclip'], percent=True)}, "
                         f"accuracy {fmt_spread(s['accuracy'])}.")
    return lines


def _match_line(arms: dict[str, list[RunFigures]], summaries: dict, reference: str) -> str | None:
    """'- **Which arms match <reference>**: ...' per arm: median [min, max] final accuracy, below,
    inside or above the reference's seed range, the (pooled) paired p and gained/lost; the arms that match
    and those that beat it (MATCH_P); None without reference runs."""
    ref = summaries.get(reference)
    if ref is None or not math.isfinite(ref["accuracy"][0]):
        return None
    matching, beating, ahead, parts = [], [], [], []
    for name, summary in summaries.items():
        if name == reference:
            continue
        tests = _paired_tests(arms, reference, name)
        test = tests.get(POOLED, next(iter(tests.values()), None) if len(tests) == 1 else None)
        where, verdict = standing(summary["accuracy"][0], ref["accuracy"], test)
        {"matches": matching, "beats": beating, "ahead": ahead}.get(verdict, []).append(name)
        p_text = (f"p = {test['mcnemar_p']:.2g}, +{test['gained']:.0f}/-{test['lost']:.0f}" if test is not None
                  else "no paired test")
        parts.append(f"{name} {fmt_spread(summary['accuracy'])} ({where}, {p_text})")
    beat_text = (f" Which beat it (median above that range, paired p <= {MATCH_P:g} with more problems gained "
                 f"than lost): {', '.join(beating)}." if beating else "")
    beat_text += (f" Which are inside that range and ahead of it on the same problems (paired p <= {MATCH_P:g}, "
                  f"more gained than lost): {', '.join(ahead)}." if ahead else "")
    return (f"- **Which arms match {reference}** (median final accuracy inside or above {reference}'s seed "
            f"range {fmt_spread(ref['accuracy'])} and paired McNemar p > {MATCH_P:g}, pooled over seeds): "
            + (", ".join(matching) if matching else "none") + "." + beat_text + " All: " + "; ".join(parts) + ".")


def _gate_line(arms: dict[str, list[RunFigures]], summaries: dict, base: str, name: str) -> str:
    """The shadow gate against the same recipe's plain and CC arms on the same seeds."""
    gated, plain = summaries[name], summaries[base]
    cc = summaries.get(f"{base}_cc")
    against_cc = (f"; against {base}_cc (accuracy {fmt_spread(cc['accuracy'])}, diagnostic {fmt_spread(cc['overclip'], percent=True)}) "
                  + _paired_text(arms, f"{base}_cc", name) if cc is not None else "")
    return (f"- **{name} (the clip decided on the shadow's ratio) against {base}, same seeds**: diagnostic "
            f"{fmt_spread(plain['overclip'], percent=True)} -> {fmt_spread(gated['overclip'], percent=True)} (its FP8 ratio "
            f"would have over-clipped {fmt_spread(gated['overclip_fp8'], percent=True)}); accuracy {fmt_spread(plain['accuracy'])} -> "
            f"{fmt_spread(gated['accuracy'])}; " + _paired_text(arms, base, name) + against_cc + ".")


BF16_SUFFIX = "_bf16"
"""`<recipe>_bf16`: the FP8 recipe of arm `<recipe>` on a bf16 mixed-precision trainer (FP8 GEMMs, bf16
elsewhere), compared with `<recipe>` (float32 outside its GEMMs) on the same seeds."""


def _on_bf16_line(arms: dict[str, list[RunFigures]], summaries: dict, base: str, name: str, reference: str) -> str:
    """The FP8 recipe on a bf16 trainer against the same recipe on a float32 one, same seeds: the
    diagnostic (against a bf16 shadow there, a float32 one here), the mismatch (with the reference's
    beside it), the length limit, accuracy and the paired test."""
    on_bf16, plain = summaries[name], summaries[base]
    return (f"- **{name} (the same FP8 recipe on a bf16 trainer: FP8 GEMMs, bf16 elsewhere) against {base} "
            f"(float32 outside its GEMMs), same seeds**: diagnostic {fmt_spread(plain['overclip'], percent=True)} -> "
            f"{fmt_spread(on_bf16['overclip'], percent=True)} (its shadow is the bf16 forward); rollout/trainer "
            + _mismatch_to_paired_text(arms, summaries, base, name, reference))


def _mismatch_to_paired_text(arms: dict[str, list[RunFigures]], summaries: dict, base: str, name: str,
                             reference: str) -> str:
    """'mismatch A -> B (...; <reference> R); cut at the length limit ...; accuracy ...; <paired test>.':
    what changes from arm `base` to arm `name` on the same seeds, with the reference's own mismatch as
    the yardstick (bf16's rollouts are bf16 SGLang against a bf16 trainer, not bit-identical either);
    the tail of the `_bf16` and `_tis` lines."""
    plain, remedy = summaries[base], summaries[name]
    ref = summaries.get(reference)
    yardstick = f"; {reference} {fmt_spread(ref['mismatch'], digits=4)}" if ref is not None else ""
    return (f"mismatch {fmt_spread(plain['mismatch'], digits=4)} -> {fmt_spread(remedy['mismatch'], digits=4)} (mean |Δ log p| "
            f"a token{yardstick}); cut at the length limit {fmt_spread(plain['truncated'], percent=True)} -> "
            f"{fmt_spread(remedy['truncated'], percent=True)}; accuracy {fmt_spread(plain['accuracy'])} -> "
            f"{fmt_spread(remedy['accuracy'])}; " + _paired_text(arms, base, name) + ".")


TIS_SUFFIX = "_tis"
"""`<arm>_tis`: arm `<arm>` with truncated importance sampling against the rollout/trainer mismatch,
compared with `<arm>` on the same seeds (`bf16_fp8block_tis` has no `bf16_fp8block` arm: no line)."""


def _tis_line(arms: dict[str, list[RunFigures]], summaries: dict, base: str, name: str, reference: str) -> str:
    """An arm with TIS against the same arm without it, same seeds: the mismatch TIS reweights, the
    length limit, accuracy and the paired test."""
    return (f"- **{name} ({base} with TIS against the rollout/trainer mismatch) against {base}, same seeds**: "
            + _mismatch_to_paired_text(arms, summaries, base, name, reference))


def _probe_lines(arms: dict[str, list[RunFigures]], summaries: dict, references: tuple[str, ...]) -> list[str]:
    """A probe is one change made to several arms (`<arm>_<probe>`, e.g. `_low_lr`); where a
    reference arm has it too (`bf16_low_lr`), the probe is a job of its own, so each of its arms is
    also compared with the probe's references on the same seeds, and a remedy arm with its recipe's
    plain arm under the same change (`groupwise32_gate_low_lr` with `groupwise32_low_lr`): one line
    per probe."""
    lines = []
    for probe in sorted({name[len(ref) + 1:] for ref in references for name in summaries if name.startswith(f"{ref}_")}):
        suffix = f"_{probe}"
        refs = [ref + suffix for ref in references if ref + suffix in summaries]
        family = {name[: -len(suffix)]: name for name in summaries
                  if name.endswith(suffix) and name[: -len(suffix)] in summaries}
        parts = []
        for arm, name in family.items():
            if name == refs[0]:
                continue
            plain = [family[base] for base in family if arm.startswith(f"{base}_")]
            parts.append(f"{name} {fmt_spread(summaries[name]['accuracy'])}: " + "; ".join(
                f"{_paired_text(arms, other, name)} ({other} {fmt_spread(summaries[other]['accuracy'])})"
                for other in [ref for ref in refs if ref != name] + plain))
        if parts:
            lines.append(f"- **Probe `{suffix}`, against its own references on the same seeds** (a probe changes the "
                         "job: it says why, not whether the original job's target is met): " + "; ".join(parts) + ".")
    return lines


def _limits_text(summary: dict[str, tuple[float, float, float]]) -> str:
    """'; L at a limit on x of steps, H on y' where the runs logged clip/*_at_limit (a bound at
    its limit is a clip turned off or maxed out, not calibrated), else ''."""
    low, high = summary["low_at_limit"], summary["high_at_limit"]
    if not math.isfinite(low[0]):
        return ""
    return f"; L at a limit on {fmt_spread(low, percent=True)} of steps, H on {fmt_spread(high, percent=True)}"


def _collapse_line(arms: dict[str, list[RunFigures]]) -> str:
    """Which arms' reward collapsed (last `TAIL` steps under REWARD_COLLAPSE x the first), in how many seeds."""
    counts = {name: sum(r.values["collapsed"] > 0 for r in runs) for name, runs in arms.items()}
    hit = [f"{name} ({count} of {len(arms[name])} seeds)" for name, count in counts.items() if count]
    rewards = ", ".join(f"{name} {fmt_spread(spread([r.values['reward_first'] for r in runs]))} -> "
                        f"{fmt_spread(spread([r.values['reward'] for r in runs]))}" for name, runs in arms.items())
    return (f"- **Reward collapse** (mean reward of the last {TAIL} steps under {REWARD_COLLAPSE:g}x the first "
            f"{TAIL}): " + (", ".join(hit) if hit else "no arm") + f". Reward first -> last: {rewards}.")


def _paired_text(arms: dict[str, list[RunFigures]], reference: str, name: str) -> str:
    tests = _paired_tests(arms, reference, name)
    if not tests:
        return f"no paired test against {reference} (no shared seed with per-problem results)"
    parts = [f"{'all seeds' if seed == POOLED else f'seed {seed}'}: {int(t['gained'])} gained / "
             f"{int(t['lost'])} lost, p = {t['mcnemar_p']:.2g}" for seed, t in tests.items()]
    return f"vs {reference} on the same problems: " + "; ".join(parts)


def _paired_tests(arms: dict[str, list[RunFigures]], reference: str, name: str) -> dict[str, dict]:
    """seed -> McNemar of arm `name`'s last eval against the reference arm's, same seed; with two
    or more such seeds also POOLED -> the same test over all their problems together."""
    pairs = seed_pairs(arms, reference, name)
    out = {run.seed: paired_against(ref, run) for ref, run in pairs}
    if len(pairs) > 1:  # one McNemar over every seed's problems: seed s's run against the reference's seed s
        out[POOLED] = pooled_test(pairs)
    return out


COLUMNS = (("seeds", None), ("diagnostic", "overclip"), ("pooled over A<0 values (n)", "overclip_pooled"),
           ("lower clip", "clip_low"), ("FP8 noise q0.01", "noise_q01"),
           ("entropy first → last", None), ("no number", "no_number"), ("repetitive", "repetitive"),
           ("length", "length"), ("cut at limit", "truncated"), ("reward first → last", None),
           ("accuracy start → end", None))


def _table(arms: dict[str, list[RunFigures]], references: tuple[str, ...]) -> list[str]:
    header = [name for name, _ in COLUMNS] + [f"paired vs {reference}" for reference in references]
    lines = ["| arm | " + " | ".join(header) + " |", "|" + "---|" * (len(header) + 1)]
    for name, runs in arms.items():
        s = arm_summary(runs)
        pooled = fmt_spread(s["overclip_pooled"], True)
        if math.isfinite(s["overclip_pooled"][0]):
            pooled += f" ({fmt_spread(s['neg_values'], digits=0)})"
        cells = [str(len(runs)), fmt_spread(s["overclip"], True), pooled, fmt_spread(s["clip_low"], True), fmt_spread(s["noise_q01"]),
                 f"{fmt_spread(s['entropy_first'])} → {fmt_spread(s['entropy_last'])}", fmt_spread(s["no_number"], True),
                 fmt_spread(s["repetitive"], True), fmt_spread(s["length"], digits=1), fmt_spread(s["truncated"], True),
                 f"{fmt_spread(s['reward_first'])} → {fmt_spread(s['reward'])}",
                 f"{fmt_spread(s['accuracy_start'])} → {fmt_spread(s['accuracy'])}"]
        for reference in references:
            tests = _paired_tests(arms, reference, name) if name != reference else {}
            cells.append(", ".join(f"{'all: ' if seed == POOLED else ''}+{int(t['gained'])}/−{int(t['lost'])} "
                                   f"p={t['mcnemar_p']:.2g}" for seed, t in tests.items()) or "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _curves_figure(arms: dict[str, list[RunFigures]], path: Path) -> Path:
    from matplotlib.figure import Figure

    columns = math.ceil(len(CURVES) / 2)
    fig = Figure(figsize=(4.4 * columns, 3.6 * 2), layout="constrained")
    axes = fig.subplots(2, columns).flatten()
    for ax in axes[len(CURVES):]:
        ax.set_visible(False)
    for ax, (tag, title) in zip(axes, CURVES.items()):
        for index, (name, runs) in enumerate(arms.items()):
            found = [r.curves[tag] for r in runs if tag in r.curves]
            if not found:
                continue
            steps = sorted(set().union(*(set(s.tolist()) for s, _ in found)))
            table = np.full((len(found), len(steps)), np.nan)
            for row, (s, v) in enumerate(found):
                table[row, [steps.index(x) for x in s.tolist()]] = v
            with np.errstate(all="ignore"):
                middle = np.nanmedian(table, axis=0)
            ax.plot(steps, middle, color=f"C{index % 10}", label=name, linewidth=1.2)
            if len(found) > 1:
                ax.fill_between(steps, np.nanmin(table, axis=0), np.nanmax(table, axis=0),
                                color=f"C{index % 10}", alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    max(axes, key=lambda ax: len(ax.get_lines())).legend(fontsize=7)
    fig.suptitle("per step: median over seeds, band min-max")
    fig.savefig(path, dpi=90)
    return path


def _accuracy_figure(arms: dict[str, list[RunFigures]], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 0.9 * len(arms) + 2), 3.8), layout="constrained")
    ax = fig.subplots()
    for index, (name, runs) in enumerate(arms.items()):
        median, low, high = spread([r.values["accuracy"] for r in runs])
        start = spread([r.values["accuracy_start"] for r in runs])[0]
        ax.bar(index, median, color=f"C{index % 10}", alpha=0.8)
        if low != high:
            ax.errorbar(index, median, yerr=[[median - low], [high - median]], color="black", capsize=4)
        ax.scatter([index] * len(runs), [r.values["accuracy"] for r in runs], color="black", s=10, zorder=3)
        ax.plot([index - 0.4, index + 0.4], [start, start], color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(arms)), list(arms), rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out greedy accuracy (last eval)")
    ax.set_title("final accuracy per arm: bar median, whiskers min-max, dots seeds, dashed start", fontsize=9)
    fig.savefig(path, dpi=90)
    return path


def _responses_section(arms: dict[str, list[RunFigures]]) -> list[str]:
    """Each arm's last logged responses (its first seed with any), as the policy wrote them."""
    lines = []
    for name, runs in arms.items():
        run = next((r for r in runs if r.last_responses), None)
        if run is not None:
            step, text = run.last_responses
            lines += [f"**{name}** (seed {run.seed}, step {step}):", "", *text.split("\n\n"), ""]
    return ["## What each arm writes at the end", "", *lines] if lines else []


def write_study_report(runs: dict[str, dict[str, Path]], out_dir: Path, reference: str, preamble: str,
                       wall_seconds: dict[str, float] | None = None, also_against: tuple[str, ...] = (),
                       figures: dict[str, list[RunFigures]] | None = None) -> Path:
    """report.md + curves.png + accuracy.png in `out_dir` from {arm: {seed: run_dir}} (finished
    runs only; `figures`: their arm_figures when already read), every arm compared with `reference`
    and, where they have runs, with the arms of `also_against`; returns report.md's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = arm_figures(runs) if figures is None else figures
    stuck = [f"{f.arm}/seed{f.seed}" for found in figures.values() for f in found if f.never_updated]
    arms = kept_arms(figures)
    curves = _curves_figure(arms, out_dir / "curves.png")
    accuracy = _accuracy_figure(arms, out_dir / "accuracy.png")
    excluded = ([f"- **Excluded**: {', '.join(stuck)}: train/grad_norm was 0 on every step (the model never "
                 "moved), so the run measures nothing; train it again."] if stuck else [])
    lines = ["# FP8 stability study", "", preamble, "", "## Verdict", "", *excluded, *verdict_lines(arms, reference, also_against), "",
             f"## Arms (median [min, max] over seeds; final figures: mean of the last {TAIL} steps)", "",
             *_table(arms, (reference, *(a for a in also_against if a in arms))), "", f"![per-step curves]({curves.name})", "",
             f"![final accuracy]({accuracy.name})", ""]
    lines += _responses_section(arms)
    if wall_seconds:
        total = sum(wall_seconds.values())
        lines += ["## Wall time", "", f"{total / 60:.1f} min for the {len(wall_seconds)} runs trained by the "
                  "invocations that wrote timings.json:", "",
                  *(f"- {name}: {seconds / 60:.1f} min" for name, seconds in wall_seconds.items()), ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    return report
