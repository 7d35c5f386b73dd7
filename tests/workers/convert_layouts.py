"""torchrun worker: load converted HF checkpoints at TP/PP layouts and save them again there, and
convert the HF checkpoints in process at each layout as the trainer does.

For each layout tpXppY given (one process group, Megatron's parallel state re-initialized per
layout; world size / (X*Y) data-parallel replicas) and each architecture folder ARCH under
WORKDIR: build the Megatron model of ARCH/hf/config.json at that layout (fp32 parameters), load
ARCH/mcore (written by the HF -> Megatron conversion at TP=1 from bf16 safetensors) with
dist_checkpointing, which reshards on load, and save the loaded model to ARCH/resaved_tpXppY
(chunks at that layout). Then convert ARCH/hf to ARCH/initial_tpXppY with
trainer.actor.convert_initial_checkpoint, every rank contributing its shard's chunks.
Run with nproc = the largest X*Y (4 for TP2xPP2).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def resave(workdir: Path, arch: str, tag: str) -> None:
    from megatron.core import dist_checkpointing

    from megatron_fp8rl.models.hf import build_model_from_hf

    folder = workdir / arch
    hf_config = json.loads((folder / "hf" / "config.json").read_text())
    model = build_model_from_hf(hf_config, params_dtype=torch.float32)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(folder / "mcore")))
    out = folder / f"resaved_{tag}"
    out.mkdir(exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))


def main(args) -> None:
    from megatron_fp8rl.trainer.actor import convert_initial_checkpoint
    from tests.helpers.layouts import each_layout

    for tag in each_layout(args.layouts):
        for arch in args.archs:
            resave(Path(args.workdir), arch, tag)
            folder = Path(args.workdir) / arch
            convert_initial_checkpoint(folder / "hf", folder / f"initial_{tag}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--layouts", nargs="+", required=True, help="e.g. tp1pp1 tp2pp2")
    parser.add_argument("--archs", nargs="+", required=True)
    main(parser.parse_args())
