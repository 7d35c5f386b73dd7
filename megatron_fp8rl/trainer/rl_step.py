"""One RL step: rollout -> reward -> advantages -> old-logprob recompute -> reference log-probs
(algorithm.kl only) -> policy update -> sync.

Owns: `rl_step` (the data flow of docs/design.md on one screen) and the helpers it calls in order:
rollouts (with per-step sampling seeds, `rollout_seed`) and rewards run on global rank 0 (the
colocated SGLang engine or the server) and are broadcast; every rank then builds the batch and
hands it to the actor (`MegatronActor.update`, which owns the mini-batch/DP loop and the
optimizer steps); the weight sync sends the actor's weights back to the engine. Where the rollout
is bit-identical to the trainer the old-logprob recompute is a periodic check (`recompute_plan`,
`check_recompute`). Must not import: cli, trainer.loop.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_fp8rl.data.rewards import RewardFn, score
from megatron_fp8rl.rl.advantages import grpo_advantages, rloo_advantages
from megatron_fp8rl.rl.metrics import garbled_flags
from megatron_fp8rl.rl.sampling import select_informative_groups, shape_overlong_rewards
from megatron_fp8rl.rollout.engine import RolloutEngine, RolloutSample, SamplingParams
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.batch import RolloutBatch, build_batch
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.fp8_observation import fp8_metrics
from megatron_fp8rl.trainer.reference import ReferencePolicy, reward_kl_penalty

Prompts = Iterator[tuple[list[list[int]], list[str]]]
"""Batches of (prompt token ids, reference answers), one batch per `next`."""


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
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of the current step's phases (time/<phase>_s)."""
    setup_timings: dict[str, float] = field(default_factory=dict)
    """Seconds of the run's set-up phases (time/setup_<phase>_s), logged at the start step."""
    reference: ReferencePolicy | None = None
    """The KL penalty's reference policy (algorithm.kl.coef > 0); None when KL is off."""


@contextmanager
def timed(timings: dict[str, float], name: str):
    """Seconds of the block into `timings` as time/<name>_s (a step's phases, the run's set-up
    phases, each eval)."""
    start = time.perf_counter()
    yield
    timings[f"time/{name}_s"] = time.perf_counter() - start


def rl_step(ctx: StepContext, prompts: Prompts, step: int) -> dict[str, float]:
    """Run RL step `step` on the next batch of `prompts` (more with dynamic sampling) and return
    its metrics (same on every rank)."""
    ctx.timings.clear()
    with timed(ctx.timings, "rollout"):
        samples, rewards, stats = _rollout_until_full(ctx, prompts, step)
    if not samples:
        return {**stats, **ctx.timings}
    if _colocated_engine(ctx):  # SGLang's memory goes to the trainer until sync_weights
        ctx.engine.release_memory()
    with timed(ctx.timings, "advantages"):
        batch = _make_batch(ctx.cfg, samples, rewards)
    with timed(ctx.timings, "recompute"):
        old_logprobs, recompute_metrics = _old_logprobs(ctx, batch, step)
    batch, kl_metrics = _with_reference(ctx, batch, samples, rewards)
    with timed(ctx.timings, "train"):
        train_metrics = {**ctx.actor.update(batch, old_logprobs, step), **fp8_metrics(ctx.actor.model),
                         **recompute_metrics, **kl_metrics}
    with timed(ctx.timings, "sync"):
        sync_weights(ctx, version=step)
    tokens = float(batch.response_mask.sum())
    return {**stats, **train_metrics, **ctx.timings,
            "perf/response_tokens_per_s": tokens / max(ctx.timings["time/rollout_s"], 1e-9)}


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rollout_until_full(ctx: StepContext, prompts: Prompts, step: int):
    """Sample n per prompt of the next batch and score; with dynamic sampling, drop all-equal
    groups and draw more batches (up to max_sampling_rounds) until `prompts_per_step` groups are
    kept. Round r's sampling seed is `rollout_seed(train.seed, step, r)`."""
    cfg = ctx.cfg
    kept_samples, kept_rewards, seen, dropped, reward_stats, responses = [], [], [], 0, {}, None
    for round_index in range(cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1):
        batch_prompts, answers = next(prompts)
        seed = rollout_seed(cfg.train.seed, step, round_index) if cfg.rollout.temperature > 0 else None
        samples, rewards, stats = _broadcast(_generate_and_score(ctx, batch_prompts, answers, seed)
                                             if dist.get_rank() == 0 else None)
        seen.append(rewards)
        first_error, shown = stats.pop("first_error"), stats.pop("responses")
        if first_error:
            reward_stats.setdefault("first_error", first_error)
        responses = shown if responses is None else responses  # the first round's
        for key, value in stats.items():
            reward_stats[key] = reward_stats.get(key, 0) + value
        groups = rewards.view(len(batch_prompts), cfg.rollout.n_samples)
        keep = (select_informative_groups(groups).keep if cfg.algorithm.dynamic_sampling
                else torch.ones(len(batch_prompts), dtype=torch.bool))
        dropped += int((~keep).sum())
        for g in keep.nonzero().flatten().tolist():
            n = cfg.rollout.n_samples
            kept_samples.append(samples[g * n:(g + 1) * n])
            kept_rewards.append(groups[g])
        if len(kept_samples) >= cfg.data.prompts_per_step:
            break
    kept_samples, kept_rewards = kept_samples[:cfg.data.prompts_per_step], kept_rewards[:cfg.data.prompts_per_step]
    raw = torch.cat(seen)
    generated = reward_stats.pop("samples")
    metrics = {"reward/mean": float(raw.mean()), "reward/accuracy": float((raw > 0).float().mean()),
               "sampling/groups_dropped": float(dropped), "sampling/groups_kept": float(len(kept_samples)),
               # every sample of the step's rounds, the dropped groups' too
               "response/no_number_frac": reward_stats.pop("no_number") / generated,
               "response/repetitive_frac": reward_stats.pop("repetitive") / generated,
               **{f"reward/{k}": v if isinstance(v, str) else float(v) for k, v in reward_stats.items()},
               "samples/responses": responses}
    flat = [s for group in kept_samples for s in group]
    lengths = torch.tensor([len(s.token_ids) for s in flat], dtype=torch.float32)
    if flat:
        metrics.update({"response/length_mean": float(lengths.mean()),
                        "response/truncated_frac": float(sum(s.finish_reason == "length" for s in flat) / len(flat))})
    return flat, (torch.stack(kept_rewards) if kept_rewards else None), metrics


