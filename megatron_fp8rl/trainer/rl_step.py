"""One RL step: rollout -> reward -> advantages -> old-logprob recompute -> policy update -> sync.

Owns: `rl_step` (the data flow of DESIGN.md on one screen) and the helpers it calls in order.
Rollouts and rewards run on global rank 0 (the colocated SGLang engine) and are broadcast; every
rank then trains on its data-parallel slice. Must not import: cli.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_fp8rl.data.rewards import RewardFn, score
from megatron_fp8rl.rl.advantages import grpo_advantages, rloo_advantages
from megatron_fp8rl.rl.noise import NoiseFloor
from megatron_fp8rl.rl.sampling import select_informative_groups, shape_overlong_rewards
from megatron_fp8rl.rollout.engine import RolloutEngine, RolloutSample, SamplingParams
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.clip_calibration import ClipCalibrator
from megatron_fp8rl.trainer.batch import RolloutBatch, build_batch, micro_batches, split_mini_batches
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.objective import loss_denominator, make_loss_fn, noise_levels, step_noise_floor
from megatron_fp8rl.trainer.rollout_fp8 import ROLLOUT_CHECKPOINT, rollout_tensors, served_scales, shares_scales


@dataclass
class StepContext:
    """What every step uses; built once by the loop."""

    cfg: RunConfig
    actor: MegatronActor
    engine: RolloutEngine | None
    """The rollout engine on global rank 0; None elsewhere."""
    reward_fn: RewardFn
    decode: Callable[[list[int]], str]
    """Token ids -> text for the reward (the tokenizer's decode)."""
    sync_dir: Path
    clip_calibrator: ClipCalibrator | None = None
    """Calibrated Clipping's state (algorithm.clip_calibration=shadow); None otherwise."""
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def _timed(ctx: StepContext, name: str):
    start = time.perf_counter()
    yield
    ctx.timings[f"time/{name}_s"] = time.perf_counter() - start


def rl_step(ctx: StepContext, prompts: list[list[int]], answers: list[str], more_prompts, step: int) -> dict[str, float]:
    """Run one RL step on `prompts` (token ids) and return its metrics (same on every rank)."""
    ctx.timings.clear()
    with _timed(ctx, "rollout"):
        samples, rewards, stats = _rollout_until_full(ctx, prompts, answers, more_prompts)
    if not samples:
        return {**stats, **ctx.timings}
    if _colocated_engine(ctx):  # SGLang's memory goes to the trainer until sync_weights
        ctx.engine.release_memory()
    with _timed(ctx, "advantages"):
        batch = _make_batch(ctx.cfg, samples, rewards)
    with _timed(ctx, "recompute"):
        old_logprobs = _old_logprobs(ctx, batch) if _recompute_needed(ctx.cfg) else None
    with _timed(ctx, "train"):
        train_metrics = {**_train(ctx, batch, old_logprobs, step), **ctx.actor.fp8_metrics()}
    with _timed(ctx, "sync"):
        sync_weights(ctx, version=step)
    tokens = float(batch.response_mask.sum())
    return {**stats, **train_metrics, **ctx.timings,
            "perf/response_tokens_per_s": tokens / max(ctx.timings["time/rollout_s"], 1e-9)}


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rollout_until_full(ctx: StepContext, prompts, answers, more_prompts):
    """Sample n per prompt and score; with dynamic sampling, drop all-equal groups and draw more
    prompts (up to max_sampling_rounds) until `prompts_per_step` groups are kept."""
    cfg = ctx.cfg
    kept_samples, kept_rewards, seen, dropped, reward_stats = [], [], [], 0, {}
    for round_index in range(cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1):
        if round_index:
            prompts, answers = more_prompts()
        samples, rewards, stats = _broadcast(_generate_and_score(ctx, prompts, answers)
                                             if dist.get_rank() == 0 else None)
        seen.append(rewards)
        first_error = stats.pop("first_error")
        if first_error:
            reward_stats.setdefault("first_error", first_error)
        for key, value in stats.items():
            reward_stats[key] = reward_stats.get(key, 0) + value
        groups = rewards.view(len(prompts), cfg.rollout.n_samples)
        keep = (select_informative_groups(groups).keep if cfg.algorithm.dynamic_sampling
                else torch.ones(len(prompts), dtype=torch.bool))
        dropped += int((~keep).sum())
        for g in keep.nonzero().flatten().tolist():
            n = cfg.rollout.n_samples
            kept_samples.append(samples[g * n:(g + 1) * n])
            kept_rewards.append(groups[g])
        if len(kept_samples) >= cfg.data.prompts_per_step:
            break
    kept_samples, kept_rewards = kept_samples[:cfg.data.prompts_per_step], kept_rewards[:cfg.data.prompts_per_step]
    raw = torch.cat(seen)
    metrics = {"reward/mean": float(raw.mean()), "reward/accuracy": float((raw > 0).float().mean()),
               "sampling/groups_dropped": float(dropped), "sampling/groups_kept": float(len(kept_samples)),
               **{f"reward/{k}": v if isinstance(v, str) else float(v) for k, v in reward_stats.items()}}
    flat = [s for group in kept_samples for s in group]
    lengths = torch.tensor([len(s.token_ids) for s in flat], dtype=torch.float32)
    if flat:
        metrics.update({"response/length_mean": float(lengths.mean()),
                        "response/truncated_frac": float(sum(s.finish_reason == "length" for s in flat) / len(flat))})
    return flat, (torch.stack(kept_rewards) if kept_rewards else None), metrics


def _generate_and_score(ctx: StepContext, prompts, answers):
    cfg = ctx.cfg.rollout
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)
    samples: list[RolloutSample] = ctx.engine.generate(prompts, sampling, n=cfg.n_samples)
    texts = [ctx.decode(s.token_ids) for s in samples]
    refs = [answers[s.prompt_index] for s in samples]
    rewards, stats = score(ctx.reward_fn, texts, refs, timeout_s=ctx.cfg.data.reward_timeout_s)
    counts = {"errors": stats.errors, "timeouts": stats.timeouts, "invalid": stats.invalid,
              "first_error": stats.first_error}
    return samples, torch.tensor(rewards, dtype=torch.float32), counts


