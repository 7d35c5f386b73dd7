"""The trained weights as a Hugging Face checkpoint at the end of a run.

Owns: `export_hf`. Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_fp8rl.convert.integrity import write_manifest
from megatron_fp8rl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.config import RunConfig


def export_hf(cfg: RunConfig, actor: MegatronActor, rank: int) -> Path:
    """All ranks (collective): the actor's weights as an HF checkpoint at <run_dir>/hf (config and
    tokenizer from the starting checkpoint), through a torch_dist checkpoint at
    <run_dir>/final_megatron; returns the HF folder."""
    final = actor.save_weights(Path(cfg.run_dir) / "final_megatron")
    output = Path(cfg.run_dir) / "hf"
    if rank == 0:
        write_manifest(final)
        convert_megatron_to_hf(final, output, hf_config_dir=Path(cfg.model.hf_path),
                               overwrite=True, progress=False)
    dist.barrier()
    return output
