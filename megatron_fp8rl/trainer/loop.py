"""`megatron-fp8rl train`: the run from an HF checkpoint to an RL-trained HF checkpoint.

Owns: wiring (config -> data, actor, rollout engine), the step loop (`train`) with greedy
evaluation, tensorboard logging, checkpoints/resume, stopping when told (trainer/stop.py), and the
final HF export. The step itself is rl_step.rl_step, fed by `prompt_batches`. Must not import: cli.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from megatron_fp8rl.config.loader import save_config
from megatron_fp8rl.convert.integrity import write_manifest
from megatron_fp8rl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.data.arithmetic import arithmetic_records
from megatron_fp8rl.data.records import DatasetError, PromptRecord, load_prompt_file, prompt_token_ids
from megatron_fp8rl.data.rewards import load_reward_fn, score
from megatron_fp8rl.data.sampler import PromptSampler
from megatron_fp8rl.models.hf import check_fp8_backend
from megatron_fp8rl.rl.metrics import paired_eval_change
from megatron_fp8rl.rollout.engine import SamplingParams
from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
from megatron_fp8rl.trainer.checkpoint import load_checkpoint, newest_intact_checkpoint, save_checkpoint
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.fp8_observation import calibration_forward
from megatron_fp8rl.trainer.objective import Objective
from megatron_fp8rl.trainer.rl_step import Prompts, StepContext, rl_step, sync_weights, timed
from megatron_fp8rl.trainer.rollout_fp8 import ROLLOUT_CHECKPOINT
from megatron_fp8rl.trainer.run_dir import check_run_dir, claim_run_dir
from megatron_fp8rl.trainer.stop import StopRequested, StopSignals


def load_records(spec: str, split: str, size: int, cfg: RunConfig) -> list[PromptRecord]:
    """Prompt records of a file, or of the built-in arithmetic task's `split`."""
    if spec == "builtin:arithmetic":
        return arithmetic_records(split, size, ops=tuple(cfg.data.arithmetic_ops), seed=cfg.train.seed)
    if spec.startswith("builtin:"):
        raise DatasetError(f"unknown built-in dataset {spec!r}; available: builtin:arithmetic")
    return load_prompt_file(spec, cfg.data.schema)


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


def _start_engine(cfg: RunConfig):
    """Rank 0: the rollout engine, serving from the first rollout on what every weight sync will
    send (`_rollout_model_path`)."""
    from megatron_fp8rl.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(_sglang_config(cfg), bucket_mb=cfg.rollout.bucket_mb)


def _sglang_config(cfg: RunConfig):
    """The rollout section (an SGLangSettings) serving this run's checkpoint, seeded with train.seed."""
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig

    return SGLangConfig.serving(cfg.rollout, _rollout_model_path(cfg), random_seed=cfg.train.seed)


def _rollout_model_path(cfg: RunConfig) -> Path:
    """The checkpoint the rollout engine or server starts from: the HF checkpoint
    (rollout.fp8=none) or the FP8 one `_write_rollout_start` made from the actor."""
    if not cfg.fp8_plan.fp8:
        return Path(cfg.model.hf_path)
    return Path(cfg.run_dir) / ROLLOUT_CHECKPOINT


def _write_rollout_start(cfg: RunConfig, actor: MegatronActor, tokenizer,
                         train_records: list[PromptRecord]) -> None:
    """All ranks (collective), rollout.fp8 != none: the FP8 checkpoint the rollout engine starts
    from, made from the actor itself: for static input scales (aligned with a shared-scale
    recipe, or per_tensor static) one calibration forward over the first 16 training prompts
    first (the recipe's own rule picks the served scales; per_tensor static takes the max |input|
    of each linear), then the actor's `publisher.publish` stream, the one every sync sends,
    written by rank 0 (trainer/rollout_fp8.write_rollout_checkpoint). No other model is built and
    no checkpoint is read."""
    from megatron_fp8rl.trainer.rollout_fp8 import write_rollout_checkpoint

    rollout = cfg.rollout
    bounds = None
    if cfg.fp8_plan.needs_calibration(rollout.activation_scheme):
        bounds = calibration_forward(actor, [prompt_token_ids(r, tokenizer) for r in train_records[:16]])
    actor.publisher.publish(
        lambda tensors: write_rollout_checkpoint(tensors, Path(cfg.model.hf_path), _rollout_model_path(cfg),
                                                 cfg.fp8_plan, rollout.activation_scheme),
        bounds if cfg.fp8_plan.static_per_tensor(rollout.activation_scheme) else None)
    dist.barrier()


