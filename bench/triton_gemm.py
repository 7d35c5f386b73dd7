"""The batch-invariant Triton FP8 GEMM ('triton_invariant', fp8/triton_gemm.py) against
torch._scaled_mm (cuBLASLt, per-tensor scales, fp32 output, no fast accumulation), at Qwen3-8B's
linear shapes, as a throughput ratio measured in the same run; plus its checks at each shape's
smallest token count: max |triton - exact| over the fp32-accumulation bound (<= 1 expected;
tests/fp8/test_triton_gemm.py derives it) and whether the first rows computed alone equal the same
rows in the batch, bit for bit.

Prints one line per (linear, tokens): milliseconds of each GEMM (median), ratio
scaled_mm time / triton time (the issue's target: >= 0.8), and the triton kernel's TFLOP/s.
On CPU (`--device cpu`) the kernel runs under Triton's interpreter, which this script switches on:
tiny shapes, the checks only; its times say nothing about GPU speed (CI runs it so it does not rot).

Run: python bench/triton_gemm.py [--tokens 16,256,4096] [--reps 50]        (a CUDA GPU)
     python bench/triton_gemm.py --device cpu                              (interpreter smoke)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

QWEN3_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
"""Qwen3-8B linears as (N, K): hidden 4096, 32 query / 8 KV heads of 128, MLP 12288 (fused gate+up)."""
TINY = {"qkv": (192, 128), "down": (128, 320)}
"""CPU smoke shapes (ragged against the 128-column tile and the 128-deep K step)."""
U = 2.0**-24


def _operands(m: int, n: int, k: int, device: str, seed: int = 0):
    from megatron_fp8rl.fp8.formats import E4M3
    from megatron_fp8rl.fp8.quantize import quantize_per_tensor

    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.02
    return quantize_per_tensor(x.to(device), E4M3), quantize_per_tensor(w.to(device), E4M3)


def _median_ms(fn, reps: int, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, rep=max(reps, 1), return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def check(a, b) -> dict:
    """Bound ratio against the 'exact' GEMM and bit-identity of rows alone vs in the batch."""
    from megatron_fp8rl.fp8.gemm import fp8_matmul_nt
    from megatron_fp8rl.fp8.quantize import Fp8Tensor

    y = fp8_matmul_nt(a, b, "triton_invariant")
    exact = fp8_matmul_nt(a, b, "exact")
    magnitude = a.dequantize().double().abs() @ b.dequantize().double().abs().t()
    bound = (a.data.shape[1] + 4) * U * magnitude
    rows = min(3, a.data.shape[0])
    alone = fp8_matmul_nt(Fp8Tensor(a.data[:rows].contiguous(), a.scale_inv, "tensor"), b, "triton_invariant")
    return {"bound_ratio": ((y.double() - exact.double()).abs() / bound).max().item(),
            "rows_invariant": bool(torch.equal(alone, y[:rows]))}


def bench_shape(name: str, n: int, k: int, m: int, reps: int, device: str) -> dict:
    from megatron_fp8rl.fp8.triton_gemm import triton_fp8_matmul_nt

    a, b = _operands(m, n, k, device)
    triton_ms = _median_ms(lambda: triton_fp8_matmul_nt(a.data, b.data, a.scale_inv, b.scale_inv), reps, device)
    scaled_ms = _median_ms(lambda: torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                                                    out_dtype=torch.float32), reps, device)
    return {"linear": name, "tokens": m, "n": n, "k": k, "triton_ms": triton_ms, "scaled_mm_ms": scaled_ms,
            "ratio": scaled_ms / triton_ms, "tflops": 2 * m * n * k / triton_ms / 1e9}


def run(device: str, shapes: dict, tokens: list[int], reps: int) -> list[dict]:
    """One row per (linear, tokens), the checks on each linear's smallest token count."""
    rows = []
    for name, (n, k) in shapes.items():
        for m in tokens:
            row = bench_shape(name, n, k, m, reps, device)
            if m == min(tokens):
                row.update(check(*_operands(m, n, k, device, seed=1)))
            rows.append(row)
            checks = (f"   bound ratio {row['bound_ratio']:.3f}  rows invariant {row['rows_invariant']}"
                      if "bound_ratio" in row else "")
            print(f"{name:8s} M={m:5d} N={n:6d} K={k:6d}  triton {row['triton_ms']:9.3f} ms  scaled_mm "
                  f"{row['scaled_mm_ms']:9.3f} ms  ratio {row['ratio']:5.2f}x  {row['tflops']:7.1f} TFLOP/s{checks}",
                  flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tokens", default=None, help="comma-separated M values (GPU default 16,256,4096)")
    parser.add_argument("--reps", type=int, default=None, help="GPU: do_bench ms budget; CPU: repetitions")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is first wrapped (fp8/triton_gemm.py)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for the interpreter smoke")
    default_tokens = "16,256,4096" if args.device == "cuda" else "3,17"
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    shapes = QWEN3_8B if args.device == "cuda" else TINY
    run(args.device, shapes, tokens, args.reps or (100 if args.device == "cuda" else 1))


if __name__ == "__main__":
    main()
