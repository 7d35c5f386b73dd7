"""The stability study's report (issue 23): every arm over its seeds, against the bf16 arm.

Owns: the per-run figures (`run_figures`), their spread over seeds (`arm_summary`), the paired
held-out test against the reference arm (`paired_against`), the verdict (`verdict_lines`) and
`write_study_report` (report.md, curves.png, accuracy.png). Reads run directories only (tensorboard
logs, config.yaml, eval_correct.json); must not import trainer code.

Per run, from its tensorboard scalars (steps without a value skipped):
- overclip   the paper's diagnostic, clip/neg_overclip_before: the share of negative-advantage
             tokens of the calibrated mini-batch that the arm's FP8 ratio clips and the
             high-precision shadow's ratio does not (algorithm.calibration.mode=monitor or shadow;
             runs without an FP8 trainer have no FP8 ratio: n/a, zero by construction)
- overclip_pooled   the same over the run's A<0 values rather than its steps: sum over steps of
             the share x clip/neg_values (how many A<0 values the share is of) / their sum; a step
             with 3 such values counts 3, not as much as one with 90 (NaN for runs logged before
             clip/neg_values existed); neg_values: that sum
- noise_q01  the median over steps of clip/fp8_noise_q0.01, the 1% quantile of log r − log r_s
             over the A<0 values (how far FP8 pulls a bad token's ratio below the shadow's; a
             rule=noise L is (1 − ε_low)·exp of it at the default noise_tail; NaN for runs that did
             not log it)
- low_at_limit / high_at_limit   the share of steps whose calibrated L (H) sat at a limit
             (clip/low_at_limit, clip/high_at_limit; NaN for runs that did not log them)
- overclip_fp8   clip/neg_overclip_fp8, logged by gate arms (calibration.mode=gate): what their FP8
             ratio would have over-clipped had it decided the clip (their `overclip`, of the decisions
             the loss took on the shadow's ratio, is 0); NaN for other runs
- overclip_after   clip/neg_overclip_after, the same share with the bounds calibrated on that very
             step (in-sample; the `overclip` share is with the bounds in force, calibrated a step
             before): what no calibration of the bounds can remove
- clip_low   train/clip_frac_low: the share of response tokens the lower bound silenced
- entropy    train/entropy at the first step and the mean of the last `TAIL` steps; drift = their ratio
- no_number / repetitive / length / reward / truncated   the means of the last `TAIL` steps
             (truncated: response/truncated_frac, responses cut at rollout.max_new_tokens)
- reward_first   the mean reward of the first `TAIL` steps; a run whose last steps' mean falls
             under REWARD_COLLAPSE x it has collapsed (an arm can fail this way without any entropy
             surge or non-numeric output: its answers run to the token limit and stop scoring)
- accuracy   held-out greedy accuracy at the last eval (start: the first eval), from
             eval_correct.json (tensorboard's eval/accuracy without it)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from megatron_fp8rl.report.logs import RunLogs, load_run
from megatron_fp8rl.rl.metrics import paired_eval_change

TAIL = 5
"""Steps at the end a 'final' figure averages (one step is too noisy at 4 prompts a step)."""
OVERCLIP_THRESHOLD = 0.01
"""An arm over-clips when its median (over seeds) mean diagnostic exceeds this share."""
ENTROPY_SURGE = 1.5
"""Entropy drift (last steps over the first) that counts as a surge."""
GARBLE_RISE = 0.10
"""Rise of the garbled share (no number, or repetitive) over the reference arm's that counts."""
REWARD_COLLAPSE = 0.5
"""A run collapses when its last `TAIL` steps' mean reward is under this share of its first's."""
POOLED = "all"
"""The key of `_paired_tests`' test over every shared seed's problems together."""