def _start_server(cfg: RunConfig):
    """Rank 0, rollout.mode=disaggregated: an SGLang server subprocess (on rollout.server_devices)
    or the server at rollout.server_url, fed by rollout.weight_transfer (distributed or disk)."""
    from megatron_fp8rl.rollout.sglang_server import SGLangServer

    rollout, run_dir = cfg.rollout, Path(cfg.run_dir)
    config = _sglang_config(cfg)
    if rollout.server_tp > 1:
        config.extra = {**config.extra, "tp_size": rollout.server_tp}
    return SGLangServer(config, url=rollout.server_url or None, weight_transfer=rollout.weight_transfer,
                        bucket_mb=rollout.bucket_mb, devices=rollout.server_devices or None,
                        update_dir=run_dir / "weight_updates", log_path=run_dir / "sglang_server.log")


def evaluate(ctx: StepContext, prompts: list[list[int]], answers: list[str]) -> list[bool]:
    """Greedy correctness per held-out prompt (rank 0 generates; the result is broadcast)."""
    correct: list = [None]
    if ctx.engine is not None:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=ctx.cfg.rollout.max_new_tokens)
        samples = ctx.engine.generate(prompts, sampling, n=1)
        rewards, _ = score(ctx.reward_fn, [ctx.decode(s.token_ids) for s in samples], answers,
                           timeout_s=ctx.cfg.data.reward_timeout_s)
        correct = [[bool(r > 0) for r in rewards]]
    dist.broadcast_object_list(correct, src=0)
    return list(correct[0])


EVAL_RECORD = "eval_correct.json"
"""Per-problem greedy correctness of every eval, {step: [0/1 per held-out problem]}, in the run
directory: what a paired test between two runs on the same problems reads (the stability study)."""


def _record_eval(cfg: RunConfig, rank: int, step: int, correct: list[bool]) -> None:
    """Rank 0: add one eval's per-problem results to the run's EVAL_RECORD (rewritten whole,
    through a temporary file, so a crash leaves the previous record)."""
    if rank != 0:
        return
    path = Path(cfg.run_dir) / EVAL_RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    record[str(step)] = [int(c) for c in correct]
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def eval_metrics(correct: list[bool], start: list[bool] | None) -> dict[str, float]:
    """eval/accuracy, and against the first eval of the run (same problems): eval/gained,
    eval/lost and the paired McNemar p-value eval/mcnemar_p."""
    metrics = {"eval/accuracy": sum(correct) / len(correct)}
    if start is not None:
        metrics.update({f"eval/{k}": v for k, v in paired_eval_change(start, correct).items()})
    return metrics


def train(cfg: RunConfig, rank: int) -> dict[str, float]:
    """Run the configured RL job on this process (all ranks call it): one `rl_step` per step, with
    greedy evaluation, tensorboard logging and checkpoints; returns the summary."""
    setup_begin = time.perf_counter()
    ctx, tokenizer, train_records, eval_prompts, eval_answers = _prepare(cfg, rank)
    try:
        with StopSignals() as stops:  # after the engine start: SGLang's handler ignores SIGTERM
            sampler = PromptSampler(train_records, cfg.data.prompts_per_step, seed=cfg.train.seed)
            start, resumed = _resume(ctx, sampler)
            prompts = prompt_batches(sampler, tokenizer)
            writer = SummaryWriter(str(Path(cfg.run_dir) / "tb")) if rank == 0 else None
            summary = dict(resumed)  # a resumed run's summary continues the interrupted one's
            eval_start = summary.pop("eval_start", None)  # per-problem correctness of the first eval
            if cfg.train.eval_every and not start:
                with timed(ctx.setup_timings, "setup_eval"):
                    eval_start = evaluate(ctx, eval_prompts, eval_answers)
                _record_eval(cfg, rank, start, eval_start)
                summary["eval/accuracy_start"] = eval_metrics(eval_start, None)["eval/accuracy"]
                _log(writer, {"eval/accuracy": summary["eval/accuracy_start"]}, start)
            begin = time.perf_counter()
            # seconds_setup: conversion, engine start, the first eval; seconds: the steps after it
            summary["seconds_setup"] = begin - setup_begin
            _log(writer, ctx.setup_timings, start)
            summary.update({k.replace("time/", "seconds_").removesuffix("_s"): v
                            for k, v in ctx.setup_timings.items()})
            bar = tqdm(range(start + 1, cfg.train.steps + 1), desc="rl", disable=rank != 0, initial=start,
                       total=cfg.train.steps)
            for step in bar:
                metrics = rl_step(ctx, prompts, step)
                if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                    with timed(metrics, "eval"):
                        correct = evaluate(ctx, eval_prompts, eval_answers)
                    _record_eval(cfg, rank, step, correct)
                    metrics.update(eval_metrics(correct, eval_start))
                _log(writer, metrics, step)
                bar.set_postfix_str(bar_text(metrics))
                summary.update({k: v for k, v in metrics.items() if k.startswith(("eval/", "reward/"))})
                stop = stops.agreed()
                if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.train.steps or stop:
                    state = {"sampler": sampler.state_dict(), "summary": {**summary, "eval_start": eval_start},
                             **_calibrator_state(ctx)}
                    saved = save_checkpoint(cfg.checkpoint, step, ctx.actor.model, ctx.actor.optimizer, state)
                if stop is not None:
                    raise StopRequested(stop, step, saved)
            summary["seconds"] = time.perf_counter() - begin
            return _finish(ctx, rank, writer, summary)
    finally:
        if ctx.engine is not None:
            ctx.engine.shutdown()


