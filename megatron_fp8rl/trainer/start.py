"""Everything a run does before its first step.

Owns: `check_inputs` (missing files, bad reward, an FP8 backend this process cannot run),
`training_records` / `held_out_records` (the prompts; the built-in held-out draw uses
data.eval_seed, so it is the same for every train.seed) and their disjointness check,
`plan_lines` (the plan on the console), `start_run` (run directory, actor, rollout checkpoint,
engine: the StepContext) and `prepare` (all of it in order).
Must not import: cli, trainer.loop.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

from megatron_fp8rl.config.loader import save_config
from megatron_fp8rl.data.records import DatasetError, PromptRecord, prompt_token_ids
from megatron_fp8rl.data.rewards import load_reward_fn
from megatron_fp8rl.data.splits import BUILTIN_ARITHMETIC, check_disjoint, load_records
from megatron_fp8rl.models.hf import check_fp8_backend
from megatron_fp8rl.rl.step_cost import dotted, step_passes, step_shape
from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.engines import start_engine
from megatron_fp8rl.trainer.evaluation import HeldOut
from megatron_fp8rl.trainer.objective import Objective
from megatron_fp8rl.trainer.reference import build_reference
from megatron_fp8rl.trainer.rl_step import StepContext, timed
from megatron_fp8rl.trainer.rollout_start import write_rollout_start
from megatron_fp8rl.trainer.run_dir import check_run_dir, claim_run_dir


def check_inputs(cfg: RunConfig) -> None:
    """Fail before any expensive work: missing checkpoint or dataset files, bad reward, an FP8
    backend this process cannot run."""
    check_fp8_backend(cfg.model.fp8, cfg.model.fp8_backend)
    hf = Path(cfg.model.hf_path)
    if not (hf / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path={hf}: no config.json (not an HF checkpoint folder)")
    for key, spec in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if not spec.startswith("builtin:") and not Path(spec).is_file():
            raise FileNotFoundError(f"{key}={spec}: file does not exist")
    load_reward_fn(cfg.data.reward)


def training_records(cfg: RunConfig) -> list[PromptRecord]:
    """The training prompts: data.train_size problems of the built-in train split drawn with
    train.seed, or every row of the data.train file."""
    data = cfg.data
    return _records(data.train, "train", data.train_size, "data.train_size", cfg.train.seed, cfg)


def held_out_records(cfg: RunConfig) -> list[PromptRecord]:
    """The held-out problems, fixed for every train.seed: data.eval_size of the built-in eval split
    drawn with data.eval_seed, or the first data.eval_size rows of the data.eval file."""
    data = cfg.data
    return _records(data.eval, "eval", data.eval_size, "data.eval_size", data.eval_seed, cfg)[:data.eval_size]


def _records(spec: str, split: str, count: int, count_key: str, seed: int, cfg: RunConfig) -> list[PromptRecord]:
    try:
        return load_records(spec, split, count, tuple(cfg.data.arithmetic_ops), seed, cfg.data.schema)
    except ValueError as error:
        if spec != BUILTIN_ARITHMETIC or isinstance(error, DatasetError):
            raise
        raise DatasetError(f"{count_key}={count}: {error}") from None


def run_records(cfg: RunConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training records, held-out records), checked to share no prompt (DatasetError naming the
    overlapping problems)."""
    train, held_out = training_records(cfg), held_out_records(cfg)
    check_disjoint(train, held_out, cfg.data.train, cfg.data.eval)
    return train, held_out


def prepare(cfg: RunConfig, rank: int) -> tuple[StepContext, object, list[PromptRecord], HeldOut]:
    """Checks, tokenizer, prompt records, the plan on the console, then `start_run`: (context,
    tokenizer, training records, held-out problems)."""
    from transformers import AutoTokenizer

    check_inputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    train_records, eval_records = run_records(cfg)
    if rank == 0:
        print("\n".join(plan_lines(cfg, len(train_records), len(eval_records))), flush=True)
    ctx = start_run(cfg, rank, tokenizer, train_records)
    held_out = HeldOut([prompt_token_ids(r, tokenizer) for r in eval_records], [r.answer for r in eval_records])
    return ctx, tokenizer, train_records, held_out


