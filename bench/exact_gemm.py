"""The CPU tier's batch-invariant FP8 GEMMs (fp8/gemm.py) at SmolLM2-135M's decoder linears, as
SGLang's aligned rollouts run them, against a plain fp32 GEMM of the same shapes measured in the
same run. One thread; per decoder layer (qkv, o, gate_up, down); two layouts: per-tensor scales
(the calibrated recipe) and 1x32 groups (groupwise32, the demo's default).

- exact, fp32 codes: 'exact' with the weight codes kept in fp32, widened to fp64 per call
  (per-tensor only; before 07e27bf)
- exact, fp64 codes: 'exact' with the codes kept in fp64 (what SGLang kept until 'tiled')
- tiled: 'tiled' with the codes (per tensor) or dequantized values (1x32) kept in fp32 (what
  'batch_invariant' runs on CPU now, SGLang's kept weights)
- fp32 GEMM: x @ w^T of the same values, no scales (the floor)

Checks, exiting non-zero on a failure: 'exact' gives the same bits from fp32 and fp64 codes;
'tiled' gives a row the same bits alone as among the others.

    python bench/exact_gemm.py [--rows 16 600] [--repeat 30]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp8rl.fp8.formats import E4M3  # noqa: E402
from megatron_fp8rl.fp8.gemm import fp8_matmul_nt  # noqa: E402
from megatron_fp8rl.fp8.quantize import Fp8Tensor, quantize_blockwise, transposed_codes  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""SmolLM2-135M's fused decoder linears, [N, K]."""
COLUMNS = ("exact32", "exact64", "tiled", "gemm")


def _ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def _operands(layout: str, rows: int, n: int, k: int, gen: torch.Generator):
    """(x, {column: weight operand}, x values, w values) for one linear."""
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    if layout == "tensor":
        one = torch.tensor(1.0)
        a, codes = Fp8Tensor(x.to(torch.float8_e4m3fn), one, "tensor"), w.to(torch.float8_e4m3fn)
        weights = {"exact32": Fp8Tensor(codes, one, "tensor", dense=codes.float()),
                   "exact64": Fp8Tensor(codes, one, "tensor", dense=codes.double()),
                   "tiled": Fp8Tensor(codes, one, "tensor", dense=codes.float())}
        return a, weights, a.data.float(), codes.float()
    a, b = quantize_blockwise(x, E4M3, (1, 32)), quantize_blockwise(w, E4M3, (1, 32))
    codes_t = transposed_codes(b.data)
    weights = {"exact64": Fp8Tensor(b.data, b.scale_inv, "block", b.block, dense_t=codes_t.double()),
               "tiled": Fp8Tensor(b.data, b.scale_inv, "block", b.block, values=b.dequantize())}
    return a, weights, a.data.float(), b.data.float()


def _check(layout: str, a: Fp8Tensor, weights: dict) -> None:
    if "exact32" in weights and not torch.equal(fp8_matmul_nt(a, weights["exact32"], "exact"),
                                                fp8_matmul_nt(a, weights["exact64"], "exact")):
        raise SystemExit(f"{layout}: fp32 and fp64 weight codes gave 'exact' different bits")
    full = fp8_matmul_nt(a, weights["tiled"], "tiled")
    row = Fp8Tensor(a.data[-1:], a.scale_inv if a.granularity == "tensor" else a.scale_inv[-1:], a.granularity, a.block)
    if not torch.equal(fp8_matmul_nt(row, weights["tiled"], "tiled"), full[-1:]):
        raise SystemExit(f"{layout}: 'tiled' gave the last row other bits alone than among the others")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 600], help="activation rows (decode, prefill)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{'layout':>7} {'rows':>5} {'exact,fp32 codes':>17} {'exact,fp64 codes':>17} {'tiled':>9} "
          f"{'fp32 GEMM':>10}  exact64/GEMM  tiled/GEMM  tiled/exact64")
    for layout in ("tensor", "1x32"):
        for rows in args.rows:
            total = dict.fromkeys(COLUMNS, 0.0)
            for n, k in SHAPES.values():
                a, weights, xf, wf = _operands(layout, rows, n, k, gen)
                _check(layout, a, weights)
                for column, weight in weights.items():
                    gemm = "tiled" if column == "tiled" else "exact"
                    total[column] += _ms(lambda: fp8_matmul_nt(a, weight, gemm), args.repeat)
                total["gemm"] += _ms(lambda: xf @ wf.t(), args.repeat)
            cells = [f"{total[c]:.2f}ms" if total[c] else "-" for c in COLUMNS]
            print(f"{layout:>7} {rows:>5} {cells[0]:>17} {cells[1]:>17} {cells[2]:>9} {cells[3]:>10}  "
                  f"{total['exact64'] / total['gemm']:>11.2f}x  {total['tiled'] / total['gemm']:>9.2f}x  "
                  f"{total['tiled'] / total['exact64']:>12.2f}x")


if __name__ == "__main__":
    main()