def _make_batch(cfg: RunConfig, samples: list[RolloutSample], rewards: torch.Tensor) -> RolloutBatch:
    """Overlong shaping, group advantages, padded tensors. `rewards` is [G, n]."""
    algo = cfg.algorithm
    if algo.overlong_buffer:
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32).view_as(rewards)
        rewards = shape_overlong_rewards(rewards, lengths, max_length=cfg.rollout.max_new_tokens,
                                         buffer_length=algo.overlong_buffer,
                                         penalty_factor=algo.overlong_penalty)
    if algo.advantage == "rloo":
        advantages = rloo_advantages(rewards)
    else:
        advantages = grpo_advantages(rewards, scale_by_std=algo.advantage == "grpo")
    length = max(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
    return build_batch(samples, advantages.flatten(), length)


def _recompute_needed(cfg: RunConfig) -> bool:
    """Whether π_old is recomputed before the update. Not with bypass (π_old is the rollout's),
    nor with one mini-batch: the update's only forward runs at θ = θ_old, so its own detached
    logprobs are π_old (objective.make_loss_fn); in float32, and for aligned FP8 in the rollout's
    arithmetic, a recompute gives the same bits (tests/trainer/test_rl_train.py). Calibrated
    Clipping and noise-calibrated TIS/MIS read the whole batch's π_old before the update."""
    algo = cfg.algorithm
    if algo.old_policy == "bypass":
        return False
    return cfg.train.mini_batches > 1 or algo.clip_calibration != "none" or algo.noise_correction


def _old_logprobs(ctx: StepContext, batch: RolloutBatch) -> torch.Tensor:
    """log π_old of every position, [B, S] (or more rows: micro-batch padding), recomputed by the
    trainer before the update (real values on the last pipeline stage, zeros elsewhere, where the
    loss is not computed). Aligned FP8 rollouts: in the rollout's arithmetic (SGLang's attention
    calls and, for a shared-scale recipe, the served scales), bit-identical to it through every
    decoder layer. Otherwise those bits
    are out of reach and the recompute runs as the training forward does (one batched attention
    call a layer instead of one a row, ~S times fewer calls); in float32 the first mini-batch's
    PPO ratio is then exactly 1."""
    micro = micro_batches(batch, ctx.cfg.train.micro_batch_size)
    scales = _served_scales(ctx)
    with nullcontext() if scales is None else ctx.actor.frozen_fp8(scales):
        per_micro = ctx.actor.logprobs(micro, as_served=ctx.cfg.rollout.fp8 == "aligned")
    return torch.cat(per_micro) if per_micro else torch.zeros_like(batch.rollout_logprobs)


def _served_scales(ctx: StepContext) -> dict | None:
    """Aligned FP8 rollouts of a shared-scale recipe: the FP8 scales the rollout engine serves now
    (from the last weight sync, or before the first one from the start-up FP8 checkpoint,
    rollout_fp8.py); else None (a row-group recipe's scales are recomputed, not shared)."""
    if not shares_scales(ctx.cfg.rollout.fp8, ctx.cfg.model.fp8):
        return None
    if ctx.actor.rollout_scales is None:
        ctx.actor.rollout_scales = served_scales(Path(ctx.cfg.run_dir) / ROLLOUT_CHECKPOINT)
    return ctx.actor.rollout_scales


def _train(ctx: StepContext, batch: RolloutBatch, old_logprobs: torch.Tensor | None,
           step: int) -> dict[str, float]:
    """One optimizer step per mini-batch on this rank's DP slice; metrics averaged over steps.
    `old_logprobs` None: no recompute ran (bypass, or one mini-batch: `_recompute_needed`); the first
    mini-batch measures the noise floor from its own forward (objective.py).
    Aligned FP8 rollouts: the first mini-batch (θ = θ_old) trains on a forward in the rollout's
    own arithmetic (MegatronActor.train's `as_served`, with the served scales of a shared-scale
    recipe), so its PPO ratio is exactly 1.
    Calibrated Clipping: the bounds in force clip every mini-batch; a calibrating step also runs
    the shadow forwards on mini-batch m* and recalibrates (trainer/clip_calibration.py)."""
    cfg, calibrator = ctx.cfg, ctx.clip_calibrator
    dp_size = parallel_state.get_data_parallel_world_size()
    if old_logprobs is not None:
        old_logprobs = old_logprobs[:batch.size]  # the recompute ran on the padded layout
    noise = None if old_logprobs is None else step_noise_floor(cfg, batch, old_logprobs)
    minis = split_mini_batches(batch, old_logprobs, cfg.train.mini_batches, dp_size * cfg.train.micro_batch_size)
    target = calibrator.batch_index(len(minis)) if calibrator is not None and calibrator.due(step) else None
    if target is not None:
        shadow_old = ctx.actor.shadow_logprobs(_local_micro(ctx, *minis[target]))
    results, captured = [], []
    for index, (mini, mini_old) in enumerate(minis):
        micro = _local_micro(ctx, mini, mini_old)
        if index == target:
            shadow = shadow_old if index == 0 else ctx.actor.shadow_logprobs(micro)
        loss_fn = make_loss_fn(cfg, loss_denominator(cfg, mini, dp_size), noise,
                               at_old_policy=index == 0, clip_bounds=calibrator and calibrator.calibrated,
                               capture=captured if index == target else None)
        first_aligned = index == 0 and cfg.rollout.fp8 == "aligned"
        results.append(ctx.actor.train(micro, loss_fn, as_served=first_aligned,
                                       served_scales=_served_scales(ctx) if first_aligned else None))
        if noise is None:
            noise = NoiseFloor.from_metrics(results[0].metrics, noise_levels(cfg.algorithm))
    metrics = _mean_metrics(results)
    if target is not None:
        metrics.update(calibrator.update(*_stacked(captured, shadow, shadow_old)))
    if calibrator is not None:
        metrics.update(calibrator.metrics())
    return metrics


def _local_micro(ctx: StepContext, mini: RolloutBatch,
                 old_logprobs: torch.Tensor | None) -> list[dict[str, torch.Tensor]]:
    """This rank's DP slice of one (padded) mini-batch as micro-batches (with `old_logprobs`)."""
    rows = torch.arange(mini.size).chunk(parallel_state.get_data_parallel_world_size())
    mine = rows[parallel_state.get_data_parallel_rank()]
    micro = micro_batches(mini.select(mine), ctx.cfg.train.micro_batch_size)
    if old_logprobs is not None:
        for mb, old in zip(micro, old_logprobs[mine].split(ctx.cfg.train.micro_batch_size)):
            mb["old_logprobs"] = old
    return micro


def _stacked(captured: list, shadow: list[torch.Tensor], shadow_old: list[torch.Tensor]):
    """(fp8, fp8_old, shadow, shadow_old, advantages, mask) [b, S] of m*'s rows on this rank; empty
    [0, S] tensors where the rank computed no loss (not the last pipeline stage)."""
    if not captured:
        empty = torch.zeros(0, 1)
        return (empty,) * 6
    fp8, fp8_old, advantages, mask = (torch.cat(parts) for parts in zip(*captured))
    return fp8, fp8_old, torch.cat(shadow), torch.cat(shadow_old), advantages, mask


def _mean_metrics(results) -> dict[str, float]:
    """Each metric averaged over the mini-batches that report it (bypass: π_old-dependent ones,
    such as mismatch and clip attribution, exist for the first mini-batch only)."""
    names = dict.fromkeys(name for r in results for name in r.metrics)
    metrics = {}
    for name in names:
        values = [r.metrics[name] for r in results if name in r.metrics]
        metrics[name if name.startswith("noise/") else f"train/{name}"] = sum(values) / len(values)
    metrics["train/grad_norm"] = sum(r.grad_norm for r in results) / len(results)
    return metrics


def _colocated_engine(ctx: StepContext) -> bool:
    """Whether this rank holds an in-process engine whose memory the train phase takes."""
    return ctx.engine is not None and ctx.cfg.rollout.mode == "colocated"


def sync_weights(ctx: StepContext, version: int) -> None:
    """Trainer weights -> rollout engine, quantized for rollout.fp8 (rollout_fp8.rollout_tensors);
    aligned mode also sends the trainer's FP8 scales and keeps them for the next old-logprob
    recompute. At TP = PP = 1 straight from the model; otherwise through a torch_dist snapshot
    (any TP/PP), which costs a checkpoint written (fsync'd) and read back on every step."""
    in_memory = ctx.cfg.model.tensor_parallel == 1 and ctx.cfg.model.pipeline_parallel == 1
    directory = None if in_memory else ctx.actor.save_weights(ctx.sync_dir)
    mode = ctx.cfg.rollout.fp8
    scales = ctx.actor.aligned_scales() if shares_scales(mode, ctx.cfg.model.fp8) else None
    if _colocated_engine(ctx):
        ctx.engine.resume_memory(["weights"])  # back before they are written; no-op unless released
    if ctx.engine is not None:
        weights = ctx.actor.hf_tensors_in_memory() if in_memory else ctx.actor.hf_tensors(directory)
        tensors = rollout_tensors(weights, int(ctx.actor.hf_config["num_hidden_layers"]), mode, scales,
                                  ctx.cfg.model.fp8)
        ctx.engine.update_weights(tensors, version=version)
    if _colocated_engine(ctx):
        ctx.engine.resume_memory()  # KV cache and CUDA graphs
    ctx.actor.rollout_scales = scales
    dist.barrier()
