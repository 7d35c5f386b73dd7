"""The 'exact' FP8 GEMM (fp8/linear.py) at SmolLM2-135M's decoder linears, as SGLang's aligned
rollouts run it: weight codes kept in fp32 and widened to fp64 per call (before 07e27bf) against
kept in fp64 (rollout/sglang_fp8.py now), with a plain fp32 GEMM of the same shapes as the
baseline measured in the same run. One thread; per decoder layer (qkv, o, gate_up, down).

    python bench/exact_gemm.py [--rows 16 600] [--repeat 30]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp8rl.fp8.linear import fp8_matmul_nt  # noqa: E402
from megatron_fp8rl.fp8.quantize import Fp8Tensor  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""SmolLM2-135M's fused decoder linears, [N, K]."""


def _ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 600], help="activation rows (decode, prefill)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    one = torch.tensor(1.0)
    print(f"{'rows':>5} {'fp32 codes':>11} {'fp64 codes':>11} {'fp32 GEMM':>10}  fp64/fp32-codes  fp64-codes/fp32-GEMM")
    for rows in args.rows:
        total = {"fp32": 0.0, "fp64": 0.0, "gemm": 0.0}
        for n, k in SHAPES.values():
            x = torch.randn(rows, k, generator=gen).to(torch.float8_e4m3fn)
            w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
            a = Fp8Tensor(x, one, "tensor")
            kept32, kept64 = Fp8Tensor(w, one, "tensor", dense=w.float()), Fp8Tensor(w, one, "tensor", dense=w.double())
            if not torch.equal(fp8_matmul_nt(a, kept32, "exact"), fp8_matmul_nt(a, kept64, "exact")):
                raise SystemExit("fp32 and fp64 weight codes gave different bits")
            xf, wf = x.float(), w.float()
            total["fp32"] += _ms(lambda: fp8_matmul_nt(a, kept32, "exact"), args.repeat)
            total["fp64"] += _ms(lambda: fp8_matmul_nt(a, kept64, "exact"), args.repeat)
            total["gemm"] += _ms(lambda: xf @ wf.t(), args.repeat)
        print(f"{rows:>5} {total['fp32']:>9.2f}ms {total['fp64']:>9.2f}ms {total['gemm']:>8.2f}ms  "
              f"{total['fp64'] / total['fp32']:>15.2f}x  {total['fp64'] / total['gemm']:>19.2f}x")


if __name__ == "__main__":
    main()
