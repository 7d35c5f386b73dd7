"""A batch-invariant FP8 GEMM in Triton: y = A_fp8 @ B_fp8^T with per-tensor or group / block scales.

Owns: `triton_fp8_matmul_nt` (the host function: operand checks, launch), `gemm_launch` (what it
launches, without launching: bench/kernel_audit.py compiles from it), its kernel
`_fp8_gemm_nt_kernel` and `_block_dot`, the one place where the CPU interpreter and the GPU differ;
the 'triton_invariant' GEMM of fp8/linear.py.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch and triton only;
triton is imported by the one module that needs it, so fp8/ itself stays importable without it).

Arithmetic, A [M, K] and B [N, K] FP8 (E4M3 or E5M2), y [M, N] fp32 or bf16 (`out_dtype`: the
epilogue rounds the fp32 result once, to nearest even, in integer arithmetic: the interpreter's
float casts truncate, so a plain cast would give the CPU other bits than the GPU; the bits equal
`y_fp32.to(torch.bfloat16)`):
- per tensor (`group=None`): y = (sum_k a[m, k] * b[n, k]) * sa * sb, sa and sb fp32 0-d dequant
  multipliers; the sum accumulates in fp32 across K;
- groups (`group=G`, G in GROUPS: 32 or 128): A with 1xG group scales sa [M, ceil(K/G)]
  (activations, per token); B with GxG block scales sb [ceil(N/G), ceil(K/G)] (the DeepSeek /
  SGLang `weight_scale_inv` layout at G = 128) or, with `b_rows`, 1xG group scales sb
  [N, ceil(K/G)] (the `groupwise` / `groupwise32` recipes):
  y = sum_g (sum_{k in group g} a b) * sa[m, g] * sb[n // G or n, g], each group's partial sum
  scaled and added to the fp32 accumulator in K order. K need not be a multiple of G (a ragged
  last group: the loads past K read zeros).
Batch invariance by construction: one fixed tile configuration (TILE, LAUNCH) whatever the shapes,
no split-K, and each program walks K in the same order from k = 0, so y[m, :] depends only on A's
row m (and its scales) and on B: the same bits whether row m is multiplied alone, in a batch of 64,
or at another position in the batch (tests/fp8/test_triton_gemm.py on CPU; on an H200 rows of
M = 1..1000 equal those of M = 4096, ../shared/DESIGN.md). Products of FP8 values are exact in
fp32; on the GPU the MMA promotes its partial sums into the fp32 accumulator every PROMOTE_K K
elements.
One kernel body for CPU and GPU: everything but `_block_dot` (a tile's a @ b added to the
accumulator) is the same code in both; `_block_dot`'s docstring says why the interpreter sums
differently there.
Where it runs: CUDA tensors compile for the GPU; CPU tensors only under Triton's interpreter
(`TRITON_INTERPRET=1`). triton 3.x reads that variable when `triton.jit` wraps a function: the
kernel and `_block_dot` are wrapped at first use, once per mode, never at import (`_wrapped`), and
call only triton's builtins (`tl.full`, not `tl.zeros`, which triton.language wraps with
`triton.jit` when it is first imported), so whether the interpreter runs them depends on the
variable at call time only, not on which module imported triton first. CPU tensors without the
interpreter raise: there is no silent fallback to another GEMM, whose rows would depend on the batch.
APIs used exist in triton 3.6 (the GPU machine's) as in 3.9 (the CPU tier's).
"""
from __future__ import annotations

import functools
import math
import types

import torch
import triton
import triton.language as tl

TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}
"""The one tile shape every call uses (changing it with M would change rows' bits). BLOCK_K is the
K step of the loop; scale groups narrower than it (1x32) are summed as BLOCK_K / G sub-steps."""
LAUNCH = {"num_warps": 4, "num_stages": 3}
"""GPU launch options, fixed for the same reason."""
PROMOTE_K = 128
"""`tl.dot`'s max_num_imprecise_acc: Hopper's FP8 MMA adds its partial sums into the fp32
accumulator at least every PROMOTE_K K elements (cuBLAS and DeepGEMM promote every 128 too).
Measured on an H200 (../shared/DESIGN.md): 0 (promote every instruction) 440-456 TFLOP/s
per-tensor, 128: 770-812, rows still bit-invariant, max error equal to cuBLAS's. Grouped scales
promote at each group anyway (each group's partial sum is scaled into the accumulator)."""
GROUPS = (32, 128)
"""Scale group widths along K the kernel takes (1xG activations; 1xG or GxG weights)."""
SWIZZLE_M = 8
"""Programs walk the tiles in bands of SWIZZLE_M row tiles so that neighbours reuse B's tiles in
L2; which program computes a tile changes no bit of it."""
OUT_DTYPES = (torch.float32, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_ELEMENTS = 2**31
"""Offsets are 32-bit in the kernel: operands and output must hold fewer elements."""
K_ALIGN = 16
"""Operands' K is padded with zero codes to a multiple of this (`_k_padded`)."""


def _block_dot(a, b, acc, ROW_SUMS: tl.constexpr, PROMOTE: tl.constexpr):
    """acc + a @ b in fp32, a [BM, BK] and b [BK, BN] FP8 tiles: the kernel's only code that
    differs between GPU and CPU.

    GPU (ROW_SUMS False): `tl.dot`, the FP8 tensor cores, promoting into acc every PROMOTE K.
    Interpreter (ROW_SUMS True): `tl.dot` there is numpy's matmul, i.e. the host's BLAS, whose
    float32 kernels need not sum every row of a tile in the same order (on an AMD EPYC box,
    OpenBLAS's Haswell sgemm, rows 6-15 of each 16 came out in other bits than rows 0-5), so a
    row's bits would depend on its position in the batch and the CPU tests could not check
    invariance. Here the exact products [BM, BN, BK] are summed per output element by halving K
    log2(BK) times (reshape, split, add): the same tree for every row, builtins only (`tl.sum` is
    itself `triton.jit`-wrapped at import, module docstring). The sums are fp32 in both; only
    their order differs, which the bounds of the tests allow for."""
    if ROW_SUMS:
        part = tl.permute(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], (0, 2, 1))
        while part.shape[2] > 1:  # shapes inline: the interpreter turns assigned ints into tensors
            pairs = tl.split(tl.reshape(part, (part.shape[0], part.shape[1], part.shape[2] // 2, 2)))
            part = pairs[0] + pairs[1]
        return acc + tl.reshape(part, (part.shape[0], part.shape[1]))
    return tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)


def _fp8_gemm_nt_kernel(a_ptr, b_ptr, y_ptr, sa_ptr, sb_ptr, M, N, K,
                        stride_am, stride_bn, stride_ym, stride_sam, stride_sbn,
                        GROUP: tl.constexpr, SB_ROWS: tl.constexpr, ROW_SUMS: tl.constexpr,
                        PROMOTE: tl.constexpr, SWIZZLE: tl.constexpr, OUT_BF16: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y, K walked in order from 0 (module docstring). GROUP 0:
    per-tensor scales applied in the epilogue; else the width of the K groups, each group's
    partial sum scaled into the accumulator; SB_ROWS: rows of b per row of its scales (1 or G)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N
    band = pid // (SWIZZLE * tiles_n)
    band_rows = tl.minimum(tiles_m - band * SWIZZLE, SWIZZLE)
    pid_m = band * SWIZZLE + (pid % (SWIZZLE * tiles_n)) % band_rows
    pid_n = (pid % (SWIZZLE * tiles_n)) // band_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    STEP: tl.constexpr = BLOCK_K if GROUP == 0 else GROUP
    ks = tl.arange(0, STEP)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: see the module docstring
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // STEP):
            kk = k0 + j * STEP + ks
            a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + cols[None, :] * stride_bn + kk[:, None],  # B^T's [STEP, BLOCK_N] tile
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
            if GROUP == 0:
                acc = _block_dot(a, b, acc, ROW_SUMS, PROMOTE)
            else:
                # a sub-step past K (K < BLOCK_K apart) reads zero codes: its scales' index is
                # clamped to the last group, whose product with the zero sum adds nothing
                g = tl.minimum((k0 + j * STEP) // GROUP, (K - 1) // GROUP)
                a_scale = tl.load(sa_ptr + rows * stride_sam + g, mask=rows < M, other=0.0)
                b_scale = tl.load(sb_ptr + (cols // SB_ROWS) * stride_sbn + g, mask=cols < N, other=0.0)
                part = _block_dot(a, b, tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), ROW_SUMS, PROMOTE)
                acc += part * a_scale[:, None] * b_scale[None, :]
    if GROUP == 0:
        acc = acc * tl.load(sa_ptr) * tl.load(sb_ptr)
    if OUT_BF16:  # round to nearest even in integer arithmetic (same bits on CPU and GPU), then an exact cast
        bits = acc.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        acc = tl.where(acc == acc, bits.to(tl.float32, bitcast=True), acc)  # NaN stays NaN
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@functools.cache
def _wrapped(interpret: bool):
    """The kernel wrapped by `triton.jit` while `knobs.runtime.interpret == interpret` (the flag
    is the cache key: triton picks interpreter or compiler at wrapping time), calling a
    `_block_dot` wrapped in the same mode: the kernel is a copy of `_fp8_gemm_nt_kernel` (same
    code, so the same source for triton) over a copy of this module's globals in which
    `_block_dot` names that wrapper. M is not specialized: triton would otherwise compile M == 1
    and M % 16 == 0 as other variants, and one compiled kernel for every batch size is the point."""
    scope = dict(globals())
    scope["_block_dot"] = triton.jit(_block_dot)
    fn = _fp8_gemm_nt_kernel
    kernel = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    kernel.__doc__, kernel.__qualname__, kernel.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    kernel.__annotations__ = fn.__annotations__  # which parameters are tl.constexpr: a launch reads them here
    return triton.jit(kernel, do_not_specialize=["M"])


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


def _check_scales(a, b, sa, sb, group: int | None, b_rows: bool) -> None:
    (m, k), n = a.shape, b.shape[0]
    operands = f"a {tuple(a.shape)}, b {tuple(b.shape)}"
    check = functools.partial(_check_scale, device=a.device)
    if group is None:
        if b_rows:
            raise ValueError("triton_invariant FP8 GEMM: b_rows (1xG groups for b) needs group=G")
        check("sa", sa, (), operands + " with per-tensor scales")
        check("sb", sb, (), operands + " with per-tensor scales")
        return
    if group not in GROUPS:
        raise ValueError(f"triton_invariant FP8 GEMM: group {group} for {operands}; the kernel has groups {GROUPS}")
    groups = math.ceil(k / group)
    check("sa", sa, (m, groups), operands + f" with 1x{group} group scales")
    if b_rows:
        check("sb", sb, (n, groups), operands + f" with 1x{group} group scales")
    else:
        check("sb", sb, (math.ceil(n / group), groups), operands + f" with {group}x{group} block scales")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it (on its device) when its data does not start on a 16-byte boundary:
    triton compiles another variant of the kernel for unaligned pointers (other loads, possibly
    other MMA instructions), so rows viewed at an odd offset in a batch could get other bits than
    the same rows at its start."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _k_padded(t: torch.Tensor) -> torch.Tensor:
    """t [R, K], or a copy with zero codes up to the next multiple of K_ALIGN columns. The kernel
    then holds the same tiles (its masked loads past K read zeros too) and the same scale groups
    (G is a multiple of K_ALIGN), so no bit of y changes; but its loads are specialized for
    16-divisible strides: with K = 50 (a wgrad over an RL micro-batch's tokens) the compiled
    kernel used 255 registers and spilled ~1 KB per thread (bench/kernel_audit.py)."""
    k = t.shape[1]
    if k % K_ALIGN == 0:
        return t
    padded = t.new_zeros(t.shape[0], triton.cdiv(k, K_ALIGN) * K_ALIGN)
    padded[:, :k] = t
    return padded


def triton_fp8_matmul_nt(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                         group: int | None = None, b_rows: bool = False,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] (`out_dtype`: float32 or bfloat16) = a [M, K] @ b [N, K]^T dequantized by the
    scales (module docstring): per tensor (0-d sa, sb), or with `group` G in GROUPS 1xG groups for
    a and GxG blocks for b (`b_rows`: 1xG groups for b too). ValueError naming the shapes for
    anything else; RuntimeError on CPU without TRITON_INTERPRET=1."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"triton_invariant FP8 GEMM: out_dtype {out_dtype}; the epilogue writes {OUT_DTYPES}")
    _check_operands(a, b)
    _check_scales(a, b, sa, sb, group, b_rows)
    kernel, interpret = _kernel(a.device)
    y, grid, args, options = gemm_launch(a, b, sa, sb, group, b_rows, out_dtype, interpret)
    if grid[0]:
        kernel[grid](*args, **options)
    return y


def gemm_launch(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, group: int | None = None,
                b_rows: bool = False, out_dtype: torch.dtype = torch.float32, interpret: bool = False) -> tuple:
    """What `triton_fp8_matmul_nt` launches for checked operands, without launching: (y, grid,
    the kernel's positional and keyword arguments; `interpret`: the interpreter's variant).
    Allocates only, so meta tensors work (bench/kernel_audit.py compiles every variant from it)."""
    a, b = (_k_padded(_aligned(t)) for t in (a, b))
    sa, sb = _aligned(sa), _aligned(sb)
    (m, k), n = a.shape, b.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, TILE["BLOCK_M"]) * triton.cdiv(n, TILE["BLOCK_N"]),)
    scale_strides = (sa.stride(0), sb.stride(0)) if group is not None else (0, 0)
    args = (a, b, y, sa, sb, m, n, k, a.stride(0), b.stride(0), y.stride(0), *scale_strides)
    options = dict(GROUP=group or 0, SB_ROWS=1 if b_rows or group is None else group, ROW_SUMS=interpret,
                   PROMOTE=min(PROMOTE_K, group or TILE["BLOCK_K"]), SWIZZLE=SWIZZLE_M,
                   OUT_BF16=out_dtype == torch.bfloat16, **TILE, **LAUNCH)
    return y, grid, args, options
