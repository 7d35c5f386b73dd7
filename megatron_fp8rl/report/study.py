"""The FP8 stability study (issue 8): one RL job under several precision settings, then a report.

The same seed, data and sizes for every setting; each is a `megatron-fp8rl train` run under
torchrun into its own directory, one after another.

Owns: the settings table, the study's run sizes (full and --quick), running the settings one
after another, and its command line (`megatron-fp8rl stability`, `python bench/stability.py`).
Must not import: trainer code (runs are subprocesses; the report reads their logs).

"bf16" in a setting name means the high-precision dtype: model.dtype / rollout.dtype as the run
sets them, float32 unless `--set model.dtype=bfloat16 --set rollout.dtype=bfloat16` (Megatron bf16
mixed precision; real on both tiers).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setting:
    """One precision setting: a name (its run directory) and its `train` overrides."""

    name: str
    overrides: tuple[str, ...]


# (name, overrides) of trainer x rollout precision; every one runs with each CORRECTIONS entry.
# Add a row (or a correction) here to extend the study; --add does it from the command line.
PRECISIONS = (
    ("bf16_bf16", ("model.fp8=none", "rollout.fp8=none")),
    ("bf16_fp8block", ("model.fp8=none", "rollout.fp8=blockwise")),
    ("tedelayed_fp8block", ("model.fp8=te_delayed", "rollout.fp8=blockwise")),
    ("calibrated_aligned", ("model.fp8=calibrated", "rollout.fp8=aligned")),
)
CORRECTIONS = (("none", ("algorithm.correction=none",)), ("tis", ("algorithm.correction=tis",)))
# Run only when named in --settings: the noise-aware options (rl/noise.py) on the aligned setting.
OPTIONAL = (
    ("calibrated_aligned_bypass", ("model.fp8=calibrated", "rollout.fp8=aligned",
                                   "algorithm.old_policy=bypass", "algorithm.correction=none")),
    ("calibrated_aligned_noisetis", ("model.fp8=calibrated", "rollout.fp8=aligned",
                                     "algorithm.correction=tis", "algorithm.noise_correction=true")),
)

# The job every setting runs: 1-digit and 2-digit by 1-digit multiplication (the CPU demo's task
# until issue 19 moved it to add/mul), two optimizer steps per RL step, at lr 2e-5. Dynamic sampling is
# off so every setting trains on the same prompt stream (it draws extra prompts depending on
# rewards, which differ between settings). Sized for <= 60 minutes for all 8 settings on a quiet
# 2-core CPU with SmolLM2-135M. Measured (issue #8 note): 270 s for a float32 setting, ~405 s with
# blockwise FP8 rollouts, 397-485 s with an FP8 trainer; the 8 settings 3,339 s.
FULL = {"train.steps": 6, "data.prompts_per_step": 4, "rollout.n_samples": 8,
        "rollout.max_new_tokens": 24, "train.micro_batch_size": 8, "data.eval_size": 64,
        "train.eval_every": 3}
QUICK = {"train.steps": 2, "data.prompts_per_step": 2, "rollout.n_samples": 4,
         "rollout.max_new_tokens": 6, "train.micro_batch_size": 4, "data.eval_size": 8,
         "train.eval_every": 2}
COMMON = {"data.train": "builtin:arithmetic", "data.eval": "builtin:arithmetic",
          "data.arithmetic_ops": "[mul,mul2]", "data.train_size": "1000",
          "algorithm.dynamic_sampling": "false",
          "train.lr": "2e-5", "train.mini_batches": "2", "train.seed": "1234",
          "checkpoint.every": "0"}


def study_settings() -> list[Setting]:
    """The issue's settings: every precision with every correction, named `<precision>_<corr>`."""
    return [Setting(f"{precision}_{corr}", (*p_over, *c_over))
            for (precision, p_over), (corr, c_over) in product(PRECISIONS, CORRECTIONS)]


def parse_added_setting(spec: str) -> Setting:
    """'NAME:key=value,key=value' -> Setting (for --add)."""
    name, sep, body = spec.partition(":")
    overrides = tuple(item for item in body.split(",") if item)
    if not sep or not name or not all("=" in item for item in overrides):
        raise argparse.ArgumentTypeError(f"--add {spec!r}: expected NAME:key=value[,key=value...]")
    return Setting(name, overrides)