def _prepare(cfg: RunConfig, rank: int):
    """Checks, tokenizer, prompt records, the plan on the console, then `start_run`: (context,
    tokenizer, training records, held-out prompt token ids, their answers)."""
    from transformers import AutoTokenizer

    check_inputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    train_records = load_records(cfg.data.train, "train", cfg.data.train_size, cfg)
    eval_records = load_records(cfg.data.eval, "eval", cfg.data.eval_size, cfg)[:cfg.data.eval_size]
    if rank == 0:
        print("\n".join(plan_lines(cfg, len(train_records), len(eval_records))), flush=True)
    ctx = start_run(cfg, rank, tokenizer, train_records)
    return (ctx, tokenizer, train_records, [prompt_token_ids(r, tokenizer) for r in eval_records],
            [r.answer for r in eval_records])


def prompt_batches(sampler: PromptSampler, tokenizer) -> Prompts:
    """The sampler's batches as (prompt token ids, answers), drawn one `next` at a time (rl_step
    draws one per sampling round), so the sampler's state is the data position a checkpoint keeps."""
    while True:
        batch = sampler.next_batch()
        yield [prompt_token_ids(r, tokenizer) for r in batch], [r.answer for r in batch]


def _finish(ctx: StepContext, rank: int, writer, summary: dict) -> dict:
    """After the last step: the HF export, then (rank 0) the tensorboard writer closed and
    summary.json written; returns the summary."""
    begin = time.perf_counter()
    summary["hf_output"] = _export_hf(ctx, rank)
    summary["seconds_export"] = time.perf_counter() - begin
    if writer is not None:
        writer.close()
        (Path(ctx.cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def plan_lines(cfg: RunConfig, train_size: int, eval_size: int) -> list[str]:
    """The run's plan for the console, before any slow work: model, task, steps, where logs go."""
    data, rollout, train_cfg, run_dir = cfg.data, cfg.rollout, cfg.train, Path(cfg.run_dir)
    task = (f"built-in arithmetic ({', '.join(data.arithmetic_ops)})" if data.train == "builtin:arithmetic"
            else data.train)
    evals = (f"greedy eval at the start, every {train_cfg.eval_every} steps and at the end"
             if train_cfg.eval_every else "no eval")
    return [f"model  {cfg.model.hf_path} (trainer FP8 {cfg.model.fp8}, rollout FP8 {rollout.fp8})",
            f"task   {task}: {train_size} training prompts, {eval_size} held out, reward {data.reward}",
            f"steps  {train_cfg.steps} x {data.prompts_per_step} prompts x {rollout.n_samples} samples "
            f"(<= {rollout.max_new_tokens} tokens), {cfg.algorithm.name}, lr {train_cfg.lr:g}; {evals}",
            f"logs   {run_dir / 'tb'} (tensorboard --logdir {run_dir / 'tb'}), "
            f"{run_dir / 'summary.json'}, trained model {run_dir / 'hf'}",
            "setup  converting the checkpoint, starting SGLang, first eval (a minute or two)"]


def start_run(cfg: RunConfig, rank: int, tokenizer, train_records: list[PromptRecord]) -> StepContext:
    """All ranks: claim the run directory, convert the start checkpoint (once), build the actor
    (calibrated on the first 16 `train_records` where input scales are static) and (rank 0) the
    rollout engine: what every `rl_step` uses. The caller shuts the engine down."""
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
    if cfg.fp8_plan.fp8:
        with timed(timings, "setup_rollout_checkpoint"):
            _write_rollout_start(cfg, actor, tokenizer, train_records)
    engine = None
    with timed(timings, "setup_engine"):
        if rank == 0:
            engine = _start_server(cfg) if cfg.rollout.mode == "disaggregated" else _start_engine(cfg)
    return StepContext(cfg=cfg, actor=actor, engine=engine, reward_fn=load_reward_fn(cfg.data.reward),
                       decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), setup_timings=timings)


BAR_PHASES = ("rollout", "recompute", "train", "sync")


def bar_text(metrics: dict[str, float]) -> str:
    """The progress bar's postfix: reward, per-phase seconds of the step, eval accuracy."""
    parts = [f"reward {metrics['reward/mean']:.3g}"] if "reward/mean" in metrics else []
    parts += [f"{phase} {metrics[f'time/{phase}_s']:.0f}s" for phase in BAR_PHASES
              if metrics.get(f"time/{phase}_s", 0) >= 0.5]
    if "eval/accuracy" in metrics:
        parts.append(f"eval acc {metrics['eval/accuracy']:.3f}")
    return ", ".join(parts)


def _resume(ctx: StepContext, sampler: PromptSampler) -> tuple[int, dict[str, float]]:
    """Continue from the newest intact checkpoint, if any (newer damaged ones are skipped, each
    named with its problem on stderr; all damaged is an error): weights, optimizer, RNG, data
    position; the rollout engine gets the restored weights as version `step` (what the
    uninterrupted run's engine held). Rollout sampling needs no saved state (rl_step.rollout_seed).
    Returns the step to continue after and the summary so far."""
    choice: list = [(None, None)]
    if dist.get_rank() == 0:  # one rank reads and hashes the files; the others follow its choice
        try:
            path, skipped = newest_intact_checkpoint(ctx.cfg.checkpoint.dir)
            choice = [(path, None)]
        except CheckpointError as exc:
            skipped, choice = [], [(None, str(exc))]
        for line in skipped:
            print(f"resume: skipping damaged checkpoint {line}", file=sys.stderr, flush=True)
    dist.broadcast_object_list(choice, src=0)
    path, error = choice[0]
    if error is not None:
        raise CheckpointError(error)
    if path is None:
        return 0, {}
    state = load_checkpoint(path, ctx.actor.model, ctx.actor.optimizer, verify=False)
    sampler.load_state_dict(state["sampler"])
    if ctx.actor.calibrator is not None and "clip_calibration" in state:
        ctx.actor.calibrator.load_state_dict(state["clip_calibration"])
    sync_weights(ctx, version=state["step"])
    return int(state["step"]), dict(state.get("summary", {}))


def _calibrator_state(ctx: StepContext) -> dict:
    """Calibrated Clipping's bounds for a checkpoint (nothing when it is off)."""
    calibrator = ctx.actor.calibrator
    return {} if calibrator is None else {"clip_calibration": calibrator.state_dict()}


def _log(writer, metrics: dict[str, float | str], step: int) -> None:
    """Numbers as tensorboard scalars; text as tensorboard text (samples/responses: a few of the
    step's responses), and a reward's first error also on the console, with the step's failure
    counts."""
    if writer is None:
        return
    for name, value in metrics.items():
        if isinstance(value, (int, float)) and value == value:
            writer.add_scalar(name, value, step)
        elif isinstance(value, str):
            writer.add_text(name, value, step)
            if not name.startswith("reward/"):
                continue
            counts = ", ".join(f"{k.split('/')[-1]} {metrics[k]:g}" for k in
                               ("reward/errors", "reward/timeouts", "reward/invalid") if metrics.get(k))
            tqdm.write(f"step {step}: {name}: {value} ({counts})", file=sys.stderr)
    writer.flush()


def _export_hf(ctx: StepContext, rank: int) -> str:
    """The trained weights as an HF checkpoint at <run_dir>/hf (config and tokenizer from the
    starting checkpoint)."""
    final = ctx.actor.save_weights(Path(ctx.cfg.run_dir) / "final_megatron")
    output = Path(ctx.cfg.run_dir) / "hf"
    if rank == 0:
        write_manifest(final)
        convert_megatron_to_hf(final, output, hf_config_dir=Path(ctx.cfg.model.hf_path),
                               overwrite=True, progress=False)
    dist.barrier()
    return str(output)
