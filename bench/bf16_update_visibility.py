"""How much of an optimizer update a bf16 forward sees, per kind of parameter: a candidate cause of
the study's bf16 reference learning less than float32 and every FP8 arm (results/stability_v3/moderate2).

Megatron bf16 mixed precision keeps float32 master weights but runs the forward (and serves SGLang)
with their bf16 rounding; the FP8 arms keep float32 outside the FP8 GEMMs (norms, embeddings). A
master weight that moves by d changes the bf16 forward only once it crosses a bf16 rounding
boundary. For each kind of parameter of the model (embeddings, RMSNorm gains, attention and MLP
linears) this applies k updates of ±lr (Adam's step is about lr per element; random signs, the
same sign for all k steps, the largest move k steps can make) and prints:
    bf16-exact  the share of elements already on the bf16 grid (a checkpoint stored in bf16: all)
    moved       the share of elements whose bf16 rounding changed
    seen        Σ (bf16(w + d) − bf16(w))·d / Σ d²: the share of the update the bf16 forward sees
                (1: all of it, on average; 0: none)
A weight on the bf16 grid sees nothing until |d| exceeds half its bf16 spacing (|w|·2^-9 to |w|·2^-8).

    python bench/bf16_update_visibility.py [--model .cache/smollm2] [--lr 1e-5] [--steps 1,4,24]
(--steps 24 is the moderate2 job's updates: 12 steps x 2 mini-batches.)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
SAMPLE = 5_000_000
"""Elements drawn per kind (all of a kind with fewer)."""


def kind_of(name: str) -> str:
    for key, kind in (("embed", "embedding"), ("norm", "norm gain"), ("self_attn", "attention linear"),
                      ("mlp", "MLP linear"), ("lm_head", "embedding")):
        if key in name:
            return kind
    return "other"


def visibility(weights: torch.Tensor, update: torch.Tensor) -> tuple[float, float]:
    """(share of elements whose bf16 rounding moved, share of the update the bf16 forward sees)."""
    before, after = weights.bfloat16().float(), (weights + update).bfloat16().float()
    seen = float(((after - before).double() * update.double()).sum() / (update.double() ** 2).sum())
    return float((after != before).float().mean()), seen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / ".cache" / "smollm2"))
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", default="1,4,24")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = Path(args.model) / "model.safetensors"
    if not path.is_file():
        parser.error(f"--model {args.model}: no model.safetensors")
    steps = [int(s) for s in args.steps.split(",")]
    generator = torch.Generator().manual_seed(args.seed)
    kinds: dict[str, list[torch.Tensor]] = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            kinds.setdefault(kind_of(name), []).append(f.get_tensor(name).float().flatten())
    shown = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    print(f"{shown}: {args.lr:g} x k updates of random sign (bf16 forward of float32 master weights)")
    print("| kind | elements | mean abs | bf16-exact | " + " | ".join(f"k={k}: moved / seen" for k in steps) + " |")
    print("|---|---|---|---|" + "---|" * len(steps))
    for kind, parts in sorted(kinds.items()):
        weights = torch.cat(parts)
        if weights.numel() > SAMPLE:
            weights = weights[torch.randperm(weights.numel(), generator=generator)[:SAMPLE]]
        sign = torch.randint(0, 2, weights.shape, generator=generator).float() * 2 - 1
        cells = [f"{m:.1%} / {s:.2f}" for m, s in (visibility(weights, sign * args.lr * k) for k in steps)]
        exact = float((weights.bfloat16().float() == weights).float().mean())
        print(f"| {kind} | {sum(p.numel() for p in parts)} | {weights.abs().mean():.3g} | {exact:.0%} | "
              + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
