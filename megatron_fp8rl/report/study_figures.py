"""The stability study's figures (issues 23, 44): what one run measured, and how an arm's seeds
compare with a reference arm's.

Owns: the per-run figures (`run_figures`, `RunFigures`), their spread over seeds (`arm_summary`,
`fmt_spread`), the paired held-out tests against a reference arm (`paired_against`, `seed_pairs`,
`pooled_test`) and where an arm stands against the reference's seed range (`standing`). The report
(study_report.py) and the verdict across regimes (study_verdict.py) are written from them. Reads run
directories only (tensorboard logs, eval_correct.json); must not import trainer code.

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


def seed_pairs(arms: dict[str, list[RunFigures]], reference: str, name: str) -> list[tuple[RunFigures, RunFigures]]:
    """(reference run, arm `name`'s run) for each seed both ran with per-problem results on the same problems."""
    refs = {r.seed: r for r in arms.get(reference, [])}
    return [(refs[run.seed], run) for run in arms.get(name, [])
            if run.seed in refs and _same_problems(refs[run.seed], run)]


def pooled_test(pairs: list[tuple[RunFigures, RunFigures]]) -> dict[str, float]:
    """One McNemar over every pair's problems together: each run against its own reference run."""
    return paired_eval_change([bool(c) for ref, _ in pairs for c in ref.eval_final],
                              [bool(c) for _, run in pairs for c in run.eval_final])


def arm_figures(runs: dict[str, dict[str, Path]]) -> dict[str, list[RunFigures]]:
    """{arm: {seed: run_dir}} -> {arm: [RunFigures per seed]}, the logs read once per run."""
    return {arm: [run_figures(d, arm, seed) for seed, d in seeds.items()] for arm, seeds in runs.items()}


def kept_arms(figures: dict[str, list[RunFigures]]) -> dict[str, list[RunFigures]]:
    """The runs a report reads: those whose model moved (`never_updated` runs measure nothing)."""
    return {arm: kept for arm, found in figures.items() if (kept := [f for f in found if not f.never_updated])}
