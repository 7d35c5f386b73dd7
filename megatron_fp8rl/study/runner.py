"""The FP8 stability study's runner (v2: issue 23; v3: issue 44): every arm x seed of a regime not
finished yet, one after another, then the regime's report (report/study_report.py); the verdict across
regimes (report/study_verdict.py); its command line (`megatron-fp8rl stability`, `python
bench/stability.py`). What it runs, the regimes and their arms, is study/arms.py. Must not
import: trainer code (runs are subprocesses; the report reads their logs).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from megatron_fp8rl.config.renamed import OLD_KEYS
from megatron_fp8rl.study.arms import (
    COMMON, FROZEN_NORMS, HIGH_PRECISION, LOW_LR, QUICK, RECIPES, REFERENCE, REGIMES, SEEDS, V3_REGIMES, Regime, Setting,
    parse_added_setting, preamble,
    runs_of, select_settings, study_settings,
)

REPO = Path(__file__).resolve().parents[2]


def train_command(setting: Setting, run_dir: Path, model: Path, sizes: dict, extra: list[str],
                  nproc: int, seed: int, common: dict = COMMON) -> list[str]:
    """The torchrun command of one arm and seed (later overrides win: the regime's common ones,
    sizes, seed, arm, --set)."""
    from megatron_fp8rl.compat.tcp_store import free_port  # torch: not at `--help` time
    overrides = [f"{k}={v}" for k, v in {**common, **sizes, "train.seed": seed}.items()]
    overrides += [f"model.hf_path={model}", f"run_dir={run_dir}", *setting.overrides, *extra]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            "--module", "megatron_fp8rl.cli", "train", *overrides]


def run_setting(command: list[str], log_path: Path, timeout_s: float) -> int:
    """Run one training command, output to `log_path`; afterwards kill every process it started.
    Two nets: an environment marker (torchrun gives each worker its own session, and
    dist_checkpointing helpers can outlive a failed worker) and the process tree sampled while it
    runs (SGLang's children rename themselves with setproctitle, which overwrites the environment
    that /proc shows)."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, MEGATRON_FP8RL_STUDY_RUN=marker)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    seen: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            while (code := proc.poll()) is None:
                if time.monotonic() > deadline:
                    return 124
                _remember_descendants(proc.pid, seen)
                time.sleep(2.0)
            return code
        finally:
            _kill_started(marker, seen)


def _remember_descendants(pid: int, seen: dict[int, float]) -> None:
    try:
        for child in psutil.Process(pid).children(recursive=True):
            seen[child.pid] = child.create_time()
    except psutil.Error:
        pass


def _kill_started(marker: str, seen: dict[int, float]) -> None:
    for proc in psutil.process_iter():
        try:
            mine = proc.pid in seen and proc.create_time() == seen[proc.pid]  # not a reused pid
            if mine or proc.environ().get("MEGATRON_FP8RL_STUDY_RUN") == marker:
                proc.kill()
        except psutil.Error:
            continue


RECORDING_KEYS = ("algorithm.calibration.record",)
"""Overrides that change what a run writes, not how it trains: a finished run made without them is
still the arm's (it lacks only their output, e.g. calibration/ for runs before the record existed)."""


def config_differences(run_dir: Path, overrides: list[str]) -> list[str]:
    """'key: run has X, the study sets Y' for every `key=value` override that the finished run's
    config.yaml does not hold (values compared as YAML, numbers as numbers; RECORDING_KEYS not
    compared); a run directory is reused only when this is empty."""
    import yaml

    path = run_dir / "config.yaml"
    saved = yaml.safe_load(path.read_text()) if path.is_file() else {}
    out = []
    for item in overrides:
        key, _, text = item.partition("=")
        if key in RECORDING_KEYS:
            continue
        found = _saved_value(saved, key)
        if found is _MISSING and key in OLD_KEYS:  # a run made before the key was renamed
            found = _saved_value(saved, OLD_KEYS[key])
        if not _same_value(yaml.safe_load(text), found):
            out.append(f"{key}: run has {found!r}, the study sets {text}")
    return out


_MISSING = object()


def _saved_value(saved: dict, key: str):
    """The value of dotted `key` in a loaded config.yaml, or _MISSING."""
    found = saved
    for part in key.split("."):
        found = found.get(part, _MISSING) if isinstance(found, dict) else _MISSING
    return found


