"""The CPU demo until the RL trainer lands: the real Megatron-Core GPT, trained with Megatron's
optimizer at the launch layout (TP/PP/DP), on a built-in sequence task, with progress and
tensorboard logs.

The task: each sequence is an arithmetic progression modulo the vocabulary (x, x+d, x+2d, ...);
predicting the next token needs the stride d read from context, so the loss falls from ln(vocab)
towards 0 only if attention works. Owns nothing the RL trainer will need beyond this file.
Must not import: cli.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import parallel_state
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the CPU demo."""

    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per step, split over data-parallel ranks and micro-batches."""
    micro_batch: int = 4
    """Sequences per micro-batch."""
    seq_length: int = 24
    """Tokens per sequence."""
    vocab_size: int = 64
    """Vocabulary (the modulus of the progressions)."""
    lr: float = 3e-3
    """Adam learning rate."""
    seed: int = 1234
    """Data seed (the model seed is set at launch)."""
    run_dir: Path = Path("runs/demo")
    """Where tensorboard logs go."""


def progression_batch(cfg: DemoConfig, generator: torch.Generator) -> torch.Tensor:
    """[global_batch, seq_length + 1] token ids: (start + stride * i) mod vocab."""
    start = torch.randint(0, cfg.vocab_size, (cfg.global_batch, 1), generator=generator)
    stride = torch.randint(1, cfg.vocab_size // 4, (cfg.global_batch, 1), generator=generator)
    return (start + stride * torch.arange(cfg.seq_length + 1)) % cfg.vocab_size


def _micro_batches(tokens: torch.Tensor, cfg: DemoConfig) -> list[dict[str, torch.Tensor]]:
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    mine = tokens.chunk(dp_size)[dp_rank]
    positions = torch.arange(cfg.seq_length)
    return [
        {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(),
         "position_ids": positions.expand(mb.shape[0], -1).contiguous()}
        for mb in mine.split(cfg.micro_batch)
    ]


def _forward(chunk: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _loss(batch: dict[str, torch.Tensor], per_token_loss: torch.Tensor):
    loss = per_token_loss.float().mean()
    # skip the first two positions: the stride is not yet determined there
    tail = per_token_loss[:, 2:].float().mean()
    return loss, {"loss": loss, "loss_after_stride": tail}


def run_demo(cfg: DemoConfig, is_logging_rank: bool) -> dict[str, float]:
    """Train the tiny GPT for `cfg.steps` steps; return first/last losses and timing."""
    model = build_gpt_model(tiny_transformer_config(), cfg.vocab_size, cfg.seq_length)
    ddp = wrap_ddp(model, distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimConfig(lr=cfg.lr, distributed_optimizer=True))
    generator = torch.Generator().manual_seed(cfg.seed)
    writer = SummaryWriter(str(cfg.run_dir)) if is_logging_rank else None
    history: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="demo", disable=not is_logging_rank)
    for step in bar:
        step_start = time.perf_counter()
        micro = _micro_batches(progression_batch(cfg, generator), cfg)
        result = train_step(ddp, optimizer, micro, _forward, _loss, cfg.seq_length, len(micro[0]["tokens"]))
        history.append(result.metrics["loss_after_stride"])
        bar.set_postfix(loss=f"{result.metrics['loss']:.3f}", gnorm=f"{result.grad_norm:.2f}")
        if writer is not None:
            for name, value in result.metrics.items():
                writer.add_scalar(f"train/{name}", value, step)
            writer.add_scalar("train/grad_norm", result.grad_norm, step)
            writer.add_scalar("time/step_s", time.perf_counter() - step_start, step)
    if writer is not None:
        writer.close()
    return {
        "initial_loss": history[0],
        "final_loss": history[-1],
        "uniform_loss": math.log(cfg.vocab_size),
        "seconds": time.perf_counter() - start,
    }
