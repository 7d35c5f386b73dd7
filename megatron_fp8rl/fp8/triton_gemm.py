"""A batch-invariant FP8 GEMM in Triton: y = A_fp8 @ B_fp8^T with per-tensor or group / block scales.

Owns: `triton_fp8_matmul_nt` (the host function: operand checks, launch), `gemm_launch` (what it
launches, without launching: bench/kernel_audit.py compiles from it), its kernel
`_fp8_gemm_nt_kernel` and its helpers (`_tile_product`, the one place where the CPU interpreter and
the GPU differ); the 'triton_invariant' GEMM of fp8/gemm.py.
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
Batch invariance by construction: one fixed tile configuration per scale layout (`kernel_config`)
whatever the shapes, no split-K, and each program walks K in the same order from k = 0, so y[m, :]
depends only on A's row m (and its scales) and on B: the same bits whether row m is multiplied
alone, in a batch of 64, or at another position in the batch (tests/fp8/test_triton_gemm.py on
CPU; on an H200, before the per-tensor tile became 128 rows, rows of M = 1..1000 equalled those of
M = 4096, docs/gpu.md). Products of FP8 values are exact in
fp32; on the GPU the MMA sums PROMOTE_K K elements in its own accumulator, which the kernel then
adds to its fp32 accumulator (per tensor one K step late, so that the addition overlaps the next
step's MMA: results/kernel_audit/invariant_gemm.md).
One kernel body for CPU and GPU: everything but `_tile_product` (a tile's a @ b) is the same code in
both; its docstring says why the interpreter sums differently there.
Where it runs: CUDA tensors compile for the GPU; CPU tensors only under Triton's interpreter
(`TRITON_INTERPRET=1`). triton 3.x reads that variable when `triton.jit` wraps a function: the
kernel and its helpers are wrapped at first use, once per mode, never at import (`_wrapped`), and
call only triton's builtins (`tl.full`, not `tl.zeros`, which triton.language wraps with
`triton.jit` when it is first imported), so whether the interpreter runs them depends on the
variable at call time only, not on which module imported triton first. CPU tensors without the
interpreter raise: there is no silent fallback to another GEMM, whose rows would depend on the batch.
APIs used exist in triton 3.6 (the GPU machine's) as in 3.9 (the CPU tier's).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from megatron_fp8rl.fp8.triton_quantize import with_globals

PER_TENSOR_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}
"""The tile of every per-tensor call (changing it with M would change rows' bits): 128 rows over two
warpgroups (8 warps, 64 rows each) sharing each B tile; each K step's product is added to the fp32
accumulator one step late, while the next step's wgmma runs (the kernel's docstring). BLOCK_K is the
K step of the loop."""
PER_TENSOR_LAUNCH = {"num_warps": 8, "num_stages": 4}
"""GPU launch options of per-tensor calls, fixed for the same reason (sm_90a: 238 registers, no
spills, 128 KB shared memory, 1 CTA per SM; results/kernel_audit/invariant_gemm.md)."""
GROUPED_TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}
"""The tile of every call with 1xG / GxG scales: one warpgroup, each group's product scaled into the
accumulator at once (scale groups narrower than BLOCK_K, 1x32, as BLOCK_K / G sub-steps). The
one-step-late promotion carries the product and its scales across a step, which made ptxas spill
here and at 128 rows (results/kernel_audit/invariant_gemm.md)."""
GROUPED_LAUNCH = {"num_warps": 4, "num_stages": 3}
"""GPU launch options of calls with group / block scales (sm_90a: 168-232 registers, no spills)."""
PROMOTE_K = 128
"""The FP8 MMA sums at most PROMOTE_K K elements in its own accumulator before the kernel adds them
to its fp32 accumulator (cuBLAS and DeepGEMM promote every 128 too): the K step per tensor, the
group width with scales (each group's partial sum is scaled into the accumulator). Measured on an
H200 (docs/gpu.md) with promotion inside `tl.dot` (max_num_imprecise_acc): 0 (every instruction)
440-456 TFLOP/s per-tensor, 128: 770-812, rows still bit-invariant, max error equal to cuBLAS's."""
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


def kernel_config(group: int | None) -> tuple[dict, dict]:
    """(tile, launch options) of a call with `group` (None: per tensor): fixed per scale layout,
    never chosen by M, so a row's bits do not depend on the batch."""
    return (PER_TENSOR_TILE, PER_TENSOR_LAUNCH) if group is None else (GROUPED_TILE, GROUPED_LAUNCH)


def _row_tree_sums(a, b):
    """a @ b for the interpreter, a [R, BK] and b [BK, BN] FP8 tiles: the exact products [R, BN, BK]
    summed per output element by halving K log2(BK) times (reshape, split, add), the same tree for
    every row; builtins only (`tl.sum` is itself `triton.jit`-wrapped at import, module docstring)."""
    part = tl.permute(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], (0, 2, 1))
    while part.shape[2] > 1:  # shapes inline: the interpreter turns assigned ints into tensors
        pairs = tl.split(tl.reshape(part, (part.shape[0], part.shape[1], part.shape[2] // 2, 2)))
        part = pairs[0] + pairs[1]
    return tl.reshape(part, (part.shape[0], part.shape[1]))


def _tile_product(a, b, ROW_SUMS: tl.constexpr, PROMOTE: tl.constexpr):
    """a @ b in fp32, a [BM, BK] and b [BK, BN] FP8 tiles, to be added to the kernel's accumulator
    (per tensor one K step later, scaled at once with groups): the kernel's only code that differs
    between GPU and CPU.

    GPU (ROW_SUMS False): `tl.dot`, the FP8 tensor cores (wgmma), BK = PROMOTE K elements summed
    in the MMA's own accumulator from zero; the kernel adds the result to its fp32 accumulator.
    Interpreter (ROW_SUMS True): `tl.dot` there is numpy's matmul, i.e. the host's BLAS, whose
    float32 kernels need not sum every row of a tile in the same order (on an AMD EPYC box,
    OpenBLAS's Haswell sgemm, rows 6-15 of each 16 came out in other bits than rows 0-5), so a
    row's bits would depend on its position in the batch and the CPU tests could not check
    invariance. Here `_row_tree_sums` sums every row by the same tree; a tile whose products
    exceed the interpreter's largest tensor (2**20 elements) is done as its even and odd rows
    (the same tree for each). The sums are fp32 in both; only their order differs, which the
    bounds of the tests allow for."""
    if ROW_SUMS:
        if a.shape[0] * a.shape[1] * b.shape[1] > 1048576:
            rows = tl.split(tl.permute(tl.reshape(a, (a.shape[0] // 2, 2, a.shape[1])), (0, 2, 1)))
            sums = tl.join(_row_tree_sums(rows[0], b), _row_tree_sums(rows[1], b))  # [BM / 2, BN, 2]
            return tl.reshape(tl.permute(sums, (0, 2, 1)), (a.shape[0], b.shape[1]))
        return _row_tree_sums(a, b)
    return tl.dot(a, b, max_num_imprecise_acc=PROMOTE)


def _fp8_gemm_nt_kernel(a_ptr, b_ptr, y_ptr, sa_ptr, sb_ptr, M, N, K,
                        stride_am, stride_bn, stride_ym, stride_sam, stride_sbn,
                        GROUP: tl.constexpr, SB_ROWS: tl.constexpr, ROW_SUMS: tl.constexpr,
                        PROMOTE: tl.constexpr, SWIZZLE: tl.constexpr, OUT_BF16: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y, K walked in order from 0 (module docstring). GROUP 0:
    per-tensor scales applied in the epilogue, and each K step's product (`pending`) added to the
    accumulator during the next step, after that step's `tl.dot` is issued: on the GPU the FP32
    adds then run while the wgmma does (ptxas no longer has to wait for the MMA before them), and
    the additions are the same, in the same order, as adding each product at once. Else GROUP is
    the width of the K groups, each group's partial sum scaled into the accumulator at once;
    SB_ROWS: rows of b per row of its scales (1 or G)."""
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
    pending = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: see the module docstring
    acc = pending
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // STEP):
            kk = k0 + j * STEP + ks
            a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + cols[None, :] * stride_bn + kk[:, None],  # B^T's [STEP, BLOCK_N] tile
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
            if GROUP == 0:  # promote the previous step's product while this one runs on the tensor cores
                product = _tile_product(a, b, ROW_SUMS, PROMOTE)
                acc += pending
                pending = product
            else:
                # a sub-step past K (K < BLOCK_K apart) reads zero codes: its scales' index is
                # clamped to the last group, whose product with the zero sum adds nothing
                g = tl.minimum((k0 + j * STEP) // GROUP, (K - 1) // GROUP)
                a_scale = tl.load(sa_ptr + rows * stride_sam + g, mask=rows < M, other=0.0)
                b_scale = tl.load(sb_ptr + (cols // SB_ROWS) * stride_sbn + g, mask=cols < N, other=0.0)
                acc += _tile_product(a, b, ROW_SUMS, PROMOTE) * a_scale[:, None] * b_scale[None, :]
    if GROUP == 0:
        acc = (acc + pending) * tl.load(sa_ptr) * tl.load(sb_ptr)
    if OUT_BF16:  # round to nearest even in integer arithmetic (same bits on CPU and GPU), then an exact cast
        bits = acc.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        acc = tl.where(acc == acc, bits.to(tl.float32, bitcast=True), acc)  # NaN stays NaN
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@functools.cache
def _wrapped(interpret: bool):
    """The kernel wrapped by `triton.jit` while `knobs.runtime.interpret == interpret` (the flag
    is the cache key: triton picks interpreter or compiler at wrapping time), calling helpers
    wrapped in the same mode: the kernel and the helpers are copies of this module's functions
    (same code, so the same source for triton) over a copy of its globals in which the helpers'
    names name those wrappers. M is not specialized: triton would otherwise compile M == 1
    and M % 16 == 0 as other variants, and one compiled kernel for every batch size is the point."""
    scope = dict(globals())
    for helper in (_row_tree_sums, _tile_product):
        scope[helper.__name__] = triton.jit(with_globals(helper, scope))
    kernel = with_globals(_fp8_gemm_nt_kernel, scope)
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
    tile, launch = kernel_config(group)
    grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
    scale_strides = (sa.stride(0), sb.stride(0)) if group is not None else (0, 0)
    args = (a, b, y, sa, sb, m, n, k, a.stride(0), b.stride(0), y.stride(0), *scale_strides)
    options = dict(GROUP=group or 0, SB_ROWS=1 if b_rows or group is None else group, ROW_SUMS=interpret,
                   PROMOTE=min(PROMOTE_K, group or tile["BLOCK_K"]), SWIZZLE=SWIZZLE_M,
                   OUT_BF16=out_dtype == torch.bfloat16, **tile, **launch)
    return y, grid, args, options