def _same_value(wanted, found) -> bool:
    numbers = (int, float)
    if isinstance(found, numbers) and not isinstance(found, bool) and not isinstance(wanted, bool):
        try:
            return float(wanted) == float(found)
        except (TypeError, ValueError):
            return False
    return wanted == found


BULKY = ("checkpoints", "init_megatron", "final_megatron", "rollout_fp8", "hf")
"""Weight folders of a finished run that the report never reads (3.9 GB of a SmolLM2 run's ~4 GB;
twelve runs' worth filled this box's disk): removed after the run unless --keep-weights. Every
log stays (tb/, train.log, config.yaml, summary.json, eval_correct.json: under 1 MB a run), so a
study directory can be kept in git and its finished runs reused on another machine."""


def prune_weights(run_dir: Path) -> None:
    """Remove the BULKY folders a run wrote (a deletion that fails raises: the disk would fill)."""
    for name in BULKY:
        if (run_dir / name).exists():
            shutil.rmtree(run_dir / name)


def run_dir_of(study_dir: Path, setting: Setting, seed: int) -> Path:
    return study_dir / setting.name / f"seed{seed}"


def run_study(args: argparse.Namespace) -> int:
    """Train every selected arm x seed not finished yet (summary.json present), within --hours,
    then the report of every finished run (--report-only: the report alone). --verdict and
    --equivalence train nothing and write what they name instead (`megatron-fp8rl stability` calls
    this with every flag)."""
    if args.equivalence:
        from megatron_fp8rl.study.equivalence import run_equivalence  # it imports this module

        return run_equivalence()
    if args.verdict:
        return run_verdict()
    regime = REGIMES[args.regime]
    try:
        settings = select_settings(args.settings, args.add, regime.name)
        seeds = regime.seeds if args.seeds is None else tuple(int(s) for s in args.seeds.split(",") if s)
        model = None if args.report_only else _model_path(Path(args.model))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = dict(QUICK if args.quick else regime.sizes)
    if args.steps:
        sizes["train.steps"] = args.steps
    study_dir = Path(args.study_dir or REPO / regime.study_dir)
    study_dir.mkdir(parents=True, exist_ok=True)
    timings = _timings(study_dir)
    plan = runs_of(settings, seeds)
    failed = [] if args.report_only else _train(plan, study_dir, model, sizes, args, timings, regime.common)
    missing = [f"{s.name}/seed{seed}" for s, seed in plan if not _finished(run_dir_of(study_dir, s, seed))]
    print(f"[stability] {len(plan) - len(missing)} of {len(plan)} runs finished"
          + (f"; missing: {', '.join(missing)}" if missing else ""), flush=True)
    # the report covers every finished run of the regime (its arms, --add ones, every seed), not only
    # what this invocation selected: `--settings x` must not shrink the committed report to x
    reported = list({s.name: s for s in [*study_settings(regime.name), *args.add, *settings]}.values())
    _report(reported, tuple(sorted({*regime.seeds, *seeds})), study_dir, timings, regime)
    if regime.equivalence is not None:
        from megatron_fp8rl.study.equivalence import write_regime_equivalence  # it imports this module

        write_regime_equivalence(regime, study_dir)
    if failed:
        print(f"[stability] failed runs: {failed} (logs: <study_dir>/<arm>/seed<k>/train.log)", file=sys.stderr)
    return 1 if failed else 0


VERDICT = "results/stability_v3/verdict.md"
"""Where --verdict writes the verdict across the regimes (docs/stability.md quotes it)."""
REMEDIES = (("groupwise32", "groupwise32_gate"), ("groupwise32", "groupwise32_cc"),
            ("groupwise32_cc", "groupwise32_cc_noise"), ("tensorwise", "tensorwise_cc"), ("blockwise", "blockwise_cc"),
            ("groupwise32", "groupwise32_bf16"))
"""(arm, the arm that remedies it) pairs the verdict tests on the same seeds, per regime and pooled."""


