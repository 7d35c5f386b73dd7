"""Calibrated Clipping on SmolLM2-135M: how much FP8 over-clips negative-advantage tokens before
and after calibration, and what a calibration step costs.

For each FP8 trainer recipe (groupwise32, the default, and calibrated, with aligned FP8 rollouts;
tensorwise, with blockwise FP8 rollouts), three `megatron-fp8rl train` runs with the same seed,
prompts and sizes (plain GRPO, 2 mini-batches per step, so the second mini-batch's ratio carries the
training forward's FP8 noise): `algorithm.calibration.mode=none`, `=shadow` with a calibration every
step, and `=gate` (the clip decided on the shadow's ratio, every step). Step 1 trains with the same
bounds in none and shadow (a calibration's bounds apply from the next step), so its train-phase time
is a like-for-like cost of the two shadow forwards; gate's step 1 is the cost of its shadow forwards
(log π_old of the whole batch, log π_θ of every later mini-batch), which it pays on every step.
Prints, per recipe:
- the diagnostic on each calibration (share of negative-advantage tokens clipped by the FP8 ratio
  and not by the high-precision shadow's), before (plain interval) and after (calibrated bounds);
- the calibration step's train-phase time and whole-step time as ratios to the plain run's step 1,
  and the average step at every=20: 1 + (calibrating train phase − plain train phase) / (20 · plain
  step). Only the train phase differs between the two runs (the shadow forwards run there); the
  whole-step ratio also carries the rollout phase's run-to-run noise on a shared machine;
- the gate run's step-1 train-phase and whole-step time as ratios to the plain run's.

    python bench/calibrated_clipping.py [--steps 1] [--recipes groupwise32,calibrated,tensorwise]
        [--out runs/bench_calibrated_clipping]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_fp8rl.study.runner import _model_path, run_setting  # noqa: E402
from megatron_fp8rl.report.study_figures import STEP_PHASES  # noqa: E402

RECIPES = {"groupwise32": ["model.fp8=groupwise32", "rollout.fp8=aligned"],
           "calibrated": ["model.fp8=calibrated", "rollout.fp8=aligned"],
           "tensorwise": ["model.fp8=tensorwise", "rollout.fp8=blockwise"]}
COMMON = ["algorithm.name=grpo", "algorithm.clip.high=0.2", "algorithm.correction=tis",
          "data.arithmetic_ops=[mul,mul2]", "data.train_size=1000", "data.prompts_per_step=4", "rollout.n_samples=8",
          "rollout.max_new_tokens=24", "train.mini_batches=2", "train.micro_batch_size=8",
          "train.lr=1e-5", "train.eval_every=0", "algorithm.max_sampling_rounds=2"]


def _run(name: str, overrides: list[str], out: Path, model: Path, steps: int) -> dict[str, list[float]]:
    run_dir = out / name
    if not (run_dir / "summary.json").is_file():
        from megatron_fp8rl.compat.tcp_store import free_port

        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--module",
                   "megatron_fp8rl.cli", "train", f"model.hf_path={model}", f"run_dir={run_dir}",
                   f"train.steps={steps}", *COMMON, *overrides]
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"[bench] {name}: {' '.join(command[8:])}", flush=True)
        code = run_setting(command, run_dir.parent / f"{name}.log", timeout_s=3600)
        if code != 0:
            raise SystemExit(f"[bench] {name} failed (exit {code}); see {run_dir.parent / f'{name}.log'}")
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _step_time(scalars: dict[str, list[float]], index: int) -> float:
    return sum(scalars[phase][index] for phase in STEP_PHASES if phase in scalars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_calibrated_clipping")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    model = _model_path(REPO / ".cache" / "smollm2")  # materialized on first use
    rows = []
    for recipe in args.recipes.split(","):
        plain = _run(f"{recipe}_plain", RECIPES[recipe], args.out, model, args.steps)
        shadow = _run(f"{recipe}_shadow", [*RECIPES[recipe], "algorithm.calibration.mode=shadow",
                                           "algorithm.calibration.every=1"], args.out, model, args.steps)
        gate = _run(f"{recipe}_gate", [*RECIPES[recipe], "algorithm.calibration.mode=gate",
                                       "algorithm.calibration.every=1"], args.out, model, args.steps)
        train_ratio = shadow["time/train_s"][0] / plain["time/train_s"][0]
        step_ratio = _step_time(shadow, 0) / _step_time(plain, 0)
        rows.append((recipe, shadow.get("clip/neg_overclip_before", []), shadow.get("clip/neg_overclip_after", []),
                     shadow["clip/low"], shadow["clip/high"], plain.get("train/clip_frac_low", []),
                     train_ratio, step_ratio,
                     1 + (shadow["time/train_s"][0] - plain["time/train_s"][0]) / (20 * _step_time(plain, 0)),
                     gate["time/train_s"][0] / plain["time/train_s"][0], _step_time(gate, 0) / _step_time(plain, 0)))
    print("\n| recipe | neg over-clipped before (per calibration) | after | bounds [L, H] per step "
          "| plain run clip_frac_low | calibrating train phase / plain | calibrating step / plain "
          "| avg step at every=20 / plain | gate train phase / plain | gate step / plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda values: ", ".join(f"{v:.4f}" for v in values)  # noqa: E731
    for recipe, before, after, low, high, plain_low, train_ratio, step_ratio, every20, gate_train, gate_step in rows:
        bounds = ", ".join(f"[{lo:.3f}, {hi:.3f}]" for lo, hi in zip(low, high))
        print(f"| {recipe} | {fmt(before)} | {fmt(after)} | {bounds} | {fmt(plain_low)} | {train_ratio:.2f}x "
              f"| {step_ratio:.2f}x | {every20:.3f}x | {gate_train:.2f}x | {gate_step:.2f}x |")


if __name__ == "__main__":
    main()