def plan_lines(cfg: RunConfig, train_size: int, eval_size: int) -> list[str]:
    """The run's plan for the console, before any slow work: model, task, steps, where logs go."""
    data, rollout, train_cfg, run_dir = cfg.data, cfg.rollout, cfg.train, Path(cfg.run_dir)
    task = (f"built-in arithmetic ({', '.join(data.arithmetic_ops)})" if data.train == BUILTIN_ARITHMETIC
            else data.train)
    interim = f" ({data.eval_interim_size} of them in between)" if data.eval_interim_size else ""
    evals = (f"greedy eval at the start, every {train_cfg.eval_every} steps and at the end{interim}"
             if train_cfg.eval_every else "no eval")
    return [f"model  {cfg.model.hf_path} (trainer FP8 {cfg.model.fp8}, rollout FP8 {rollout.fp8})",
            f"task   {task}: {train_size} training prompts, {eval_size} held out, reward {data.reward}",
            f"steps  {train_cfg.steps} x {data.prompts_per_step} prompts x {rollout.n_samples} samples "
            f"(<= {rollout.max_new_tokens} tokens), {cfg.algorithm.name}, lr {train_cfg.lr:g}; {evals}",
            f"logs   {run_dir / 'tb'} (tensorboard --logdir {run_dir / 'tb'}), "
            f"{run_dir / 'summary.json'}, trained model {run_dir / 'hf'}",
            "setup  converting the checkpoint, starting SGLang, the first eval (a few minutes on CPU)"]


def start_run(cfg: RunConfig, rank: int, tokenizer, train_records: list[PromptRecord]) -> StepContext:
    """All ranks: claim the run directory, convert the start checkpoint (once), build the actor
    (calibrated on the first training records where input scales are static), the reference policy
    (algorithm.kl on) and (rank 0) the rollout engine: what every `rl_step` uses. The caller shuts the engine down."""
    run_dir = Path(cfg.run_dir)
    cfg.checkpoint.dir = cfg.checkpoint.dir or str(run_dir / "checkpoints")
    provenance = check_run_dir(cfg)
    dist.barrier()
    if rank == 0:
        claim_run_dir(run_dir, provenance)
        save_config(cfg, run_dir / "config.yaml")
    timings: dict[str, float] = {}
    with timed(timings, "setup_convert"):
        convert_initial_checkpoint(Path(cfg.model.hf_path), run_dir / "init_megatron")
    with timed(timings, "setup_actor"):
        actor = MegatronActor(run_dir / "init_megatron", cfg.model, cfg.train,
                              Objective(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.trainer_fp8_gemm,
                              serving=cfg.fp8_plan,
                              calibration_dir=run_dir / "calibration" if cfg.algorithm.calibration.record else None)
    reference = None
    if cfg.algorithm.kl.enabled:  # off: no reference model is built
        with timed(timings, "setup_reference"):
            reference = build_reference(cfg.algorithm.kl, run_dir, actor, cfg.model, cfg.train.micro_batch_size,
                                        cfg.trainer_fp8_gemm)
    if cfg.fp8_plan.fp8:
        with timed(timings, "setup_rollout_checkpoint"):
            write_rollout_start(cfg, actor, tokenizer, train_records)
    engine = None
    with timed(timings, "setup_engine"):
        if rank == 0:
            engine = start_engine(cfg)
    return StepContext(cfg=cfg, actor=actor, engine=engine, reward_fn=load_reward_fn(cfg.data.reward),
                       decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), setup_timings=timings,
                       reference=reference)


def step_cost_metrics(cfg: RunConfig) -> dict[str, float]:
    """The run's extra passes per step beyond plain FP8's recompute + forward + backward
    (rl/step_cost.py; the same count the equivalence report puts beside accuracy), for tensorboard."""
    passes = step_passes(step_shape(dotted(dataclasses.asdict(cfg))))
    return {"cost/extra_forward": passes.extra_forward, "cost/extra_backward": passes.extra_backward,
            "cost/extra_share": passes.extra_share, "cost/monitor_forward": passes.monitor}
