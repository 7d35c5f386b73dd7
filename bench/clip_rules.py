"""Calibrated Clipping's rules for L compared offline on the ratios real runs recorded: which rule
keeps the over-clip diagnostic low without turning the lower clip off.

A study run with algorithm.calibration.record=true (every monitor and CC arm of bench/stability.py)
writes each calibration's values to <run>/calibration/step_<k>.safetensors: the FP8 ratio, the
high-precision shadow's ratio and the advantage of every value of the calibrated mini-batch, as
`calibrate` saw them. For each rule this replays the run's calibrations in order, as the trainer
does (its clip interval, limits and smoothing from config.yaml), and scores the bounds each
calibration yields on the *next* calibration's values (out of sample: the trainer uses bounds
calibrated a step before):
    L            the lower bound in force: median [min, max] over the scored steps
    at limit     the share of scored steps whose L sat at limits.low_min or low_max
    over-clip    A<0 values the FP8 ratio clips and the shadow's (at the configured bound) does not,
                 pooled: their count over all scored steps / the A<0 values there (the issue's
                 target: <= 1%)
    under-clip   the reverse: A<0 values the shadow clips and FP8 does not (a rule that lowers L
                 buys less over-clip with more of these)
Rules: plain (the configured bounds), floor (L at limits.low_min throughout: what no lower bound
within the limits can avoid), quantile (the paper's α-quantile), noise at δ (ours, the
δ-quantile of log r − log r_s priced at the bound), budget at τ (ours: at most τ of the shadow's
unclipped A<0 values below L). The ratios do not depend on the rule: under aligned rollouts the
first mini-batch trains at ratio 1, so the calibrated mini-batch's θ does not depend on the bounds
(with more mini-batches before it they do, slightly).

    python bench/clip_rules.py [RUN_OR_STUDY_DIR ...]   # default: every recorded run of results/stability_v3
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_fp8rl.rl.calibrated_clipping import ClipBounds, ClipLimits, calibrate, clip_diagnostic  # noqa: E402

RULES = {"plain": None, "floor": {"floor": True}, "quantile": {"rule": "quantile"},
         **{f"noise δ={d:g}": {"rule": "noise", "noise_tail": d} for d in (0.01, 0.05, 0.1)},
         **{f"budget τ={t:g}": {"rule": "budget", "overclip_budget": t} for t in (0.01, 0.02, 0.05)}}
"""Rule name -> calibrate's rule arguments (None: the configured bounds, never calibrated; floor: L at
limits.low_min on every step, the least over-clip any lower bound within the limits reaches)."""


@dataclass
class Score:
    """One rule's out-of-sample record over some runs."""

    lows: list[float] = field(default_factory=list)
    at_limit: int = 0
    over: int = 0
    under: int = 0
    negatives: int = 0

    def add(self, other: "Score") -> None:
        self.lows += other.lows
        self.at_limit += other.at_limit
        self.over, self.under, self.negatives = (self.over + other.over, self.under + other.under,
                                                 self.negatives + other.negatives)


def run_settings(run_dir: Path) -> tuple[ClipBounds, ClipLimits, float]:
    """The configured clip interval, the calibration limits and smoothing of a run (config.yaml)."""
    algo = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]
    limits = ClipLimits(**algo["calibration"]["limits"])
    return ClipBounds.from_epsilons(algo["clip"]["low"], algo["clip"]["high"]), limits, algo["calibration"]["smoothing"]


def records(run_dir: Path) -> list[dict]:
    """The run's calibration records in step order."""
    return [load_file(path) for path in sorted((run_dir / "calibration").glob("step_*.safetensors"))]


def replay(values: list[dict], rule: dict | None, configured: ClipBounds, limits: ClipLimits,
           smoothing: float) -> Score:
    """Calibrate on each record in turn (as ClipCalibrator does) and score the bounds in force on
    every record after the first."""
    score, current, previous = Score(), configured, None
    if rule is not None and rule.get("floor"):
        current, rule = ClipBounds(limits.low_min, configured.high), None
    for index, v in enumerate(values):
        ratio, shadow, adv = v["ratio"], v["shadow_ratio"], v["advantages"]
        negatives = int((adv < 0).sum())
        if index > 0 and negatives:
            diagnostic = clip_diagnostic(ratio, shadow, adv, current, configured)
            score.over += round(diagnostic["neg_overclip"] * negatives)
            score.under += round(diagnostic["neg_underclip"] * negatives)
            score.negatives += negatives
            score.lows.append(current.low)
            score.at_limit += current.low in (limits.low_min, limits.low_max)
        if rule is not None:
            out = calibrate(ratio, shadow, adv, configured, current, previous, limits, smoothing, **rule)
            if not out.skipped:
                current = previous = out.bounds
    return score


def recorded_runs(paths: list[Path]) -> dict[str, list[Path]]:
    """'<regime>/<arm>' (or the run's own name) -> its run directories with records under `paths`."""
    found: dict[str, list[Path]] = {}
    for path in paths:
        for record_dir in sorted({p.parent for p in path.rglob("calibration/step_*.safetensors")}):
            run = record_dir.parent
            key = f"{run.parent.parent.name}/{run.parent.name}" if run.name.startswith("seed") else run.name
            found.setdefault(key, []).append(run)
    return found


def table(found: dict[str, list[Path]]) -> list[str]:
    lines = ["| arm | runs | rule | L | L at limit | over-clip | under-clip | A<0 values scored |",
             "|---|---|---|---|---|---|---|---|"]
    for key, runs in found.items():
        data = [(records(run), *run_settings(run)) for run in runs]
        for name, rule in RULES.items():
            total = Score()
            for values, configured, limits, smoothing in data:
                total.add(replay(values, rule, configured, limits, smoothing))
            if not total.negatives:
                continue
            low = f"{np.median(total.lows):.3f} [{min(total.lows):.3f}, {max(total.lows):.3f}]"
            lines.append(f"| {key} | {len(runs)} | {name} | {low} | {total.at_limit / len(total.lows):.0%} | "
                         f"{total.over / total.negatives:.2%} | {total.under / total.negatives:.2%} | "
                         f"{total.negatives} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[REPO / "results" / "stability_v3"],
                        help="run or study directories searched for calibration records")
    args = parser.parse_args(argv)
    found = recorded_runs(args.paths)
    if not found:
        raise SystemExit(f"no calibration records (calibration/step_*.safetensors) under "
                         f"{', '.join(map(str, args.paths))}: runs record them with algorithm.calibration.record=true")
    print("\n".join(table(found)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
