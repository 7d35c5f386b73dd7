"""`megatron-fp8rl train`: the run from an HF checkpoint to an RL-trained HF checkpoint.

Owns: the step loop (`train`): one rl_step.rl_step per step, fed by `prompt_batches`, with greedy
evaluation (trainer/evaluation.py), tensorboard logging, checkpoints/resume and stopping when told
(trainer/stop.py), then the HF export (trainer/export.py). What comes before the first step
(checks, records, actor, rollout checkpoint, engine) is trainer/start.py. Must not import: cli.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.data.records import prompt_token_ids
from megatron_fp8rl.data.sampler import PromptSampler
from megatron_fp8rl.trainer.checkpoint import load_checkpoint, newest_intact_checkpoint, save_checkpoint
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.evaluation import eval_due, eval_metrics, evaluate_after
from megatron_fp8rl.trainer.export import export_hf
from megatron_fp8rl.trainer.rl_step import Prompts, StepContext, rl_step, sync_weights
from megatron_fp8rl.trainer.start import prepare, step_cost_metrics
from megatron_fp8rl.trainer.stop import StopRequested, StopSignals


def train(cfg: RunConfig, rank: int) -> dict[str, float]:
    """Run the configured RL job on this process (all ranks call it): one `rl_step` per step, with
    greedy evaluation, tensorboard logging and checkpoints; returns the summary."""
    setup_begin = time.perf_counter()
    ctx, tokenizer, train_records, held_out = prepare(cfg, rank)
    try:
        with StopSignals() as stops:  # after the engine start: SGLang's handler ignores SIGTERM
            sampler = PromptSampler(train_records, cfg.data.prompts_per_step, seed=cfg.train.seed)
            start, resumed = _resume(ctx, sampler)
            prompts = prompt_batches(sampler, tokenizer)
            writer = SummaryWriter(str(Path(cfg.run_dir) / "tb")) if rank == 0 else None
            summary = dict(resumed)  # a resumed run's summary continues the interrupted one's
            eval_start = summary.pop("eval_start", None)  # per-problem correctness of the first eval
            if eval_due(cfg, 0) and not start:
                eval_start = evaluate_after(ctx, held_out, 0, ctx.setup_timings, "setup_eval")
                summary["eval/accuracy_start"] = eval_metrics(eval_start, None)["eval/accuracy"]
                _log(writer, {"eval/accuracy": summary["eval/accuracy_start"]}, start)
            begin = time.perf_counter()
            # seconds_setup: conversion, engine start, the first eval; seconds: the steps after it
            summary["seconds_setup"] = begin - setup_begin
            _log(writer, ctx.setup_timings, start)
            if not start:  # once per run: a resumed run's step logs equal the uninterrupted run's
                _log(writer, step_cost_metrics(cfg), 0)
            summary.update({k.replace("time/", "seconds_").removesuffix("_s"): v
                            for k, v in ctx.setup_timings.items()})
            bar = tqdm(range(start + 1, cfg.train.steps + 1), desc="rl", disable=rank != 0, initial=start,
                       total=cfg.train.steps)
            for step in bar:
                metrics = rl_step(ctx, prompts, step)
                if eval_due(cfg, step):
                    metrics.update(eval_metrics(evaluate_after(ctx, held_out, step, metrics, "eval"), eval_start))
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
    summary["hf_output"] = str(export_hf(ctx.cfg, ctx.actor, rank))
    summary["seconds_export"] = time.perf_counter() - begin
    if writer is not None:
        writer.close()
        (Path(ctx.cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


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