SAMPLES_PER_CALL = 1 << 20
"""Seed spacing between rollout calls (SGLang gives sample j of a call seed + j)."""


def rollout_seed(run_seed: int, step: int, call: int) -> int:
    """The sampling seed of rollout call `call` (the dynamic-sampling round) of RL step `step`:
    fixed by (train.seed, step, call), so with SGLang's deterministic inference a resumed run draws
    exactly the rollouts an uninterrupted run drew; the seeds depend on nothing a crash loses.
    Without deterministic inference SGLang ignores them."""
    return ((run_seed * 1_000_003 + step) * 64 + call) * SAMPLES_PER_CALL % (1 << 62)


SHOWN_RESPONSES = 4
"""Responses of a step's first rollout call logged as text (tensorboard `samples/responses`), to
read what a failing run writes."""


def _generate_and_score(ctx: StepContext, prompts, answers, seed: int | None):
    cfg = ctx.cfg.rollout
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              seed=seed)
    samples: list[RolloutSample] = ctx.engine.generate(prompts, sampling, n=cfg.n_samples)
    texts = [ctx.decode(s.token_ids) for s in samples]
    refs = [answers[s.prompt_index] for s in samples]
    rewards, stats = score(ctx.reward_fn, texts, refs, timeout_s=ctx.cfg.data.reward_timeout_s)
    flags = [garbled_flags(text, s.token_ids) for text, s in zip(texts, samples)]
    shown = "\n\n".join(f"reward {r:g}, {s.finish_reason}: `{text[:200]!r}`"
                         for text, s, r in list(zip(texts, samples, rewards))[:SHOWN_RESPONSES])
    counts = {"errors": stats.errors, "timeouts": stats.timeouts, "invalid": stats.invalid,
              "first_error": stats.first_error, "samples": len(samples), "responses": shown,
              "no_number": sum(no_number for no_number, _ in flags), "repetitive": sum(rep for _, rep in flags)}
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


def _with_reference(ctx: StepContext, batch: RolloutBatch, samples, rewards: torch.Tensor):
    """The batch carrying the reference's log-probs (timed as time/reference_s), and with
    algorithm.kl.in_reward its advantages recomputed from the rewards less the KL penalty
    (metrics kl/mean, kl/max; in the loss the objective logs them). Unchanged when KL is off."""
    if ctx.reference is None:
        return batch, {}
    with timed(ctx.timings, "reference"):
        batch = replace(batch, ref_logprobs=ctx.reference.logprobs(batch, ctx.timings))
    if not ctx.cfg.algorithm.kl.in_reward:
        return batch, {}
    penalty, metrics = reward_kl_penalty(ctx.cfg.algorithm.kl, batch)
    penalized = _make_batch(ctx.cfg, samples, rewards - penalty.view_as(rewards))
    return replace(batch, advantages=penalized.advantages), metrics


