"""Greedy evaluation on the held-out problems.

Owns: `HeldOut` (the run's held-out prompts and answers), which evals run on how many problems
(`eval_due`, `eval_count`: all at the start and the end, data.eval_interim_size in between),
`evaluate`, the per-problem record (EVAL_RECORD) and `eval_metrics`.
Must not import: cli, trainer.loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from megatron_fp8rl.data.rewards import score
from megatron_fp8rl.rl.metrics import paired_eval_change
from megatron_fp8rl.rollout.engine import SamplingParams
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.rl_step import StepContext, timed


EVAL_CHUNK = 100
"""Held-out prompts per engine call: the console shows the eval's progress a chunk at a time (500
greedy answers take minutes on the CPU tier). Greedy answers do not depend on the chunking
(tests/rollout/test_eval_batch_invariance.py)."""


@dataclass(frozen=True)
class HeldOut:
    """The run's held-out problems, in their fixed order."""

    prompts: list[list[int]]
    """Prompt token ids (the chat template applied)."""
    answers: list[str]
    """Reference answers, one per prompt."""


def eval_due(cfg: RunConfig, step: int) -> bool:
    """Whether a greedy eval follows `step` (0: the run's start): every train.eval_every steps,
    at the start and after the last; never with eval_every=0."""
    every = cfg.train.eval_every
    return bool(every) and (step % every == 0 or step == cfg.train.steps)


def eval_count(cfg: RunConfig, step: int) -> int:
    """Held-out problems the eval after `step` scores: all data.eval_size at the start (step 0) and
    after the last step, the first data.eval_interim_size (0: all) in between."""
    data = cfg.data
    if step in (0, cfg.train.steps) or not data.eval_interim_size:
        return data.eval_size
    return data.eval_interim_size


def evaluate(ctx: StepContext, prompts: list[list[int]], answers: list[str]) -> list[bool]:
    """Greedy correctness per held-out prompt (rank 0 generates, EVAL_CHUNK prompts a call, with a
    progress bar; the result is broadcast)."""
    correct: list = [None]
    if ctx.engine is not None:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=ctx.cfg.rollout.max_new_tokens)
        samples = []
        for start in tqdm(range(0, len(prompts), EVAL_CHUNK), desc=f"eval {len(prompts)} problems", leave=False,
                          unit="chunk"):
            samples += ctx.engine.generate(prompts[start:start + EVAL_CHUNK], sampling, n=1)
        rewards, _ = score(ctx.reward_fn, [ctx.decode(s.token_ids) for s in samples], answers,
                           timeout_s=ctx.cfg.data.reward_timeout_s)
        correct = [[bool(r > 0) for r in rewards]]
    dist.broadcast_object_list(correct, src=0)
    return list(correct[0])


def evaluate_after(ctx: StepContext, held_out: HeldOut, step: int, timings: dict[str, float],
                   timing_name: str) -> list[bool]:
    """The eval after `step` on its `eval_count` first held-out problems, timed into `timings` as
    time/<timing_name>_s and added to the run's EVAL_RECORD; returns per-problem correctness."""
    count = eval_count(ctx.cfg, step)
    with timed(timings, timing_name):
        correct = evaluate(ctx, held_out.prompts[:count], held_out.answers[:count])
    if dist.get_rank() == 0:
        record_eval(Path(ctx.cfg.run_dir), step, correct)
    return correct


EVAL_RECORD = "eval_correct.json"
"""Per-problem greedy correctness of every eval, {step: [0/1 per held-out problem]}, in the run
directory: what a paired test between two runs on the same problems reads (the stability study).
An interim eval (data.eval_interim_size) lists its first problems only."""


def record_eval(run_dir: Path, step: int, correct: list[bool]) -> None:
    """Add one eval's per-problem results to the run's EVAL_RECORD (rewritten whole, through a
    temporary file, so a crash leaves the previous record)."""
    path = run_dir / EVAL_RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    record[str(step)] = [int(c) for c in correct]
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def eval_metrics(correct: list[bool], start: list[bool] | None) -> dict[str, float]:
    """eval/accuracy, and against the first eval of the run on the same problems (its first
    len(correct)): eval/gained, eval/lost and the paired McNemar p-value eval/mcnemar_p."""
    metrics = {"eval/accuracy": sum(correct) / len(correct)}
    if start is not None:
        paired = paired_eval_change(start[:len(correct)], correct)
        metrics.update({f"eval/{k}": v for k, v in paired.items()})
    return metrics
