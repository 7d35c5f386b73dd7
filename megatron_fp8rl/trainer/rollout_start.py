"""The checkpoint the rollout engine starts from.

Owns: `rollout_model_path` (the HF checkpoint, or the FP8 one this run writes) and
`write_rollout_start` (that FP8 checkpoint, made from the actor's own weight stream).
Must not import: cli, trainer.loop, trainer.rl_step, trainer.engines.
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_fp8rl.data.records import PromptRecord, prompt_token_ids
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.fp8_observation import calibration_forward
from megatron_fp8rl.trainer.rollout_fp8 import ROLLOUT_CHECKPOINT, write_rollout_checkpoint

CALIBRATION_PROMPTS = 16
"""Training prompts of the calibration forward that sets static input scales."""


def rollout_model_path(cfg: RunConfig) -> Path:
    """The checkpoint the rollout engine or server starts from: the HF checkpoint
    (rollout.fp8=none) or the FP8 one `write_rollout_start` made from the actor."""
    if not cfg.fp8_plan.fp8:
        return Path(cfg.model.hf_path)
    return Path(cfg.run_dir) / ROLLOUT_CHECKPOINT


def write_rollout_start(cfg: RunConfig, actor: MegatronActor, tokenizer,
                        train_records: list[PromptRecord]) -> None:
    """All ranks (collective), rollout.fp8 != none: the FP8 checkpoint the rollout engine starts
    from, made from the actor itself: for static input scales (aligned with a shared-scale
    recipe, or per_tensor static) one calibration forward over the first CALIBRATION_PROMPTS
    training prompts first (the recipe's own rule picks the served scales; per_tensor static takes
    the max |input| of each linear), then the actor's `publisher.publish` stream, the one every
    sync sends, written by rank 0 (trainer/rollout_fp8.write_rollout_checkpoint). No other model
    is built and no checkpoint is read."""
    rollout = cfg.rollout
    bounds = None
    if cfg.fp8_plan.needs_calibration(rollout.activation_scheme):
        prompts = [prompt_token_ids(r, tokenizer) for r in train_records[:CALIBRATION_PROMPTS]]
        bounds = calibration_forward(actor, prompts)
    actor.publisher.publish(
        lambda tensors: write_rollout_checkpoint(tensors, Path(cfg.model.hf_path), rollout_model_path(cfg),
                                                 cfg.fp8_plan, rollout.activation_scheme),
        bounds if cfg.fp8_plan.static_per_tensor(rollout.activation_scheme) else None)
    dist.barrier()