@dataclass
class RunFigures:
    arm: str
    seed: str
    values: dict[str, float]
    """The module docstring's figures (NaN where a run has none)."""
    curves: dict[str, tuple[np.ndarray, np.ndarray]]
    """tag -> (steps, values) of the plotted series."""
    eval_final: list[int] | None
    """Per-problem correctness of the last eval (eval_correct.json), for the paired tests."""
    last_responses: tuple[int, str] | None = None
    """(step, text) of the last logged samples/responses: what the policy wrote at the end."""
    never_updated: bool = False
    """The run logged train/grad_norm and it was 0 on every step: no gradient ever reached the
    optimizer (the bf16 shadow defect fixed in models/shadow.py left such runs behind)."""
    started: float = math.nan
    """When the run started training (unix seconds, from its first tensorboard event file's name):
    which code made it, for findings that a later fix changed."""


CURVES = {"clip/neg_overclip_before": "A<0 tokens over-clipped vs the shadow (diagnostic)",
          "train/entropy": "policy entropy (nats/token)",
          "response/no_number_frac": "garbled: responses without a number",
          "response/repetitive_frac": "garbled: responses with a repeated 3-gram",
          "train/clip_frac_low": "tokens clipped at the lower bound",
          "clip/fp8_noise_q0.01": "q0.01 of log r − log r_shadow over A<0",
          "response/truncated_frac": "responses cut at the token limit",
          "reward/mean": "rollout reward"}


def _series(run: RunLogs, tag: str) -> tuple[np.ndarray, np.ndarray] | None:
    series = run.get(tag)
    if series is None:
        return None
    keep = np.isfinite(series.values)
    return (series.steps[keep], series.values[keep]) if keep.any() else None


def _reduce(run: RunLogs, tag: str, reduce) -> float:
    """`reduce` of a tag's finite values over steps; NaN when the run logged none."""
    found = _series(run, tag)
    return float(reduce(found[1])) if found else math.nan


def _first_step(run: RunLogs, tag: str, condition) -> float:
    """The first step whose value meets `condition` (given all values, returns a mask); NaN if none."""
    found = _series(run, tag)
    if not found:
        return math.nan
    hits = np.flatnonzero(condition(found[1]))
    return float(found[0][hits[0]]) if hits.size else math.nan


def _pooled(run: RunLogs, share_tag: str, count_tag: str) -> tuple[float, float]:
    """(sum of share x count / sum of count, sum of count) over the steps that logged both; NaNs
    when the run logged no counts or no counted value."""
    shares, counts = _series(run, share_tag), _series(run, count_tag)
    if not shares or not counts:
        return math.nan, math.nan
    count_at = dict(zip(counts[0].tolist(), counts[1].tolist()))
    pairs = [(share, count_at[step]) for step, share in zip(shares[0].tolist(), shares[1].tolist())
             if count_at.get(step, 0) > 0]
    total = sum(count for _, count in pairs)
    return (sum(share * count for share, count in pairs) / total, total) if total else (math.nan, math.nan)


STEP_PHASES = ("time/rollout_s", "time/advantages_s", "time/recompute_s", "time/train_s", "time/sync_s")
"""The phases of one RL step the trainer times (evals and setup are timed apart)."""


def _step_seconds(run: RunLogs) -> float:
    """The mean over steps of a step's summed STEP_PHASES seconds (evals excluded); NaN without them."""
    per_step: dict[float, float] = {}
    for tag in STEP_PHASES:
        if (found := _series(run, tag)) is not None:
            for step, seconds in zip(found[0].tolist(), found[1].tolist()):
                per_step[step] = per_step.get(step, 0.0) + seconds
    return float(np.mean(list(per_step.values()))) if per_step else math.nan


