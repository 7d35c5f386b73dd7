"""The CPU demo's seed distribution: `bash scripts/demo.sh train.seed=N` per seed, each run's logs kept
under results/demo/seedN, and the table README quotes written from them (results/demo/table.md).

    python bench/demo_seeds.py                       # seeds 1,2,1234 (the default's seed last)
    python bench/demo_seeds.py --seeds 1,2,3,4,1234  # more seeds; finished ones are kept
    python bench/demo_seeds.py --report-only         # the table of what finished
    python bench/demo_seeds.py --out results/demo_kl --seeds 1,2,1234 --against results/demo \
        algorithm.kl.coef=0.001 algorithm.kl.estimator=k3   # an arm, paired with the plain demo's seeds

--against REF writes <out>/against.md: per seed the final held-out accuracy of this arm minus REF's
(same seed, same fixed held-out problems), their mean with a 90% seed-level t-interval, a TOST
equivalence test at ±5 points (--margin) and the verdict word of report/equivalence.py (equivalent,
worse, better or not shown).

A seed whose results/demo/seedN/summary.json exists is not run again (unless --rerun). Kept per seed
(~150 KB): summary.json (eval/accuracy_start, eval/accuracy, eval/gained, eval/lost, eval/mcnemar_p,
timings), eval_correct.json (per-problem results of each eval), config.yaml, train.log (the console),
tb/ (tensorboard) and run.json (command, wall seconds, CPU). The checkpoints and weights stay in the
run directory under --runs. Wall time is the whole `scripts/demo.sh` (after the venv exists): it
stretches 2-4x when other jobs share the box, so run.json records the load average at the start.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_fp8rl.report.equivalence import compare  # noqa: E402
from megatron_fp8rl.report.study_figures import RunFigures  # noqa: E402
KEPT = ("summary.json", "eval_correct.json", "config.yaml")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def run_seed(seed: int, runs: Path, out: Path, extra: list[str]) -> None:
    """One demo run, its console teed to out/train.log, then its logs copied to `out`."""
    run_dir = runs / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a half-finished run of an earlier call: start it over
    out.mkdir(parents=True, exist_ok=True)
    command = ["bash", "scripts/demo.sh", f"train.seed={seed}", f"run_dir={run_dir}", *extra]
    print(f"[demo_seeds] seed {seed}: {' '.join(command)}", flush=True)
    load = os.getloadavg()[0]
    begin = time.time()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"[demo_seeds] seed {seed}: scripts/demo.sh exited {code}; see {out / 'train.log'}")
    for name in KEPT:
        shutil.copy2(run_dir / name, out / name)
    shutil.copytree(run_dir / "tb", out / "tb", dirs_exist_ok=True)
    record = {"seed": seed, "command": " ".join(command), "wall_s": round(time.time() - begin, 1),
              "load_at_start": round(load, 2), "cpu": cpu_name(), "nproc": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d")}
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")


def last_eval(out: Path) -> list[int]:
    """A finished seed's per-problem correctness (0/1) of its last eval (eval_correct.json)."""
    evals = json.loads((out / "eval_correct.json").read_text())
    return [int(correct) for correct in evals[max(evals, key=int)]]


def seed_row(out: Path) -> tuple[str, float]:
    """(the table row of one finished seed, its accuracy gain)."""
    summary = json.loads((out / "summary.json").read_text())
    record = json.loads((out / "run.json").read_text())
    start, end = summary["eval/accuracy_start"], summary["eval/accuracy"]
    row = (f"| {record['seed']} | {start:.3f} -> {end:.3f} | {int(summary['eval/gained'])} / "
           f"{int(summary['eval/lost'])} | {summary['eval/mcnemar_p']:.2g} | {record['wall_s'] / 60:.1f} min "
           f"| {record['load_at_start']:.1f} |")
    return row, end - start