def run_verdict() -> int:
    """Every regime's report of its committed runs, then the verdict across them (VERDICT)."""
    from megatron_fp8rl.report.study_verdict import arm_kind, write_verdict

    figures, kinds = {}, {}
    for name in V3_REGIMES:
        regime = REGIMES[name]
        study_dir = REPO / regime.study_dir
        figures[name] = _report(list(regime.arms), SEEDS, study_dir, _timings(study_dir), regime)
        kinds.update({arm.name: arm_kind(arm.overrides, FROZEN_NORMS + LOW_LR) for arm in regime.arms})
    about = " ".join(f"{name}: {REGIMES[name].about}" for name in V3_REGIMES)
    preamble = (f"From the committed runs of each regime ({about}) by `megatron-fp8rl stability --verdict` "
                "(bench/stability.py), which also rewrites each regime's report. Final held-out greedy accuracy, "
                "median [min, max] over seeds; paired McNemar on the same problems, pooled over the seeds both arms "
                "ran; s/step: the mean wall seconds of an RL step (rollout, recompute, train, sync; evals excluded) "
                "on the machine that ran it, every FP8 arm with its shadow forwards.")
    out = write_verdict(figures, kinds, REPO / VERDICT, default=RECIPES[0].name, references=(REFERENCE, HIGH_PRECISION),
                        remedies=REMEDIES, preamble=preamble)
    print(f"[stability] verdict: {out}")
    return 0


TIMINGS = "timings.json"
"""In a study directory: seconds each finished run took, by '<arm>/seed<k>' (what --hours and the reports read)."""


def _timings(study_dir: Path) -> dict[str, float]:
    """<study_dir>/TIMINGS ({} before the first run finished)."""
    path = study_dir / TIMINGS
    return json.loads(path.read_text()) if path.is_file() else {}


def _finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").is_file()


def hours_left(budget_hours: float | None, started: float, timings: dict[str, float]) -> bool:
    """Whether one more run fits the --hours budget counted from `started` (time.monotonic()), a
    run taking as long as the longest finished one (timings.json); no budget, or no run timed
    yet: True (the first run measures)."""
    if budget_hours is None or not timings:
        return True
    return time.monotonic() - started + max(timings.values()) <= budget_hours * 3600


def _train(plan: list[tuple[Setting, int]], study_dir: Path, model: Path, sizes: dict,
           args: argparse.Namespace, timings: dict[str, float], common: dict) -> list[str]:
    """Train the plan's unfinished runs one after another, each finished one's seconds added to
    `timings` and <study_dir>/TIMINGS; the labels of the runs that failed."""
    failed, started = [], time.monotonic()
    for number, (setting, seed) in enumerate(plan, 1):
        run_dir, label = run_dir_of(study_dir, setting, seed), f"{setting.name}/seed{seed}"
        command = train_command(setting, run_dir, model, sizes, args.set, args.nproc, seed, common)
        if _finished(run_dir) and not args.rerun:
            differs = config_differences(run_dir, command[command.index("train") + 1:])
            if not differs:
                print(f"[stability] {number}/{len(plan)} {label}: finished earlier, kept (--rerun trains it again)")
                continue
            print(f"[stability] {number}/{len(plan)} {label}: finished earlier with other settings "
                  f"({'; '.join(differs[:3])}), trained again")
        if not hours_left(args.hours, started, timings):
            print(f"[stability] {number}/{len(plan)} {label}: not started, it would end past --hours "
                  f"{args.hours:g} (a run takes up to {max(timings.values()) / 60:.0f} min); run the same "
                  "command again to go on")
            continue
        if run_dir.exists():  # an interrupted or failed attempt: start it over
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        print(f"[stability] {number}/{len(plan)} {label}: {' '.join(setting.overrides)}", flush=True)
        start = time.perf_counter()
        code = run_setting(command, run_dir / "train.log", args.timeout)
        seconds = time.perf_counter() - start
        print(f"[stability] {label}: exit {code} after {seconds:.0f} s", flush=True)
        if code != 0:
            failed.append(label)
            print((run_dir / "train.log").read_text()[-3000:], file=sys.stderr)
        else:
            timings[label] = seconds
            (study_dir / TIMINGS).write_text(json.dumps(timings, indent=2))
            if not args.keep_weights:
                prune_weights(run_dir)
    return failed


