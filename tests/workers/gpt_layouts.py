"""torchrun worker: train the tiny GPT at a given TP/PP/DP layout from a shared initial checkpoint.

Modes:
  reference  (1 process): build the model from the seed, save its initial weights with
             dist_checkpointing to WORKDIR/init, train STEPS steps, write WORKDIR/<tag>.json.
  compare    (N processes): load WORKDIR/init (resharding to this layout), save it again to
             WORKDIR/resaved_<tag> (initial weights at this layout), train, write WORKDIR/<tag>.json.
  verify     (1 process): load WORKDIR/resaved_<tag> at TP=1 and compare every tensor bit for bit
             with WORKDIR/init; write WORKDIR/verify_<tag>.json.
Every layout sees the same global batch: GLOBAL_BATCH sequences split into micro-batches, and
split over data-parallel ranks. `--dtype bfloat16` runs Megatron bf16 mixed precision; the json
then also records the dtypes the model, the optimizer's master weights and the grads live in.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_fp8rl.launch import init_distributed, shutdown_distributed

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH = 128, 16, 8, 2


def _global_batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def _micro_batches(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> list[dict]:
    mine = tokens.chunk(dp_size)[dp_rank]
    return [
        {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(),
         "position_ids": torch.arange(SEQ).expand(mb.shape[0], SEQ).contiguous()}
        for mb in mine.split(MICRO_BATCH)
    ]


def _forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _loss(batch, per_token_loss):
    loss = per_token_loss.float().mean()
    return loss, {"lm_loss": loss.detach()}


def _build(dtype: str):
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config

    config = tiny_transformer_config(params_dtype=getattr(torch, dtype))
    return build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)


def _precision(ddp, optimizer) -> dict[str, list[str]]:
    """The dtypes of the weights the forward uses, of the optimizer's (master) parameters and of
    the gradients the optimizer reads."""
    master = [p for chained in optimizer.chained_optimizers
              for group in chained.optimizer.param_groups for p in group["params"]]
    return {
        "model": sorted({str(p.dtype) for p in ddp.parameters()}),
        "master": sorted({str(p.dtype) for p in master}),
        "main_grad": sorted({str(p.main_grad.dtype) for p in ddp.parameters()}),
    }


def _load_into(model, path: Path) -> None:
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(path)))


def _save(model, path: Path) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(path))


def train(args) -> None:
    from megatron.core import parallel_state

    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    layout = init_distributed(args.tp, args.pp, seed=args.seed)
    workdir = Path(args.workdir)
    model = _build(args.dtype)
    if args.mode == "reference":
        _save(model, workdir / "init")
    else:
        _load_into(model, workdir / "init")
        _save(model, workdir / f"resaved_{args.tag}")
    ddp = wrap_ddp(model, distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimConfig(lr=3e-3, clip_grad=1.0, distributed_optimizer=True))
    dp_rank = parallel_state.get_data_parallel_rank()
    history = []
    for tokens in _global_batches(args.steps):
        result = train_step(ddp, optimizer, _micro_batches(tokens, dp_rank, layout.data_parallel),
                            _forward, _loss, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        history.append({"lm_loss": result.metrics["lm_loss"], "grad_norm": result.grad_norm})
    if layout.rank == 0:
        result = {"history": history, "precision": _precision(ddp, optimizer)}
        (workdir / f"{args.tag}.json").write_text(json.dumps(result))
    shutdown_distributed()


def verify(args) -> None:
    init_distributed(1, 1, seed=args.seed + 1)  # a different seed: weights must come from disk
    workdir = Path(args.workdir)
    reference, resaved = _build(args.dtype), _build(args.dtype)
    _load_into(reference, workdir / "init")
    _load_into(resaved, workdir / f"resaved_{args.tag}")
    ref_sd, new_sd = reference.state_dict(), resaved.state_dict()
    mismatched = [k for k, v in ref_sd.items()
                  if isinstance(v, torch.Tensor) and not torch.equal(v, new_sd[k])]
    compared = sum(isinstance(v, torch.Tensor) for v in ref_sd.values())
    (workdir / f"verify_{args.tag}.json").write_text(
        json.dumps({"compared": compared, "mismatched": mismatched}))
    shutdown_distributed()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reference", "compare", "verify"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tag", default="tp1")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    cli_args = parser.parse_args()
    (verify if cli_args.mode == "verify" else train)(cli_args)