def _recompute_needed(cfg: RunConfig) -> bool:
    """Whether π_old is recomputed before the update. Not with bypass (π_old is the rollout's),
    nor with one mini-batch: the update's only forward runs at θ = θ_old, so its own detached
    logprobs are π_old (objective.Objective.loss); in float32, and for aligned FP8 in the rollout's
    arithmetic, a recompute gives the same bits (tests/trainer/test_rl_train.py). Calibrated
    Clipping and noise-calibrated TIS/MIS read the whole batch's π_old before the update."""
    algo = cfg.algorithm
    if algo.old_policy == "bypass":
        return False
    return cfg.train.mini_batches > 1 or algo.calibration.mode != "none" or algo.noise.correction


def recompute_plan(cfg: RunConfig, step: int) -> str:
    """What step `step` does for log π_old: none (`_recompute_needed` says the update needs no
    recompute), recompute (every step, as ever), or, where the rollout is bit-identical to the
    trainer (RunConfig.rollout_bit_identical), check on steps 1, k+1, 2k+1, ... (k =
    algorithm.recompute_check_every: recompute and `check_recompute`) and skip on the others (the
    rollout's logprobs are the bits a recompute would give)."""
    if not _recompute_needed(cfg):
        return "none"
    if not cfg.rollout_bit_identical:
        return "recompute"
    return "skip" if (step - 1) % cfg.algorithm.recompute_check_every else "check"


def _old_logprobs(ctx: StepContext, batch: RolloutBatch, step: int) -> tuple[torch.Tensor | None, dict[str, float]]:
    """log π_old [B, S] for the update, or None (`recompute_plan`: none), and the recompute/*
    metrics of a bit-identical rollout: recompute/skipped 1 on a skipped step, 0 on a checked one
    (its sum counts the forwards saved), and the check's largest difference (0)."""
    plan = recompute_plan(ctx.cfg, step)
    if plan == "none":
        return None, {}
    if plan == "skip":
        return batch.rollout_logprobs, {"recompute/skipped": 1.0}
    recomputed = ctx.actor.old_logprobs(batch)
    if plan == "recompute":
        return recomputed, {}
    difference = check_recompute(recomputed, batch, step)
    return recomputed, {"recompute/skipped": 0.0, "recompute/check_max_abs_diff": difference}


class RecomputeMismatch(RuntimeError):
    """The recompute of log π_old differs from a rollout that should be bit-identical to it."""


def check_recompute(recomputed: torch.Tensor, batch: RolloutBatch, step: int) -> float:
    """The largest |recomputed − rollout logprob| [B, S] over the response tokens of every rank
    that computes the loss (the last pipeline stage; the others hold zeros); RecomputeMismatch
    naming the step and that difference when it is not 0. All ranks agree (MAX all-reduce)."""
    largest = torch.zeros((), dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        delta = (recomputed.double() - batch.rollout_logprobs.double()).abs()
        response = batch.response_mask.bool()
        largest = delta[response].max() if response.any() else largest
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if float(largest) != 0.0:
        raise RecomputeMismatch(
            f"step {step}: the recomputed log π_old differs from the aligned rollout's logprobs by up to "
            f"{float(largest):.6g} (largest |difference| over the response tokens); they must be bit-identical "
            "(rollout.fp8=aligned, model.dtype=float32), so the rollout's logprobs cannot stand in for the "
            "recompute; the trainer and the served FP8 arithmetic have diverged")
    return float(largest)


def _colocated_engine(ctx: StepContext) -> bool:
    """Whether this rank holds an in-process engine whose memory the train phase takes."""
    return ctx.engine is not None and ctx.cfg.rollout.mode == "colocated"


def sync_weights(ctx: StepContext, version: int) -> None:
    """Trainer weights -> rollout engine as weight `version` (WeightPublisher.publish:
    quantized for rollout.fp8, with the trainer's FP8 scales in aligned mode)."""
    def send(tensors):
        if _colocated_engine(ctx):
            ctx.engine.resume_memory(["weights"])  # back before they are written; no-op unless released
        ctx.engine.update_weights(tensors, version=version)

    ctx.actor.publisher.publish(send)
    if _colocated_engine(ctx):
        ctx.engine.resume_memory()  # KV cache and CUDA graphs
    dist.barrier()
