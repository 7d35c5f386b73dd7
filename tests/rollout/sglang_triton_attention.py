"""What SGLang's Triton attention kernels compute for one request alone and inside a batch, run
as a script (prints one JSON line): on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, set
before triton is first imported: SGLang wraps its kernels at import), or on a GPU (`--device
cuda`, the GPU kit's attention step).

Measured, per kernel SGLang's triton backend runs with `enable_deterministic_inference`:
- `extend_attention_fwd_unified` (its deterministic prefill): max error against a float64 causal
  softmax reference, and whether request 0's rows are bit-identical alone and in a 2-request batch;
- `decode_attention_fwd` with the deterministic split rule (num_kv_splits = ceil(len / 256) per
  request): error, bits alone vs in the batch, and whether another split count changes the bits
  (it does: so the trainer must reproduce SGLang's split rule, not only its kernel).
Usage: python -m tests.rollout.sglang_triton_attention [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os

HEADS, KV_HEADS, DIM = 4, 2, 64
LENGTHS = (300, 200)  # request 0 spans 2 deterministic decode splits of 256
SPLIT_TILE = 256
"""SGLang's deterministic decode split size (SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE default)."""


def _reference(torch, q, k, v):
    """float64 causal softmax attention: q [T, H, D], k/v [L, KVH, D] (GQA by repetition)."""
    k, v = (t.double().repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
    scores = (q.double().transpose(0, 1) @ k.permute(1, 2, 0)) * DIM ** -0.5  # [H, T, L]
    t, length = q.shape[0], k.shape[0]
    scores = scores.masked_fill(torch.ones(t, length, dtype=bool, device=q.device).triu(length - t + 1), float("-inf"))
    return (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1)


def _layout(torch, reqs, device):
    """Lengths, first KV slots, kv_indptr and kv_indices of requests `reqs` (each request's keys
    are its own contiguous slots of the cache)."""
    lengths = [LENGTHS[r] for r in reqs]
    starts = [sum(LENGTHS[:r]) for r in reqs]
    indptr = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    indices = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).int().to(device)
    return lengths, starts, indptr, indices


def _extend(torch, fwd, q, kv, reqs, device):
    """Unified extend over whole prompts `reqs` (no cached prefix)."""
    k_buf, v_buf = kv
    lengths, starts, indptr, indices = _layout(torch, reqs, device)
    query = torch.cat([q[s:s + n] for s, n in zip(starts, lengths)])
    out = torch.empty_like(query)
    fwd(query, out, k_buf, v_buf, 1.0, 1.0, indptr, indptr, indices,
        torch.zeros(len(reqs), dtype=torch.int32, device=device), max(lengths), sm_scale=DIM ** -0.5)
    return out


def _decode(torch, fwd, q, kv, reqs, device, splits=None):
    """One decode step of requests `reqs` (query = each request's last row) over their keys."""
    k_buf, v_buf = kv
    lengths, starts, indptr, indices = _layout(torch, reqs, device)
    query = torch.stack([q[s + n - 1] for s, n in zip(starts, lengths)])
    if splits is None:  # SGLang's deterministic rule
        splits = [(n + SPLIT_TILE - 1) // SPLIT_TILE for n in lengths]
    max_splits = 8
    out = torch.empty_like(query)
    logits = torch.empty(len(reqs), HEADS, max_splits, DIM, device=device)
    lse = torch.empty(len(reqs), HEADS, max_splits, device=device)
    fwd(query, k_buf, v_buf, out, indptr, indices, logits, lse,
        torch.tensor(splits, dtype=torch.int32, device=device), max_splits, DIM ** -0.5, 1.0, 1.0)
    return out


def measure(device: str) -> dict:
    import torch

    from megatron_fp8rl.compat import sglang_cpu

    if device == "cpu":
        sglang_cpu.install()
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd_unified

    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, DIM, generator=gen).to(device)
    kv = tuple(torch.randn(total, KV_HEADS, DIM, generator=gen).to(device) for _ in range(2))
    n0 = LENGTHS[0]
    both = _extend(torch, extend_attention_fwd_unified, q, kv, [0, 1], device)
    alone = _extend(torch, extend_attention_fwd_unified, q, kv, [0], device)
    reference = _reference(torch, q[:n0], kv[0][:n0], kv[1][:n0])
    dec_both = _decode(torch, decode_attention_fwd, q, kv, [0, 1], device)
    dec_alone = _decode(torch, decode_attention_fwd, q, kv, [0], device)
    dec_other = _decode(torch, decode_attention_fwd, q, kv, [0], device, splits=[3])
    return {
        "extend_error": (alone.double() - reference).abs().max().item(),
        "extend_alone_equals_batch": bool(torch.equal(alone, both[:n0])),
        "decode_error": (dec_alone[0].double() - reference[-1]).abs().max().item(),
        "decode_alone_equals_batch": bool(torch.equal(dec_alone[0], dec_both[0])),
        "decode_other_splits_equal": bool(torch.equal(dec_alone[0], dec_other[0])),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("CPU tensors need TRITON_INTERPRET=1 in the environment (set before triton is imported)")
    print(json.dumps(measure(args.device)))
