"""Benchmark: what the SHA-256 manifest adds to a training checkpoint's save (and to its load check).

One process (gloo, TP=1) builds a Megatron GPT (default ~110M parameters: 8 layers of hidden 1024,
vocabulary 16k), takes one optimizer step so Adam's state exists, then ROUNDS times:
  save: `trainer.checkpoint.save_checkpoint` as the trainer calls it (dist_checkpointing.save of
  model + distributed-optimizer state, trainer_state.json, the manifest, the rename), timed whole;
  manifest: `write_manifest` of the saved folder again, timed alone (the files were just written,
  so they are in the page cache, as they are when save_checkpoint hashes them);
  verify: `verify_manifest` of the folder (what a resume pays before loading).
Prints the checkpoint size, the best of each, hashing seconds per GB, and the manifest's share of
the save measured in the same run. Needs ~2x the checkpoint size of free disk under --workdir.

    python bench/checkpoint_manifest.py [--layers N] [--hidden N] [--rounds N] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

VOCAB, SEQ = 16384, 64


def _forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _loss(batch, per_token_loss):
    loss = per_token_loss.float().mean()
    return loss, {"loss": loss}


def _trained_model(layers: int, hidden: int):
    """Model and optimizer after one step (so the optimizer state a checkpoint holds exists)."""
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    config = tiny_transformer_config(num_layers=layers, hidden_size=hidden, num_attention_heads=16,
                                     num_query_groups=8, ffn_hidden_size=hidden * 11 // 4)
    model = wrap_ddp(build_gpt_model(config, VOCAB, SEQ), distributed_optimizer=True)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, distributed_optimizer=True))
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(SEQ).expand(2, SEQ).contiguous()}
    train_step(model, optimizer, [batch], _forward, _loss, SEQ, micro_batch_size=2)
    return model, optimizer


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from megatron_fp8rl.convert.integrity import verify_manifest, write_manifest
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed
    from megatron_fp8rl.trainer.checkpoint import CheckpointConfig, save_checkpoint

    init_distributed(1, 1, seed=0)
    workdir = Path(tempfile.mkdtemp(prefix="bench_manifest_", dir=args.workdir))
    try:
        model, optimizer = _trained_model(args.layers, args.hidden)
        cfg = CheckpointConfig(dir=str(workdir), every=1, keep_last=1)
        times = {"save": [], "manifest": [], "verify": []}
        for step in range(1, args.rounds + 1):
            folder = []
            times["save"].append(_timed(lambda: folder.append(
                save_checkpoint(cfg, step, model, optimizer, {"note": "bench"}))))
            times["manifest"].append(_timed(lambda: write_manifest(folder[0])))
            times["verify"].append(_timed(lambda: verify_manifest(folder[0])))
        gigabytes = sum(p.stat().st_size for p in folder[0].rglob("*") if p.is_file()) / 1e9
        best = {name: min(values) for name, values in times.items()}
        print(f"[bench] checkpoint of {args.layers} layers x hidden {args.hidden}: {gigabytes:.2f} GB, "
              f"{len(list(folder[0].rglob('*')))} files; best of {args.rounds} rounds")
        print(f"[bench] save_checkpoint (manifest included): {best['save']:.2f} s")
        print(f"[bench] write_manifest alone: {best['manifest']:.2f} s = "
              f"{best['manifest'] / gigabytes:.2f} s/GB; {100 * best['manifest'] / best['save']:.0f}% of the save")
        print(f"[bench] verify_manifest (resume): {best['verify']:.2f} s = {best['verify'] / gigabytes:.2f} s/GB")
    finally:
        shutdown_distributed()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