def _report(settings: list[Setting], seeds: tuple[int, ...], study_dir: Path, timings: dict[str, float],
            regime: Regime) -> dict:
    """report/ (the study report and each arm's first seed's per-run plots) of the finished runs;
    returns the figures it read, {arm: [RunFigures]} ({} without finished runs)."""
    finished = {s.name: {str(seed): run_dir_of(study_dir, s, seed) for seed in seeds
                         if _finished(run_dir_of(study_dir, s, seed))} for s in settings}
    finished = {name: dirs for name, dirs in finished.items() if dirs}
    if not finished:
        return {}
    # matplotlib: only when reporting
    from megatron_fp8rl.report.markdown import write_report
    from megatron_fp8rl.report.study_figures import arm_figures, kept_arms
    from megatron_fp8rl.report.study_report import write_study_report

    figures = arm_figures(finished)
    report = write_study_report(finished, study_dir / "report", REFERENCE, preamble(regime),
                                {k: v for k, v in timings.items() if k.split("/")[0] in finished},
                                also_against=(HIGH_PRECISION,), figures=figures)
    first = [dirs[min(dirs, key=int)] for dirs in finished.values() if dirs]
    names = [arm for arm, dirs in finished.items() if dirs]
    write_report(first, study_dir / "report" / "runs", title="FP8 stability study: each arm's first seed",
                 preamble="Per-run plots of every finished arm's first seed.", names=names)
    print(f"[stability] report: {report}")
    return kept_arms(figures)


def _model_path(model: Path) -> Path:
    """The HF checkpoint folder; the default SmolLM2 location is materialized on first use."""
    if (model / "config.json").is_file():
        return model.resolve()
    if model.resolve() != (REPO / ".cache" / "smollm2").resolve():
        raise FileNotFoundError(f"--model {model}: no config.json (not an HF checkpoint folder)")
    from megatron_fp8rl.convert.smollm2 import materialize_smollm2

    print(f"[stability] writing SmolLM2-135M-Instruct to {model} (once)")
    return materialize_smollm2(model).resolve()


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--regime", choices=sorted(REGIMES), default="harsh",
                        help="the job: harsh (study v2's), moderate2 / moderate4 (issue 44's, 2 or 4 mini-batches), "
                             "equivalence (issue 61's: moderate4, 500 fixed held-out problems, 6 seeds)")
    parser.add_argument("--study-dir", default=None,
                        help="<arm>/seed<k>/ run directories, timings.json, report/ (default: the regime's, "
                             + ", ".join(f"{r.name}: {r.study_dir}" for r in REGIMES.values()) + ")")
    parser.add_argument("--model", default=str(REPO / ".cache" / "smollm2"),
                        help="HF checkpoint (default: SmolLM2-135M-Instruct, materialized on first use)")
    parser.add_argument("--settings", default=None,
                        help="comma list of arm names (default: the regime's arms and --add ones); "
                             "names: " + ", ".join(s.name for s in study_settings()))
    parser.add_argument("--seeds", default=None,
                        help="comma list of train.seed values: each arm runs the first 1-6 of them (default: the "
                             f"regime's, {','.join(map(str, SEEDS))} but equivalence's 1-6)")
    parser.add_argument("--add", type=parse_added_setting, action="append", default=[],
                        help="extra setting NAME:key=value[,key=value...] (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="train override applied to every setting (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per setting")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for smoke tests")
    parser.add_argument("--rerun", action="store_true", help="train settings that already finished again")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep each finished run's checkpoints and weight folders, the trained HF model "
                             "included (default: removed, only the logs stay)")
    parser.add_argument("--nproc", type=int, default=1, help="torchrun processes per setting")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    parser.add_argument("--hours", type=float, default=None,
                        help="start no run that would end more than H hours after this command started "
                             "(a run counted as long as the longest in timings.json); run the same command "
                             "again to go on")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: the report of the runs finished so far, naming the missing ones")
    parser.add_argument("--verdict", action="store_true",
                        help=f"train nothing: every v3 regime's report and the verdict across them ({VERDICT})")
    parser.add_argument("--equivalence", action="store_true",
                        help="train nothing: the equivalence tables of the committed runs (issue 61's study, "
                             "results/equivalence/equivalence.md; study v3 re-analysed, results/stability_v3/equivalence.md)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_arguments(parser)
    args = parser.parse_args(argv)
    return run_study(args)
