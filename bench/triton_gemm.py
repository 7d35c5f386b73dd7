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

`--audit` (no GPU needed) compiles the kernel's GPU path for sm_90a (H100 / H200) with the
specialization a launch at a Qwen3-8B shape gets (16-byte aligned pointers, N, K and strides
divisible by 16, M not specialized), one variant per scale layout, and prints a markdown table
from ptxas's report and the SASS (`audit_variant`): registers, spill bytes, shared memory, CTAs per
SM, wgmma instructions, ptxas's serialization notes (C7514 / C7517: a `wgmma.wait_group` injected
or wgmmas serialized because non-wgmma instructions read their accumulators) and how many FP32
add / multiply instructions issue while a wgmma group is in flight (between WARPGROUP.ARRIVE and
WARPGROUP.DEPBAR) against all of them: the promotion overlapping tensor-core work or not.

Run: python bench/triton_gemm.py [--tokens 16,256,4096] [--reps 50]        (a CUDA GPU)
     python bench/triton_gemm.py --device cpu                              (interpreter smoke)
     python bench/triton_gemm.py --audit                                   (sm_90a compile, no GPU)
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch

QWEN3_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
"""Qwen3-8B linears as (N, K): hidden 4096, 32 query / 8 KV heads of 128, MLP 12288 (fused gate+up)."""
TINY = {"qkv": (192, 128), "down": (128, 320)}
"""CPU smoke shapes (ragged against the 128-column tile and the 128-deep K step)."""
U = 2.0**-24
AUDIT_VARIANTS = {"per tensor": (0, 1), "1x128 x 128x128": (128, 128), "1x128 x 1x128": (128, 1),
                  "1x32 x 1x32": (32, 1), "1x32 x 32x32": (32, 32)}
"""Scale layouts the device path launches, as the kernel's (GROUP, SB_ROWS)."""
SM90 = {"registers": 65536, "shared_bytes": 232448, "reserved_shared_per_cta": 1024}
"""An H100 / H200 SM: 64K 32-bit registers, 227 KB shared memory per CTA + 1 KB reserved per CTA."""


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


def compile_sm90(group: int, sb_rows: int, n: int = 4096, k: int = 4096):
    """The kernel's GPU path compiled for sm_90a as a bf16-out launch with a [M, k] x [n, k] FP8
    pair gets it (fp8/triton_gemm.py's constants; 16-byte divisibility where the values have it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from megatron_fp8rl.fp8 import triton_gemm

    kernel = triton_gemm._wrapped(False)
    tile, launch = triton_gemm.kernel_config(group or None)
    scale_stride = math.ceil(k / group) if group else 0
    ints = dict(M=None, N=n, K=k, stride_am=k, stride_bn=k, stride_ym=n, stride_sam=scale_stride,
                stride_sbn=scale_stride)
    signature = dict.fromkeys(ints, "i32")
    signature.update(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", y_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32")
    constants = dict(GROUP=group, SB_ROWS=sb_rows, ROW_SUMS=False, PROMOTE=min(triton_gemm.PROMOTE_K, group or 128),
                     SWIZZLE=triton_gemm.SWIZZLE_M, OUT_BF16=True, **tile)
    signature.update(dict.fromkeys(constants, "constexpr"))
    aligned = [name for name in kernel.arg_names
               if name.endswith("_ptr") or (ints.get(name) or 1) % 16 == 0 and ints.get(name)]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(launch))


def _nvidia_tool(name: str, *args: str) -> str:
    """stdout + stderr of one of the CUDA tools triton ships (ptxas, nvdisasm)."""
    import triton

    tool = getattr(triton.knobs.nvidia, name).path
    done = subprocess.run([tool, *args], capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def overlap_counts(sass: str) -> tuple[int, int]:
    """(FP32 add / multiply / fma instructions issued between a WARPGROUP.ARRIVE and the next
    WARPGROUP.DEPBAR, i.e. while wgmmas run; all of them) in nvdisasm's listing."""
    inside = in_flight = total = 0
    for op in re.findall(r"\b(WARPGROUP\.ARRIVE|WARPGROUP\.DEPBAR|FADD|FMUL|FFMA)\b", sass):
        if op.startswith("WARPGROUP"):
            in_flight = op == "WARPGROUP.ARRIVE"
            continue
        total += 1
        inside += in_flight
    return inside, total


def audit_variant(group: int, sb_rows: int) -> dict:
    """ptxas's report and SASS counts of one compiled variant (module docstring)."""
    compiled = compile_sm90(group, sb_rows)
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        log = _nvidia_tool("ptxas_blackwell", "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(folder, "v.cubin"))
        sass = _nvidia_tool("nvdisasm", "-c", cubin)
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    registers_per_cta = math.ceil(registers * 32 / 256) * 256 * warps  # allocated per warp in units of 256
    inside, total = overlap_counts(sass)
    return {"registers": registers, "spill_stores": stores, "spill_loads": loads, "shared": shared,
            "ctas_per_sm": min(SM90["registers"] // registers_per_cta,
                               SM90["shared_bytes"] // (shared + SM90["reserved_shared_per_cta"])),
            "wgmma": len(re.findall(r"\b[HQ]GMMA\.", sass)), "depbar": sass.count("WARPGROUP.DEPBAR"),
            "ptxas_notes": sorted(set(re.findall(r"\((C75\d\d)\)", log))), "fp_in_flight": inside, "fp_total": total}


def audit_table() -> str:
    """The markdown table of `audit_variant` over AUDIT_VARIANTS, with each variant's tile and warps."""
    from megatron_fp8rl.fp8 import triton_gemm

    lines = [f"PROMOTE_K {triton_gemm.PROMOTE_K}; compiled as a bf16-out launch at N = K = 4096", "",
             "| scales | tile (M x N x K), warps, stages | registers | spill stores / loads (B) | shared (B) | "
             "CTAs/SM | wgmma (SASS) | WARPGROUP.DEPBAR | ptxas notes | FP32 add/mul/fma in flight / all |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (group, sb_rows) in AUDIT_VARIANTS.items():
        row = audit_variant(group, sb_rows)
        tile, launch = triton_gemm.kernel_config(group or None)
        config = (f"{tile['BLOCK_M']}x{tile['BLOCK_N']}x{tile['BLOCK_K']}, {launch['num_warps']}, "
                  f"{launch['num_stages']}")
        cells = [name, config, row["registers"], f"{row['spill_stores']} / {row['spill_loads']}", row["shared"],
                 row["ctas_per_sm"], row["wgmma"], row["depbar"], ", ".join(row["ptxas_notes"]) or "-",
                 f"{row['fp_in_flight']} / {row['fp_total']}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tokens", default=None, help="comma-separated M values (GPU default 16,256,4096)")
    parser.add_argument("--reps", type=int, default=None, help="GPU: do_bench ms budget; CPU: repetitions")
    parser.add_argument("--audit", action="store_true", help="compile for sm_90a (no GPU) and print ptxas's report")
    args = parser.parse_args()
    if args.audit:
        os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter, wraps the kernel
        print(audit_table())
        return
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
