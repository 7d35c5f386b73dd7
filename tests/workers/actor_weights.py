"""torchrun worker: the actor's in-memory weight stream at TP/PP layouts equals the checkpoint
round trip (save_weights + hf_tensors), with dist_checkpointing unusable while it runs.

For each layout tpXppY and each architecture folder ARCH (WORKDIR/ARCH/hf): convert it in process
(trainer.actor.convert_initial_checkpoint), build a MegatronActor at that layout (world size /
(X*Y) data-parallel replicas), move every parameter off its converted value (per-rank noise, so a
piece sent from the wrong rank or placed at the wrong offset shows), then stream
`publisher.hf_tensors_in_memory()` on every rank with dist_checkpointing's save and load and the
construction of any transformers model replaced by functions that raise, and compare rank 0's stream with `hf_tensors(save_weights(...))`: same HF
names in the same order, bit-equal tensors. Rank 0 writes WORKDIR/ARCH/result_<layout>.json.
"""
from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def no_checkpoint_and_no_other_model():
    """dist_checkpointing's save and load, and building any transformers model, raise."""
    from megatron.core import dist_checkpointing
    from transformers import PreTrainedModel

    def refuse(what):
        def raising(*args, **kwargs):
            raise AssertionError(f"{what} ran during the in-memory weight stream")
        return raising

    saved = dist_checkpointing.save, dist_checkpointing.load, PreTrainedModel.__init__
    dist_checkpointing.save = refuse("dist_checkpointing.save")
    dist_checkpointing.load = refuse("dist_checkpointing.load")
    PreTrainedModel.__init__ = refuse("a transformers model")
    try:
        yield
    finally:
        dist_checkpointing.save, dist_checkpointing.load, PreTrainedModel.__init__ = saved


def check(folder: Path, tag: str, fp8: str) -> None:
    import torch.distributed as dist

    from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
    from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig
    from megatron_fp8rl.trainer.config import ModelConfig, TrainConfig
    from megatron_fp8rl.trainer.objective import Objective

    init = convert_initial_checkpoint(folder / "hf", folder / f"init_{tag}")
    actor = MegatronActor(init, ModelConfig(hf_path=str(folder / "hf"), fp8=fp8), TrainConfig(),
                          Objective(AlgorithmConfig(), max_response_length=8))
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for param in actor.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    with no_checkpoint_and_no_other_model():
        memory = list(actor.publisher.hf_tensors_in_memory())
    directory = actor.save_weights(folder / f"sync_{tag}")
    if dist.get_rank() != 0:
        assert memory == [], f"rank {dist.get_rank()} yielded {len(memory)} tensors"
        return
    disk = list(actor.publisher.hf_tensors(directory))
    names = [name for name, _ in memory]
    assert names == [name for name, _ in disk], (names, [name for name, _ in disk])
    for (name, ours), (_, theirs) in zip(memory, disk):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), f"{tag}: {name} differs"
    (folder / f"result_{tag}.json").write_text(json.dumps({"tensors": len(memory), "names": names}))


def main(args) -> None:
    from tests.helpers.layouts import each_layout

    for tag in each_layout(args.layouts):
        for arch in args.archs:
            check(Path(args.workdir) / arch, tag, args.fp8)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--layouts", nargs="+", required=True, help="e.g. tp1pp1 tp2pp2")
    parser.add_argument("--archs", nargs="+", required=True)
    parser.add_argument("--fp8", default="none")
    main(parser.parse_args())
