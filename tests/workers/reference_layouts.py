"""torchrun worker: the reference policy at the actor's TP/PP layout. For each layout tpXppY: convert
WORKDIR/hf in process into WORKDIR/<layout>/init_megatron, build the actor and its reference
(trainer.reference.build_reference), and compare on a 5-sequence batch: the reference's log-probs
equal the actor's recomputed old log-probs bit for bit on the last pipeline stage, and every rank
holds the last stage's values (the reference broadcasts them along the pipeline). Rank 0 writes
WORKDIR/result_<layout>.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _batch():
    from megatron_fp8rl.rollout.engine import RolloutSample
    from megatron_fp8rl.trainer.batch import build_batch

    generator = torch.Generator().manual_seed(5)
    samples = [RolloutSample(row, torch.randint(3, 120, (3,), generator=generator).tolist(),
                             torch.randint(3, 120, (2 + row,), generator=generator).tolist(), [-1.0] * (2 + row),
                             "length", 0) for row in range(5)]
    return build_batch(samples, torch.zeros(5), 3 + 6)


def check(workdir: Path, tag: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
    from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig, KLConfig
    from megatron_fp8rl.trainer.config import ModelConfig, TrainConfig
    from megatron_fp8rl.trainer.objective import Objective
    from megatron_fp8rl.trainer.reference import build_reference

    run = workdir / tag
    convert_initial_checkpoint(workdir / "hf", run / "init_megatron")
    model_cfg = ModelConfig(hf_path=str(workdir / "hf"))
    actor = MegatronActor(run / "init_megatron", model_cfg, TrainConfig(micro_batch_size=2),
                          Objective(AlgorithmConfig(), max_response_length=8))
    reference = build_reference(KLConfig(coef=0.01), run, actor, model_cfg, 2, "auto")
    batch = _batch()
    ref, old = reference.logprobs(batch, {}), actor.old_logprobs(batch)
    if parallel_state.is_pipeline_last_stage():
        assert torch.equal(ref, old), f"{tag}: reference differs from the actor's recompute"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ref)
    assert all(torch.equal(other, everyone[-1]) for other in everyone), f"{tag}: ranks hold different values"
    assert bool((ref[batch.response_mask.bool()] < 0).all()), f"{tag}: not log-probs"
    if dist.get_rank() == 0:
        (workdir / f"result_{tag}.json").write_text(json.dumps({"ranks": len(everyone)}))


def main(args) -> None:
    from tests.helpers.layouts import each_layout

    for tag in each_layout(args.layouts):
        check(Path(args.workdir), tag)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--layouts", nargs="+", required=True, help="e.g. tp2pp1 tp1pp2")
    main(parser.parse_args())