def write_table(results: Path) -> str:
    """results/table.md from every finished seed folder; returns its text."""
    finished = _finished(results)
    if not finished:
        raise SystemExit(f"[demo_seeds] no finished seed under {results}")
    rows, gains = zip(*(seed_row(p) for p in finished))
    sizes = sorted({len(last_eval(p)) for p in finished})
    if len(sizes) > 1:
        raise SystemExit(f"[demo_seeds] the seeds under {results} were scored on different held-out sets "
                         f"({sizes} problems): rerun the older ones (--rerun --seeds ...)")
    lines = [f"| seed | held-out accuracy ({sizes[0]} problems) | gained / lost | McNemar p | wall | load at start |",
             "|---|---|---|---|---|---|", *rows, "",
             f"gain over {len(gains)} seeds: min {min(gains):+.3f}, median {statistics.median(gains):+.3f}, "
             f"max {max(gains):+.3f}"]
    text = "\n".join(lines) + "\n"
    (results / "table.md").write_text(text)
    return text


def _finished(results: Path) -> list[Path]:
    return sorted((p for p in results.glob("seed*") if (p / "run.json").exists()), key=lambda p: int(p.name[4:]))


def _final_eval(out: Path, arm: str) -> RunFigures:
    """A finished seed's last eval as the equivalence analysis takes it."""
    return RunFigures(arm, out.name[4:], {}, {}, last_eval(out))


def _shown(path: Path) -> Path:
    """`path` as the command line names it: relative to the checkout where it lies inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def write_against(results: Path, reference: Path, margin: float) -> str:
    """results/against.md: this arm against `reference` (another demo_seeds --out), seed by seed."""
    arms = {"reference": [_final_eval(p, "reference") for p in _finished(reference)],
            "arm": [_final_eval(p, "arm") for p in _finished(results)]}
    (found,) = compare(arms, (("reference", "arm"),), margin, same_problems=True)
    if not found.seeds:
        raise SystemExit(f"[demo_seeds] no seed finished under both {results} and {reference}")
    interval = found.interval
    mean = (f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]" if interval
            else f"{100 * found.differences[0]:+.1f} (1 seed pair, no interval)")
    lines = [f"# {results.name} against {reference.name}: final held-out greedy accuracy", "",
             f"Arm minus reference on the same seed, in points, over the seeds both finished; 90% seed-level "
             f"t-interval; TOST at ±{100 * margin:.0f} points (the equivalence study's margin); one comparison, no "
             f"correction. Written by `python bench/demo_seeds.py --out {_shown(results)} "
             f"--against {_shown(reference)} --report-only`.", "",
             "| seeds | per-seed difference, points | mean [90% CI] | TOST p | difference p | verdict |",
             "|---|---|---|---|---|---|",
             f"| {', '.join(found.seeds)} | {', '.join(f'{100 * d:+.1f}' for d in found.differences)} | {mean} "
             f"| {found.tost_p:.3g} | {found.difference_p:.3g} | {found.verdict} |"]
    text = "\n".join(lines) + "\n"
    (results / "against.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,1234")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "demo_seeds",
                        help="where the run directories (checkpoints, weights: ~4 GB each) go")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "demo")
    parser.add_argument("--rerun", action="store_true", help="run seeds that finished before again")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--against", type=Path, help="another arm's --out: pair this arm's seeds with its (against.md)")
    parser.add_argument("--margin", type=float, default=0.05, help="the equivalence margin (accuracy, not points)")
    parser.add_argument("overrides", nargs="*", help="config overrides passed to every run")
    args = parser.parse_args(argv)
    if not args.report_only:
        for seed in (int(s) for s in args.seeds.split(",")):
            out = args.out / f"seed{seed}"
            if (out / "run.json").exists() and not args.rerun:
                print(f"[demo_seeds] seed {seed}: finished before, kept ({out})")
                continue
            run_seed(seed, args.runs.resolve(), out, args.overrides)
    print(write_table(args.out))
    if args.against is not None:
        print(write_against(args.out.resolve(), args.against.resolve(), args.margin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
