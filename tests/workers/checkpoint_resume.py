"""torchrun worker: train the tiny GPT with checkpoints; optionally SIGKILL itself mid-step; resume.

  run    WORKDIR TAG --steps N [--ckpt-every K] [--kill-at S] [--resume]
Writes WORKDIR/TAG.json: {step: loss} for the steps this process completed. Batches are drawn from
torch's global RNG, so a resumed run reproduces the uninterrupted one only if RNG state, model and
optimizer state all come back.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from megatron_fp8rl.launch import init_distributed, shutdown_distributed

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH = 64, 12, 8, 2


def _forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _loss(batch, per_token_loss):
    loss = per_token_loss.float().mean()
    return loss, {"loss": loss}


def main(args) -> None:
    from megatron.core import parallel_state

    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
    from megatron_fp8rl.trainer.checkpoint import (
        CheckpointConfig, load_checkpoint, newest_intact_checkpoint, save_checkpoint,
    )
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    layout = init_distributed(args.tp, 1, seed=11)
    model = wrap_ddp(build_gpt_model(tiny_transformer_config(), VOCAB, SEQ), distributed_optimizer=True)
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3, distributed_optimizer=True))
    cfg = CheckpointConfig(dir=args.resume or str(Path(args.workdir) / f"ckpt_{args.tag}"),
                           every=args.ckpt_every, keep_last=2)
    start = 0
    if args.resume:
        start = load_checkpoint(newest_intact_checkpoint(args.resume)[0], model, optimizer)["step"]
    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout.data_parallel
    losses = {}
    out = Path(args.workdir) / f"{args.tag}.json"
    for step in range(start + 1, args.steps + 1):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1)).chunk(dp)[dp_rank]
        batches = [{"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(),
                    "position_ids": torch.arange(SEQ).expand(mb.shape[0], SEQ).contiguous()}
                   for mb in tokens.split(MICRO_BATCH)]
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        losses[step] = train_step(model, optimizer, batches, _forward, _loss, SEQ, MICRO_BATCH).metrics["loss"]
        if layout.rank == 0:
            out.write_text(json.dumps(losses))
        if args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(cfg, step, model, optimizer, {"note": "test"})
    shutdown_distributed()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("tag")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--resume", default="")
    parser.add_argument("--tp", type=int, default=1)
    main(parser.parse_args())