def run_figures(run_dir: Path, arm: str, seed: str) -> RunFigures:
    """The figures of one finished run (`run_dir` holds tb/ and eval_correct.json)."""
    run = load_run(run_dir, name=f"{arm}/{seed}")
    entropy, accuracy = _series(run, "train/entropy"), _series(run, "eval/accuracy")
    values = {
        "overclip": _reduce(run, "clip/neg_overclip_before", np.mean),
        "overclip_max": _reduce(run, "clip/neg_overclip_before", np.max),
        "overclip_after": _reduce(run, "clip/neg_overclip_after", np.mean),
        "overclip_fp8": _reduce(run, "clip/neg_overclip_fp8", np.mean),
        "noise_q01": _reduce(run, "clip/fp8_noise_q0.01", np.median),
        "low_at_limit": _reduce(run, "clip/low_at_limit", np.mean),
        "high_at_limit": _reduce(run, "clip/high_at_limit", np.mean),
        "clip_low": _reduce(run, "train/clip_frac_low", np.mean),
        "entropy_first": float(entropy[1][0]) if entropy else math.nan,
        "entropy_last": _reduce(run, "train/entropy", lambda v: v[-TAIL:].mean()),
        "no_number": _reduce(run, "response/no_number_frac", lambda v: v[-TAIL:].mean()),
        "repetitive": _reduce(run, "response/repetitive_frac", lambda v: v[-TAIL:].mean()),
        "length": _reduce(run, "response/length_mean", lambda v: v[-TAIL:].mean()),
        "reward": _reduce(run, "reward/mean", lambda v: v[-TAIL:].mean()),
        "reward_first": _reduce(run, "reward/mean", lambda v: v[:TAIL].mean()),
        "truncated": _reduce(run, "response/truncated_frac", lambda v: v[-TAIL:].mean()),
        "accuracy_start": float(accuracy[1][0]) if accuracy else math.nan,
        "accuracy": float(accuracy[1][-1]) if accuracy else math.nan,
        "train_forward_delta_max": _reduce(run, "noise/train_forward_abs_delta_max", np.max),
        "mismatch": _reduce(run, "train/mismatch_abs_logprob_diff_mean", np.mean),
        "mismatch_max": _reduce(run, "train/mismatch_abs_logprob_diff_mean", np.max),
        "step_s": _step_seconds(run),
    }
    values["overclip_pooled"], values["neg_values"] = _pooled(run, "clip/neg_overclip_before", "clip/neg_values")
    values["entropy_drift"] = values["entropy_last"] / values["entropy_first"] if entropy else math.nan
    values["collapsed"] = float(values["reward"] < REWARD_COLLAPSE * values["reward_first"])
    # when each sign first shows: over-clipping above the threshold, an entropy surge, garbling
    # (the no-number share GARBLE_RISE above its first steps')
    values["overclip_from"] = _first_step(run, "clip/neg_overclip_before", lambda v: v > OVERCLIP_THRESHOLD)
    values["surge_from"] = _first_step(run, "train/entropy", lambda v: v > ENTROPY_SURGE * v[0])
    values["garble_from"] = _first_step(run, "response/no_number_frac", lambda v: v > v[:TAIL].mean() + GARBLE_RISE)
    curves = {tag: found for tag in CURVES if (found := _series(run, tag)) is not None}
    record = Path(run_dir) / "eval_correct.json"
    evals = json.loads(record.read_text()) if record.is_file() else {}
    eval_final = evals[max(evals, key=int)] if evals else None
    if evals:  # the per-problem record, where the run wrote one
        values["accuracy_start"] = float(np.mean(evals[min(evals, key=int)]))
        values["accuracy"] = float(np.mean(eval_final))
    shown = run.texts.get("samples/responses")
    last = (max(shown), shown[max(shown)]) if shown else None
    grad_norm = _series(run, "train/grad_norm")
    return RunFigures(arm, seed, values, curves, eval_final, last,
                      never_updated=grad_norm is not None and not grad_norm[1].any(), started=run.started)


def paired_against(reference: RunFigures, run: RunFigures) -> dict[str, float] | None:
    """McNemar on the last eval of `run` against `reference` on the same problems: gained = right
    in `run` and wrong in the reference. None when either has no per-problem record."""
    if not _same_problems(reference, run):
        return None
    return paired_eval_change([bool(c) for c in reference.eval_final], [bool(c) for c in run.eval_final])


