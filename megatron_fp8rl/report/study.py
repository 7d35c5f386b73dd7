"""The FP8 stability study (v2: issue 23; v3: issue 44): one RL job under several precision arms and
seeds, in one of three regimes, then the report (report/study_report.py).

Owns: the regimes and their arms, the study's run sizes (full and --quick), running every arm x seed not
finished yet one after another, and its command line (`megatron-fp8rl stability`, `python
bench/stability.py`). Must not import: trainer code (runs are subprocesses; the report reads
their logs).

Regimes (issue 44): `harsh` is v2's job (2 prompts x 8 samples, lr 3e-5, results/stability, its
finished runs reused); `moderate2` / `moderate4` the issue's moderate job (8 x 8 at temperature 1,
20 tokens, lr 1e-5, 12 steps, eval every 4 on 100 held-out problems) with 2 or 4 mini-batches
(results/stability_v3/<regime>). v3 adds, in every regime, the project's default (`groupwise32`:
1x32 groups, aligned rollouts), its CC arm and remedies: `groupwise32_gate` (the configured bounds
with each token's clip decision taken on the high-precision shadow's ratio,
algorithm.calibration.mode=gate, so FP8 over-clips nothing by construction, for a shadow forward of
every mini-batch), `groupwise32_bf16` (the default FP8 recipe on a bf16 mixed-precision trainer: FP8
GEMMs, bf16 elsewhere, aligned rollouts served in bf16) and, in the moderate regimes, where plain CC
saturates, `groupwise32_cc_noise` (CC whose lower bound follows the noise rule,
algorithm.calibration.rule=noise, so it calibrates where the α-quantile falls below any sane floor).
An arm trains under the first `seeds` of --seeds: 3 for bf16, the default, its CC arm, the gate and
the noise rule, and for `float32` (no FP8, no bf16), the second reference; 2 for the others
(groupwise32_bf16: 3 in harsh, where it is the remedy aimed at); 1 for v2's extra arms. Harsh adds
probes of why bf16 survives its lr (the normalization gains frozen; a third of the learning rate) and
the bf16-trainer remedy with the gate and with TIS, 2 seeds each. The report's preamble lists every
arm with its seeds (`preamble`).

The arms (issue 23): the bf16 reference (real Megatron bf16 mixed precision, bf16 SGLang), a bf16
trainer with blockwise FP8 rollouts and TIS, and three unified FP8 pipelines (old and current
logprobs both FP8: tensorwise per-tensor current scaling, 128x128 blockwise, our calibrated recipe
with aligned rollouts), each plain and with Calibrated Clipping (`_cc`), and our noise-aware
clipping (old_policy=bypass: the clip interval widened by the measured train/rollout noise) on
tensorwise, the arm the paper finds worst. Every arm runs the shadow forwards every step: the
plain arms with calibration.mode=monitor (measured, bounds unchanged), the `_cc` arms with shadow
(applied), so the paper's diagnostic comes from every arm; the bf16 arms' shadow is their float32
forward (models/shadow.py), so their diagnostic is what bf16 itself over-clips. The FP8 arms keep
float32 outside the FP8 GEMMs (model.dtype; groupwise32_bf16 excepted): aligned rollouts are bit-identical only there
(README), and the shadow is then a float32 forward.
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
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from megatron_fp8rl.config.renamed import OLD_KEYS

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setting:
    """One arm: a name (its directory), its `train` overrides, under how many of the --seeds seeds it
    trains (the first ones), and what it is in a few words (the report's preamble)."""

    name: str
    overrides: tuple[str, ...]
    seeds: int = 2
    about: str = ""


BF16 = ("model.dtype=bfloat16", "rollout.dtype=bfloat16")
MONITOR = ("algorithm.calibration.mode=monitor", "algorithm.calibration.every=1", "algorithm.calibration.record=true")
CALIBRATED = ("algorithm.calibration.mode=shadow", "algorithm.calibration.every=1", "algorithm.calibration.record=true")
GATED = ("algorithm.calibration.mode=gate", "algorithm.calibration.every=1", "algorithm.calibration.record=true")
UNIFIED = {"tensorwise": ("model.fp8=tensorwise", "rollout.fp8=per_tensor"),
           "blockwise": ("model.fp8=blockwise", "rollout.fp8=blockwise"),
           "aligned": ("model.fp8=calibrated", "rollout.fp8=aligned")}
DEFAULT = ("model.fp8=groupwise32", "rollout.fp8=aligned")
"""The project's default FP8 pipeline (examples/cpu_demo.yaml)."""
REFERENCE = "bf16"
"""The arm every other is compared with (paired tests on the same held-out problems and seed)."""
HIGH_PRECISION = "float32"
"""The second reference: the same job with no FP8 and no bf16 anywhere (float32 Megatron, float32
SGLang). Every arm is also compared with it, so a report can tell an FP8 arm that beats bf16 from a
bf16 reference that falls short of full precision (moderate2's bf16 arm learned less than the FP8
arms and rambled to the length limit, results/stability_v3/moderate2/report)."""
FLOAT32_ARM = Setting(HIGH_PRECISION, ("model.dtype=float32", "rollout.dtype=float32", "model.fp8=none",
                                       "rollout.fp8=none"), seeds=3,
                      about="no FP8, no bf16: float32 Megatron and SGLang, no shadow; the second reference "
                            "every arm is compared with")
"""No shadow forward (calibration off): a float32 trainer has no higher precision to compare with, so
this arm has no over-clip diagnostic."""
BF16_ARM = Setting(REFERENCE, (*BF16, "model.fp8=none", "rollout.fp8=none", *MONITOR), seeds=3,
                   about="the reference: Megatron bf16 mixed precision, bf16 SGLang")
BF16_OUTSIDE_GEMMS = Setting("groupwise32_bf16", (*BF16, *DEFAULT, *MONITOR), seeds=3,
                             about="the default FP8 recipe on a bf16 trainer, aligned rollouts served in bf16; "
                                   "its shadow is the bf16 forward")
"""A remedy aimed at what harsh's probes found (issue 44's "quantizing the rollout's FP8 from the
bf16-rounded weights"): the default FP8 recipe on a Megatron bf16 mixed-precision trainer (model.dtype=
bfloat16: FP8 GEMMs, bf16 everywhere else, the usual Transformer Engine setup), aligned rollouts served
in bf16. bf16 survives lr 3e-5 where float32 and the float32-outside-GEMM FP8 arms fall, and the low-lr
probes say it is because bf16's forward sees only part of each update; here the FP8 linears quantize
the bf16-rounded weights, so FP8's forward sees what bf16's does. The price: aligned rollouts are not
bit-identical in bf16 (SGLang's bf16 attention and norms differ from the trainer's; README), and the
monitor's shadow is the bf16 forward (the FP8 linears computed in their weights' dtype), so its
diagnostic measures FP8 against bf16, not float32. It changes the precision, not the job: it answers the
harsh target at lr 3e-5, and moderate2's runs say what it costs where plain FP8 already matches bf16
(2 seeds there: the issue's count for an arm that is neither the reference, the default nor its CC arm;
harsh runs 3). Not in moderate4: moderate2 answered that question (below plain groupwise32 on the same
seeds, +25/-45, p = 0.022, its answers cut at the length limit as often as bf16's), moderate4 changes only
the number of mini-batches, and its two runs (~45 minutes on the 2-core box) are spent on the issue's
own arms instead."""
NOISE_RULE = Setting("groupwise32_cc_noise", (*DEFAULT, *CALIBRATED, "algorithm.calibration.rule=noise"), seeds=3,
                     about="CC with the noise rule")
"""Moderate only: CC whose lower bound follows the noise rule where the α-quantile would sit at its floor
(issue 44's item 3, where moderate's plain CC saturates). Not in harsh: there plain CC's L sits at a
limit on a median 3.3% [0.0%, 63.3%] of steps (the study report's CC line, seeds 1-3), and the
default's CC arm falls on every seed whether its L saturates or not (0.062 [0.047, 0.062] against
bf16's 0.484), so the rule has little to change and nothing a run there could show it rescue."""
RECIPES = (
    Setting("groupwise32", (*DEFAULT, *MONITOR), seeds=3, about="the default: 1x32 groups, aligned rollouts"),
    Setting("groupwise32_cc", (*DEFAULT, *CALIBRATED), seeds=3, about="the default with CC"),
)
UNIFIED_ARMS = (
    Setting("tensorwise", (*UNIFIED["tensorwise"], *MONITOR), about="per-tensor scaling, per-tensor FP8 rollouts"),
    Setting("blockwise", (*UNIFIED["blockwise"], *MONITOR), about="128x128 blocks, blockwise FP8 rollouts"),
    *(Setting(f"{name}_cc", (*UNIFIED[name], *CALIBRATED), about="with CC") for name in ("tensorwise", "blockwise")),
)
GATE = Setting("groupwise32_gate", (*DEFAULT, *GATED), seeds=3, about="the clip decided on the shadow's ratio")
HARSH_CORE_ARMS = (BF16_ARM, *RECIPES, GATE, BF16_OUTSIDE_GEMMS, *UNIFIED_ARMS)
MODERATE_CORE_ARMS = {2: (BF16_ARM, *RECIPES, NOISE_RULE, GATE, replace(BF16_OUTSIDE_GEMMS, seeds=2), *UNIFIED_ARMS),
                      4: (BF16_ARM, *RECIPES, NOISE_RULE, GATE, *UNIFIED_ARMS)}
"""v3's arms in each regime (moderate: by number of mini-batches)."""
V2_EXTRA_ARMS = (
    Setting("bf16_fp8block_tis", ("model.dtype=bfloat16", "model.fp8=none", "rollout.fp8=blockwise",
                                  "algorithm.correction=tis", *MONITOR), seeds=1,
            about="bf16 trainer, blockwise FP8 SGLang rollouts, TIS"),
    Setting("aligned", (*UNIFIED["aligned"], *MONITOR), seeds=1, about="v2's calibrated recipe, aligned rollouts"),
    Setting("aligned_cc", (*UNIFIED["aligned"], *CALIBRATED), seeds=1, about="with CC"),
    Setting("tensorwise_noise", (*UNIFIED["tensorwise"], *MONITOR, "algorithm.old_policy=bypass",
                                 "algorithm.correction=none"), seeds=1,
            about="noise-aware clipping, old_policy=bypass"),
)
"""v2's other arms (the harsh regime only, where their runs are committed)."""
FROZEN_NORMS = ("train.norm_lr_mult=0",)
LOW_LR = ("train.lr=1e-5",)
BF16_GATE = Setting("groupwise32_bf16_gate", (*BF16, *DEFAULT, *GATED), about="groupwise32_bf16 with the gate")
"""Harsh only, 2 seeds: the two remedies together, groupwise32_bf16's bf16 trainer with the gate's clip
decisions on the shadow's ratio (here the bf16 forward). In harsh groupwise32_bf16 fell far less than
the float32-outside FP8 arms (0.297 [0.281, 0.547] against groupwise32's 0.109, +60/-4 on the same
seeds) yet two of its three seeds ended at the length limit (one after learning), with 3.6-5.7% of A<0
tokens over-clipped against its bf16 shadow; the gate removes that over-clipping by construction."""
BF16_TIS = Setting("groupwise32_bf16_tis", (*BF16, *DEFAULT, *MONITOR, "algorithm.correction=tis"),
                   about="groupwise32_bf16 with TIS")
"""Harsh only, 2 seeds: groupwise32_bf16 with truncated importance sampling (TIS, cap 2) against the
rollout/trainer mismatch, nothing else changed. Two things still separate groupwise32_bf16 from bf16 in
harsh: FP8's quantization noise in the GEMMs, and a rollout that is no longer bit-identical to the trainer
(aligned FP8 rollouts served in bf16): train/mismatch_abs_logprob_diff_mean averaged 0.037-0.064 a token
per seed there against bf16's 0.015-0.017 (the mean over steps of each committed run's tensorboard log, the
study report's mismatch figure). The harsh job runs no rollout correction; this arm reweights each token
by its capped rollout/trainer ratio. It reweights the mismatch, it does not remove it, so it can show
that TIS repairs the gap, not that the mismatch is innocent (seeds 1-2: no different from
groupwise32_bf16 on the same seeds, README)."""
PROBE_ARMS = (
    *(Setting(f"{base}_frozen_norms", overrides + FROZEN_NORMS,
              about="the normalization gains frozen, train.norm_lr_mult=0; bf16's rounding hides their early updates")
      for base, overrides in (("float32", FLOAT32_ARM.overrides), ("groupwise32", (*DEFAULT, *MONITOR)))),
    *(Setting(f"{base}_low_lr", overrides + LOW_LR, about="at lr 1e-5: is harsh's lr the cause? does FP8 then match bf16?")
      for base, overrides in (("float32", FLOAT32_ARM.overrides), ("bf16", BF16_ARM.overrides),
                              ("groupwise32", (*DEFAULT, *MONITOR)), ("groupwise32_gate", (*DEFAULT, *GATED)))),
)
"""Harsh only: probes of why bf16 beats float32 there, two with the normalization gains frozen
(train.norm_lr_mult=0) and four at a third of the learning rate. In the harsh job bf16 seed 1
learned (0.594) where float32 and every groupwise32 arm fell (0.062-0.359). Megatron bf16 hides a
gain's update from its forward until it adds up to half a bf16 spacing (the gains sit on the bf16
grid; bench/bf16_update_visibility.py --lr 3e-5 --steps 1,10,60: 0.5% / 11% / 96% of them moved
after 1 / 10 / 60 same-sign updates, results/bf16_update_visibility/smollm2_harsh.txt), so bf16
trains them late and little. The first two arms ask whether the gains' updates are what brings the
float32 and FP8 runs down, with the choice made explicit. Freezing them did not rescue float32 on
seed 1 (0.156), so `float32_low_lr` asks the wider question: bf16 hides most of every early update
(the same bench: 8-10% of the linears' weights moved after one update, 15% of the embeddings), so it
trains as if at a smaller learning rate; is harsh's lr 3e-5 simply too high for a run that sees
every update? float32 at lr 1e-5 (the moderate job's), nothing else changed. It beat bf16 (0.625 vs
0.484, seeds 1-2), so the last three ask whether FP8 does too at that lr, against a bf16 reference
at the same lr: `bf16_low_lr`, `groupwise32_low_lr` (the default) and `groupwise32_gate_low_lr`. A
probe changes the job, so it answers why, not the issue's harsh target (which is at lr 3e-5)."""

# The job every arm runs: the CPU demo's task (2-digit addition, 1-digit multiplication) and
# sampling temperature, two mini-batches per step (so the clip bounds act on a moved policy), and
# dynamic sampling off (every arm trains on the same prompt stream; it draws extra prompts
# depending on rewards, which differ between arms); plain GRPO with no rollout correction except
# on the arm that names TIS (the arms: unified FP8 takes both logprobs from the trainer).
# Sizes: 2 prompts x 8 samples a step, 64 held-out problems at the start and the end. Measured on
# a quiet 2-core box (2026-12-03): tensorwise 1226 s a run, blockwise 1599 s, aligned 1744 s (a
# test suite ran beside it for 10 of its minutes), a step 32-45 s (rollout 8-11, recompute 6-9,
# train 17-24); the twelve of results/stability took 875-2472 s each, 5.0 hours in all
# (timings.json), over the 3: split across invocations (a finished run is kept) or
# shorten with --steps.
FULL = {"train.steps": 30, "data.prompts_per_step": 2, "rollout.n_samples": 8,
        "rollout.max_new_tokens": 16, "train.micro_batch_size": 8, "train.mini_batches": 2,
        "data.eval_size": 64, "train.eval_every": 30}
QUICK = {"train.steps": 2, "data.prompts_per_step": 2, "rollout.n_samples": 4,
         "rollout.max_new_tokens": 6, "train.micro_batch_size": 4, "train.mini_batches": 2,
         "data.eval_size": 8, "train.eval_every": 2}
COMMON = {"data.train": "builtin:arithmetic", "data.eval": "builtin:arithmetic",
          "data.arithmetic_ops": "[add,mul]", "data.train_size": "1000", "rollout.temperature": "0.7",
          "algorithm.dynamic_sampling": "false",
          "algorithm.name": "grpo", "algorithm.correction": "none", "algorithm.agg_mode": "seq-mean-token-mean",
          "train.lr": "3e-5", "checkpoint.every": "0"}
SEEDS = (1, 2, 3)
MODERATE_COMMON = {**COMMON, "rollout.temperature": "1.0", "train.lr": "1e-5", "algorithm.clip.low": "0.2",
                   "algorithm.clip.high": "0.2", "train.weight_decay": "0.0"}
"""Issue 44's moderate job: plain GRPO, clip 0.2/0.2, temperature 1, lr 1e-5, no weight decay."""
MODERATE = {"train.steps": 12, "data.prompts_per_step": 8, "rollout.n_samples": 8, "rollout.max_new_tokens": 20,
            "train.micro_batch_size": 16, "train.mini_batches": 2, "data.eval_size": 100, "train.eval_every": 4}


@dataclass(frozen=True)
class Regime:
    """A study's job: its shared overrides and run sizes, where its runs go, and its arms."""

    name: str
    common: dict
    sizes: dict
    study_dir: str
    arms: tuple[Setting, ...]
    about: str


REGIMES = {
    "harsh": Regime("harsh", COMMON, FULL, "results/stability",
                    (*HARSH_CORE_ARMS, BF16_GATE, BF16_TIS, *V2_EXTRA_ARMS, *PROBE_ARMS, FLOAT32_ARM),
                    "Harsh regime (study v2's job): 2 prompts x 8 samples at temperature 0.7, 16 tokens, "
                    "lr 3e-5, 2 mini-batches, 30 steps, 64 held-out problems."),
    **{f"moderate{m}": Regime(f"moderate{m}", MODERATE_COMMON, {**MODERATE, "train.mini_batches": m},
                              f"results/stability_v3/moderate{m}", (*MODERATE_CORE_ARMS[m], FLOAT32_ARM),
                              f"Moderate regime, {m} mini-batches: 8 prompts x 8 samples at temperature 1.0, "
                              "20 tokens, lr 1e-5, clip 0.2/0.2, 12 steps, 100 held-out problems (eval every 4).")
       for m in (2, 4)},
}


def study_settings(regime: str = "harsh") -> list[Setting]:
    """The regime's arms, in report order."""
    return list(REGIMES[regime].arms)


def parse_added_setting(spec: str) -> Setting:
    """'NAME:key=value,key=value' -> Setting (for --add)."""
    name, sep, body = spec.partition(":")
    overrides = tuple(item for item in body.split(",") if item)
    if not sep or not name or not all("=" in item for item in overrides):
        raise argparse.ArgumentTypeError(f"--add {spec!r}: expected NAME:key=value[,key=value...]")
    return Setting(name, overrides)


def select_settings(names: str | None, added: list[Setting], regime: str = "harsh") -> list[Setting]:
    """The settings named in a comma list; when None, the regime's arms plus added ones."""
    if names is None:
        return [*study_settings(regime), *added]
    table = {s.name: s for s in [*study_settings(regime), *added]}
    chosen = [n for n in names.split(",") if n]
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise ValueError(f"--settings: unknown {unknown}; known: {sorted(table)}")
    return [table[n] for n in chosen]


def runs_of(settings: list[Setting], seeds: tuple[int, ...]) -> list[tuple[Setting, int]]:
    """(arm, seed) pairs to train: each arm under the first `arm.seeds` seeds; seed by seed, so a
    study cut short has every arm's first seed."""
    return [(s, seed) for i, seed in enumerate(seeds) for s in settings if i < s.seeds]


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


def preamble(regime: Regime) -> str:
    """The report's preamble: the job, and the regime's arms grouped by how many seeds they run, each
    with its `about` (consecutive arms that share one are named together), from the settings
    themselves so it cannot drift from them."""
    groups = []
    for seeds in sorted({arm.seeds for arm in regime.arms}, reverse=True):
        runs = []  # [names, about] for consecutive arms with the same about
        for arm in (a for a in regime.arms if a.seeds == seeds):
            if runs and runs[-1][1] == arm.about:
                runs[-1][0].append(arm.name)
            else:
                runs.append([[arm.name], arm.about])
        named = [_and(names) + (f" ({about})" if about else "") for names, about in runs]
        groups.append(f"{'seed 1' if seeds == 1 else f'seeds 1-{seeds}'}: " + "; ".join(named))
    groups[0] = groups[0][0].upper() + groups[0][1:]
    return (f"{regime.about} The same RL job (task, sizes, prompt stream per seed) under each arm; FP8 arms keep "
            "float32 outside the FP8 GEMMs (the `_bf16` arms: bf16), the bf16 arms run Megatron bf16 mixed "
            "precision and bf16 SGLang. " + "; ".join(groups)
            + f". Command: `megatron-fp8rl stability --regime {regime.name}` (bench/stability.py); per-run plots "
            "in runs/.")


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


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
    then the report of every finished run (--report-only: the report alone)."""
    regime = REGIMES[args.regime]
    try:
        settings = select_settings(args.settings, args.add, regime.name)
        seeds = tuple(int(s) for s in args.seeds.split(",") if s)
        model = None if args.report_only else _model_path(Path(args.model))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = dict(QUICK if args.quick else regime.sizes)
    if args.steps:
        sizes["train.steps"] = args.steps
    study_dir = Path(args.study_dir or REPO / regime.study_dir)
    study_dir.mkdir(parents=True, exist_ok=True)
    timings_path = study_dir / "timings.json"
    timings = _timings(study_dir)
    plan = runs_of(settings, seeds)
    failed = [] if args.report_only else _train(plan, study_dir, model, sizes, args, timings, timings_path,
                                                regime.common)
    missing = [f"{s.name}/seed{seed}" for s, seed in plan if not _finished(run_dir_of(study_dir, s, seed))]
    print(f"[stability] {len(plan) - len(missing)} of {len(plan)} runs finished"
          + (f"; missing: {', '.join(missing)}" if missing else ""), flush=True)
    # the report covers every finished run of the regime (its arms, --add ones, every seed), not only
    # what this invocation selected: `--settings x` must not shrink the committed report to x
    reported = list({s.name: s for s in [*study_settings(regime.name), *args.add, *settings]}.values())
    _report(reported, tuple(sorted({*SEEDS, *seeds})), study_dir, timings, regime)
    if failed:
        print(f"[stability] failed runs: {failed} (logs: <study_dir>/<arm>/seed<k>/train.log)", file=sys.stderr)
    return 1 if failed else 0


VERDICT = "results/stability_v3/verdict.md"
"""Where --verdict writes the verdict across the regimes (README's verdict quotes it)."""
REMEDIES = (("groupwise32", "groupwise32_gate"), ("groupwise32", "groupwise32_cc"),
            ("groupwise32_cc", "groupwise32_cc_noise"), ("tensorwise", "tensorwise_cc"), ("blockwise", "blockwise_cc"),
            ("groupwise32", "groupwise32_bf16"))
"""(arm, the arm that remedies it) pairs the verdict tests on the same seeds, per regime and pooled."""


def run_verdict() -> int:
    """Every regime's report of its committed runs, then the verdict across them (VERDICT)."""
    from megatron_fp8rl.report.study_verdict import arm_kind, write_verdict

    figures, kinds = {}, {}
    for name, regime in REGIMES.items():
        study_dir = REPO / regime.study_dir
        figures[name] = _report(list(regime.arms), SEEDS, study_dir, _timings(study_dir), regime)
        kinds.update({arm.name: arm_kind(arm.overrides, FROZEN_NORMS + LOW_LR) for arm in regime.arms})
    about = " ".join(f"{name}: {regime.about}" for name, regime in REGIMES.items())
    preamble = (f"From the committed runs of each regime ({about}) by `megatron-fp8rl stability --verdict` "
                "(bench/stability.py), which also rewrites each regime's report. Final held-out greedy accuracy, "
                "median [min, max] over seeds; paired McNemar on the same problems, pooled over the seeds both arms "
                "ran; s/step: the mean wall seconds of an RL step (rollout, recompute, train, sync; evals excluded) "
                "on the machine that ran it, every FP8 arm with its shadow forwards.")
    out = write_verdict(figures, kinds, REPO / VERDICT, default=RECIPES[0].name, references=(REFERENCE, HIGH_PRECISION),
                        remedies=REMEDIES, preamble=preamble)
    print(f"[stability] verdict: {out}")
    return 0


def _timings(study_dir: Path) -> dict[str, float]:
    """<study_dir>/timings.json: seconds each run took, by '<arm>/seed<k>' ({} before the first)."""
    path = study_dir / "timings.json"
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
           args: argparse.Namespace, timings: dict[str, float], timings_path: Path, common: dict) -> list[str]:
    """Train the plan's unfinished runs one after another; the labels of the runs that failed."""
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
            timings_path.write_text(json.dumps(timings, indent=2))
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
                        help="the job: harsh (study v2's), moderate2 / moderate4 (issue 44's, 2 or 4 mini-batches)")
    parser.add_argument("--study-dir", default=None,
                        help="<arm>/seed<k>/ run directories, timings.json, report/ (default: the regime's, "
                             + ", ".join(f"{r.name}: {r.study_dir}" for r in REGIMES.values()) + ")")
    parser.add_argument("--model", default=str(REPO / ".cache" / "smollm2"),
                        help="HF checkpoint (default: SmolLM2-135M-Instruct, materialized on first use)")
    parser.add_argument("--settings", default=None,
                        help="comma list of arm names (default: the regime's arms and --add ones); "
                             "names: " + ", ".join(s.name for s in study_settings()))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                        help="comma list of train.seed values: each arm runs the first 1-3 of them")
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
                        help=f"train nothing: every regime's report and the verdict across them ({VERDICT})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_arguments(parser)
    args = parser.parse_args(argv)
    return run_verdict() if args.verdict else run_study(args)