def select_settings(names: str | None, added: list[Setting]) -> list[Setting]:
    """The settings named in a comma list; when None, the issue's settings plus added ones."""
    if names is None:
        return [*study_settings(), *added]
    table = {s.name: s for s in [*study_settings(), *(Setting(n, o) for n, o in OPTIONAL), *added]}
    chosen = [n for n in names.split(",") if n]
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise ValueError(f"--settings: unknown {unknown}; known: {sorted(table)}")
    return [table[n] for n in chosen]


def train_command(setting: Setting, run_dir: Path, model: Path, sizes: dict, extra: list[str],
                  nproc: int) -> list[str]:
    """The torchrun command of one setting (later overrides win: sizes, setting, --set)."""
    from megatron_fp8rl.compat.tcp_store import free_port  # torch: not at `--help` time
    overrides = [f"{k}={v}" for k, v in {**COMMON, **sizes}.items()]
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


def _print_timings(timings: dict[str, float]) -> None:
    baseline_name = next(iter(timings))
    print(f"\n{'setting':<28} {'wall s':>8}  vs {baseline_name}")
    for name, seconds in timings.items():
        print(f"{name:<28} {seconds:8.1f}  {seconds / timings[baseline_name]:.2f}x")


PREAMBLE = ("The same RL job (seed, prompts, sizes) under each precision setting. `bf16` is the "
            "high-precision dtype: model.dtype/rollout.dtype of the runs (float32 unless set to "
            "bfloat16). Setting names: `<trainer>_<rollout>_<correction>`.")


def run_study(args: argparse.Namespace) -> int:
    """Train every selected setting not finished yet (summary.json present), then the report."""
    try:
        settings = select_settings(args.settings, args.add)
        model = _model_path(Path(args.model))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = dict(QUICK if args.quick else FULL)
    if args.steps:
        sizes["train.steps"] = args.steps
    study_dir = Path(args.study_dir)
    study_dir.mkdir(parents=True, exist_ok=True)
    timings, failed = {}, []
    for setting in settings:
        run_dir = study_dir / setting.name
        if (run_dir / "summary.json").is_file() and not args.rerun:
            print(f"[stability] {setting.name}: finished earlier, kept (--rerun trains it again)")
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        command = train_command(setting, run_dir, model, sizes, args.set, args.nproc)
        print(f"[stability] {setting.name}: {' '.join(setting.overrides)}", flush=True)
        start = time.perf_counter()
        code = run_setting(command, run_dir / "train.log", args.timeout)
        timings[setting.name] = time.perf_counter() - start
        print(f"[stability] {setting.name}: exit {code} after {timings[setting.name]:.0f} s", flush=True)
        if code != 0:
            failed.append(setting.name)
            print((run_dir / "train.log").read_text()[-3000:], file=sys.stderr)
    if timings:
        _print_timings(timings)
        (study_dir / "timings.json").write_text(json.dumps(timings, indent=2))
    finished = [study_dir / s.name for s in settings if (study_dir / s.name / "summary.json").is_file()]
    if finished:
        from megatron_fp8rl.report.markdown import write_report  # matplotlib: only when reporting

        report = write_report(finished, study_dir / "report", title="FP8 stability study",
                              preamble=PREAMBLE)
        print(f"[stability] report: {report}")
    if failed:
        print(f"[stability] failed settings: {failed} (logs: <study_dir>/<setting>/train.log)",
              file=sys.stderr)
    return 1 if failed else 0


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
    parser.add_argument("--study-dir", default="runs/stability", help="one run directory per setting, and report/")
    parser.add_argument("--model", default=str(REPO / ".cache" / "smollm2"),
                        help="HF checkpoint (default: SmolLM2-135M-Instruct, materialized on first use)")
    parser.add_argument("--settings", default=None,
                        help="comma list of setting names (default: the issue's 8 and --add ones); "
                             "names: " + ", ".join([s.name for s in study_settings()] + [n for n, _ in OPTIONAL]))
    parser.add_argument("--add", type=parse_added_setting, action="append", default=[],
                        help="extra setting NAME:key=value[,key=value...] (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="train override applied to every setting (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per setting")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for smoke tests")
    parser.add_argument("--rerun", action="store_true", help="train settings that already finished again")
    parser.add_argument("--nproc", type=int, default=1, help="torchrun processes per setting")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per setting before it is killed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_arguments(parser)
    return run_study(parser.parse_args(argv))
