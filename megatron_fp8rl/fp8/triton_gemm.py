"""A batch-invariant FP8 GEMM in Triton: y = A_fp8 @ B_fp8^T with per-tensor or block scales.

Owns: `triton_fp8_matmul_nt` (the host function: operand checks, launch) and its kernel
`_fp8_gemm_nt_kernel`, the 'triton_invariant' GEMM of fp8/linear.py.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch and triton only;
triton is imported by the one module that needs it, so fp8/ itself stays importable without it).

Arithmetic, A [M, K] and B [N, K] FP8 (E4M3 or E5M2), y [M, N] fp32:
- per tensor: y = (sum_k a[m, k] * b[n, k]) * sa * sb, sa and sb fp32 0-d dequant multipliers;
- block: A with 1x128 group scales sa [M, K/128] (activations, per token), B with 128x128 block
  scales sb [ceil(N/128), K/128] (the DeepSeek / SGLang `weight_scale_inv` layout):
  y = sum_g (sum_{k in group g} a b) * sa[m, g] * sb[n // 128, g], each group's partial sum
  promoted to the fp32 accumulator before the next (K must be a multiple of 128); or B with 1x128
  group scales sb [N, K/128] (the `groupwise` recipe: each output channel's K in groups of 128),
  then y = sum_g (sum_{k in group g} a b) * sa[m, g] * sb[n, g].
Batch invariance by construction: one fixed tile configuration (TILE) whatever the shapes, no
split-K, and each program walks K in the same order from k = 0, so y[m, :] depends only on A's
row m and on B: the same bits whether row m is multiplied alone, in a batch of 64, or at another
position in the batch (tests/fp8/test_triton_gemm.py). Under the interpreter `tl.dot` is numpy's
matmul, i.e. the host's BLAS, whose float32 kernels need not sum every row of a tile in the same
order: on an AMD EPYC box (OpenBLAS's Haswell sgemm kernel) rows 6-15 of each 16 came out in other
bits than rows 0-5, so a row's bits depended on its position in the batch. Under the interpreter
(CPU tensors, or CUDA ones with TRITON_INTERPRET=1) the kernel therefore sums each block's exact
products per output element itself: a [BLOCK_M, BLOCK_N, 128] product tensor halved seven times
(reshape, split, add), the same tree for every row, with builtins only (`tl.sum` is itself
`triton.jit`-wrapped, see below); compiled kernels keep `tl.dot`. Products of FP8 values are exact
in fp32; the sums are fp32 (`max_num_imprecise_acc=0` asks Hopper's FP8 MMA to promote every
instruction to the fp32 accumulator, as `torch._scaled_mm` does without `use_fast_accum`).
Where it runs: CUDA tensors compile for the GPU; CPU tensors only under Triton's interpreter
(`TRITON_INTERPRET=1`). triton 3.x reads that variable when `triton.jit` wraps a function: this
kernel is wrapped at first use, once per mode, never at import; and it calls only triton's
builtins (`tl.full`, not `tl.zeros`, which triton.language wraps with `triton.jit` when it is first
imported), so whether the interpreter runs it depends on the variable at call time only, not on
which module imported triton first. CPU tensors without the interpreter raise: there is no silent
fallback to another GEMM, whose rows would depend on the batch.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}
"""The one tile shape every call uses (changing it with M would change rows' bits)."""
LAUNCH = {"num_warps": 4, "num_stages": 3}
"""GPU launch options, fixed for the same reason."""
GROUP = 128
"""Scale group along K (1x128 activations, 128x128 weights); equal to BLOCK_K and BLOCK_N."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_ELEMENTS = 2**31
"""Offsets are 32-bit in the kernel: operands and output must hold fewer elements."""


def _fp8_gemm_nt_kernel(a_ptr, b_ptr, y_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                        stride_am, stride_bn, stride_ym, stride_asm, stride_bsn,
                        BLOCK_SCALED: tl.constexpr, B_ROW_SCALED: tl.constexpr, ROW_SUMS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y, K walked in order from 0 (module docstring). ROW_SUMS:
    each block's products summed pairwise over K per output element instead of `tl.dot`."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + ks[:, None]  # B^T's [BLOCK_K, BLOCK_N] tile
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: see the module docstring
    for k0 in range(0, K, BLOCK_K):
        k_in = ks < K - k0
        a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
        if ROW_SUMS:  # exact products [BLOCK_M, BLOCK_N, BLOCK_K], K summed pairwise: same tree for every row
            part = tl.permute(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], (0, 2, 1))
            tl.static_assert(BLOCK_K == 128, "ROW_SUMS halves K = 128 seven times")
            for width in (64, 32, 16, 8, 4, 2, 1):
                pairs = tl.split(tl.reshape(part, (BLOCK_M, BLOCK_N, width, 2)))
                part = pairs[0] + pairs[1]
            part = tl.reshape(part, (BLOCK_M, BLOCK_N))
        if BLOCK_SCALED:
            a_scale = tl.load(a_scale_ptr + rows * stride_asm + k0 // BLOCK_K, mask=rows < M, other=0.0)
            if B_ROW_SCALED:
                b_scale = tl.load(b_scale_ptr + cols * stride_bsn + k0 // BLOCK_K, mask=cols < N, other=0.0)
            else:
                b_scale = tl.load(b_scale_ptr + pid_n * stride_bsn + k0 // BLOCK_K)
            if not ROW_SUMS:  # the per-tensor path below accumulates inside tl.dot instead
                part = tl.dot(a, b, max_num_imprecise_acc=0)
            if B_ROW_SCALED:
                acc += part * a_scale[:, None] * b_scale[None, :]
            else:
                acc += part * a_scale[:, None] * b_scale
        elif ROW_SUMS:
            acc += part
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=0)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALED:
        acc = acc * tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@functools.cache
def _wrapped(interpret: bool):
    """The kernel wrapped by `triton.jit` while `knobs.runtime.interpret == interpret` (the flag
    is the cache key: triton picks interpreter or compiler at wrapping time). M is not
    specialized: triton would otherwise compile M == 1 and M % 16 == 0 as other variants, and one
    compiled kernel for every batch size is the point."""
    return triton.jit(_fp8_gemm_nt_kernel, do_not_specialize=["M"])


def _kernel(device: torch.device):
    """(the wrapped kernel, whether it runs under the interpreter) for tensors on `device`."""
    interpret = bool(triton.knobs.runtime.interpret)
    if device.type == "cpu" and not interpret:
        raise RuntimeError(
            "triton_invariant FP8 GEMM: CPU tensors run only under Triton's interpreter and "
            "TRITON_INTERPRET is not set to 1 in this process; set it (tests, the CPU bench) or use "
            "gemm='tiled', the CPU tier's batch-invariant GEMM"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"triton_invariant FP8 GEMM: tensors on {device} are not supported (cuda, or cpu "
                           "under TRITON_INTERPRET=1)")
    return _wrapped(interpret), interpret


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    shapes = f"a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"triton_invariant FP8 GEMM: expects a [M, K] and b [N, K]; found {shapes}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"triton_invariant FP8 GEMM: operands must be float8_e4m3fn/e5m2; found {shapes}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"triton_invariant FP8 GEMM: operands must be contiguous (row-major [M, K], [N, K]); "
                         f"found {shapes} with strides a {a.stride()}, b {b.stride()}")
    if a.device != b.device:
        raise ValueError(f"triton_invariant FP8 GEMM: a on {a.device}, b on {b.device}")
    if max(a.numel(), b.numel(), a.shape[0] * b.shape[0]) >= MAX_ELEMENTS:
        raise ValueError(f"triton_invariant FP8 GEMM: {shapes}: operands and output must hold fewer "
                         f"than 2**31 elements (32-bit offsets)")


def _check_scale(name: str, scale: torch.Tensor, want: tuple, operands: str, device: torch.device) -> None:
    if (scale.dtype != torch.float32 or tuple(scale.shape) != want or not scale.is_contiguous()
            or scale.device != device):
        raise ValueError(f"triton_invariant FP8 GEMM: {name} must be a contiguous float32 tensor of shape {want} "
                         f"on {device} for {operands}; found {scale.dtype} {tuple(scale.shape)} on {scale.device}"
                         f"{'' if scale.is_contiguous() else ', not contiguous'}")


def _check_scales(a, b, a_scale_inv, b_scale_inv, block_scaled: bool, b_row_scaled: bool) -> None:
    (m, k), n = a.shape, b.shape[0]
    operands = f"a {tuple(a.shape)}, b {tuple(b.shape)}"
    check = functools.partial(_check_scale, device=a.device)
    if not block_scaled:
        check("a_scale_inv", a_scale_inv, (), operands + " with per-tensor scales")
        check("b_scale_inv", b_scale_inv, (), operands + " with per-tensor scales")
        return
    if k % GROUP:
        raise ValueError(f"triton_invariant FP8 GEMM: block scales need K a multiple of {GROUP}; found {operands}")
    check("a_scale_inv", a_scale_inv, (m, k // GROUP), operands + f" with 1x{GROUP} group scales")
    if b_row_scaled:
        check("b_scale_inv", b_scale_inv, (n, k // GROUP), operands + f" with 1x{GROUP} group scales")
    else:
        check("b_scale_inv", b_scale_inv, (math.ceil(n / GROUP), k // GROUP),
              operands + f" with {GROUP}x{GROUP} block scales")


def triton_fp8_matmul_nt(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                         b_scale_inv: torch.Tensor, block_scaled: bool = False,
                         b_row_scaled: bool = False) -> torch.Tensor:
    """y [M, N] fp32 = a [M, K] @ b [N, K]^T dequantized by the scales (module docstring):
    per tensor (0-d scale_invs), or with `block_scaled` 1x128 groups for a and 128x128 blocks
    for b (`b_row_scaled`: 1x128 groups for b too). ValueError naming the shapes for anything
    else; RuntimeError on CPU without TRITON_INTERPRET=1."""
    if b_row_scaled and not block_scaled:
        raise ValueError("triton_invariant FP8 GEMM: b_row_scaled needs block_scaled (1x128 groups for a)")
    _check_operands(a, b)
    _check_scales(a, b, a_scale_inv, b_scale_inv, block_scaled, b_row_scaled)
    kernel, interpret = _kernel(a.device)
    (m, k), n = a.shape, b.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, TILE["BLOCK_M"]), triton.cdiv(n, TILE["BLOCK_N"]))
    scale_strides = (a_scale_inv.stride(0), b_scale_inv.stride(0)) if block_scaled else (0, 0)
    kernel[grid](a, b, y, a_scale_inv, b_scale_inv, m, n, k, a.stride(0), b.stride(0), y.stride(0),
                 *scale_strides, BLOCK_SCALED=block_scaled, B_ROW_SCALED=b_row_scaled,
                 ROW_SUMS=interpret, **TILE, **LAUNCH)
    return y