def _same_problems(reference: RunFigures, run: RunFigures) -> bool:
    """Whether both runs recorded per-problem results of their last eval on as many problems."""
    return (reference.eval_final is not None and run.eval_final is not None
            and len(reference.eval_final) == len(run.eval_final))


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values; NaNs when none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    return float(np.median(finite)), min(finite), max(finite)


def arm_summary(runs: list[RunFigures]) -> dict[str, tuple[float, float, float]]:
    """figure -> (median, min, max) over the arm's seeds."""
    return {key: spread([r.values[key] for r in runs]) for key in runs[0].values}


def fmt_spread(triple: tuple[float, float, float], percent: bool = False, digits: int = 3) -> str:
    """'median [min, max]' (the median alone when min = max; 'n/a' when NaN), as a percentage with one
    decimal or with `digits` decimals."""
    median, low, high = triple
    if not math.isfinite(median):
        return "n/a"
    scale, unit, places = (100.0, "%", 1) if percent else (1.0, "", digits)

    def one(value: float) -> str:
        return f"{value * scale:.{places}f}{unit}"

    return one(median) + (f" [{one(low)}, {one(high)}]" if low != high else "")


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


MATCH_P = 0.05
"""An arm matches the reference when its median final accuracy is not below the reference's seed
range and the paired McNemar against it (pooled over seeds where there are several) has p > MATCH_P;
it beats the reference when its median is above that range and the test has p <= MATCH_P with more
problems gained than lost (the reference falls short of it); an arm whose median is inside the range
with that same test in its favour is neither (the two differ, in its favour), and is named as ahead."""


def standing(median: float, reference: tuple[float, float, float], test: dict | None) -> tuple[str, str]:
    """(where an arm's median final accuracy sits against the reference's (median, min, max) seed
    range: 'below', 'inside' or 'above'; what that and the paired `test` against the reference say,
    MATCH_P: 'matches', 'beats', 'ahead' or 'short' (below the range, or behind on the same problems,
    or no test))."""
    where = "below" if median < reference[1] else "above" if median > reference[2] else "inside"
    if where == "below" or test is None:
        return where, "short"
    if test["mcnemar_p"] > MATCH_P:
        return where, "matches"
    if test["gained"] > test["lost"]:  # significantly better on the same problems: more than a match
        return where, "beats" if where == "above" else "ahead"
    return where, "short"


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


def seed_pairs(arms: dict[str, list[RunFigures]], reference: str, name: str) -> list[tuple[RunFigures, RunFigures]]:
    """(reference run, arm `name`'s run) for each seed both ran with per-problem results on the same problems."""
    refs = {r.seed: r for r in arms.get(reference, [])}
    return [(refs[run.seed], run) for run in arms.get(name, [])
            if run.seed in refs and _same_problems(refs[run.seed], run)]


def pooled_test(pairs: list[tuple[RunFigures, RunFigures]]) -> dict[str, float]:
    """One McNemar over every pair's problems together: each run against its own reference run."""
    return paired_eval_change([bool(c) for ref, _ in pairs for c in ref.eval_final],
                              [bool(c) for _, run in pairs for c in run.eval_final])


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


def arm_figures(runs: dict[str, dict[str, Path]]) -> dict[str, list[RunFigures]]:
    """{arm: {seed: run_dir}} -> {arm: [RunFigures per seed]}, the logs read once per run."""
    return {arm: [run_figures(d, arm, seed) for seed, d in seeds.items()] for arm, seeds in runs.items()}


def kept_arms(figures: dict[str, list[RunFigures]]) -> dict[str, list[RunFigures]]:
    """The runs a report reads: those whose model moved (`never_updated` runs measure nothing)."""
    return {arm: kept for arm, found in figures.items() if (kept := [f for f in found if not f.never_updated])}


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
