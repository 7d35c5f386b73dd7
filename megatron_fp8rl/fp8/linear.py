"""Our FP8 linear layer: y = x @ W^T + b with FP8 GEMMs (torch.float8_* and torch._scaled_mm).

Owns: `fp8_matmul_nt`, the autograd function `Fp8LinearFunction`, the functional `fp8_linear`
and the plain torch module `Fp8Linear`, and `check_recipe_gemm` (a recipe the resolved GEMM has no
code for, refused at build time). The Megatron-facing layers (Column/RowParallelLinear
drop-ins) live in megatron_fp8rl/models/megatron_fp8_linear.py and call `fp8_linear`.

Arithmetic (x [..., K] flattened to [M, K], W [N, K], dy [M, N]):
- forward: y = Q_in(x) @ Q_w(W)^T, an FP8 GEMM with fp32 output, cast to x's dtype;
- dgrad:   dx = Q_g(dy) @ Q_w(W), FP8 GEMM (the per-tensor W data is transposed, exact);
- wgrad:   dW = Q_g(dy)^T @ Q_in(x), FP8 GEMM (both per-tensor operands transposed);
- bias gradient: sum of dy in high precision.
The FP8 GEMM (`gemm` argument, GEMMS):
- 'scaled_mm':       `torch._scaled_mm(a_fp8, b_fp8, scale_a, scale_b, out_dtype=fp32)`;
- 'fp32_accumulate': (float(a_fp8) @ float(b_fp8)^T) * scale_a * scale_b, the same FP8 operands
                     with exact products and fp32 accumulation, as an FP8 tensor core computes;
                     results differ from 'scaled_mm' only by fp32 summation order (~1e-6 rel);
- 'exact':           the same with fp64 accumulation, rounded once to fp32, then scaled. For E4M3
                     operands it is the exact sum: every product is a multiple of 2**-18 below
                     2**18, so any partial sum over K <= 2**17 (EXACT_MAX_K) fits fp64's 53-bit
                     significand. The result therefore does not depend on summation order, on how
                     many rows are multiplied together or on the column order, which an fp32 GEMM's
                     does (its blocking changes with M). That is what lets SGLang's decode (a few
                     rows a step) and the trainer's recompute (whole sequences) produce the same
                     bits from the same FP8 codes (rollout/sglang_fp8.py uses this function). Row
                     scales (one multiplier per row of either operand: per-token activations,
                     per-channel weights) multiply the rounded sum the same way. ~1.3-
                     1.6x an 'fp32_accumulate' forward on CPU. Block operands sharing one group
                     width g along K (1xg activation groups with 1xg or gxg weight blocks: the
                     `groupwise` and `blockwise` recipes) sum each group exactly in fp64, then
                     add the groups in K order, each times its two fp64 multipliers, and round
                     once to fp32: every step is per element, so a row's result again depends on
                     nothing but that row and the weight. Other operands (E5M2 gradients, K
                     above the bound, other block shapes) fall back to 'fp32_accumulate' (block
                     operands: dequantize + fp32 matmul); the backward always does;
- 'tiled':           batch-invariant fp32 GEMM for CPU (what 'batch_invariant' selects there): the
                     'fp32_accumulate' arithmetic (block operands: their dequantized values, each
                     code times its multiplier in fp32, in one fp32 GEMM), computed TILE_ROWS
                     rows of a at a time, zero rows padding the last tile. Every call then
                     has the same shape whatever M is, and a row's bits depend on nothing but that
                     row and the weight: CPU BLAS picks its kernel by shape (M = 1 or 2 rows take
                     another path than 16 and give other bits) and computes the rows of one call
                     alike wherever they sit (tests/fp8/test_tiled_gemm.py checks both, with 1 and 2
                     threads). Not the exactly rounded sum 'exact' gives, but trainer and SGLang
                     compute the same bits from the same FP8 operands in any layout.
                     Faster than 'exact' (one fp32 GEMM instead of fp64 ones, and for groups
                     no per-group passes: `python bench/exact_gemm.py`). The backward runs
                     'fp32_accumulate';
- 'triton_invariant': fp8/triton_gemm.py's Triton kernel: fixed tiles, no split-K, fp32
                     accumulation in a fixed K order, so a row's result does not depend on M either
                     (batch-invariant on GPU, where 'exact' would be slow and cuBLASLt's algorithm
                     changes with the shape). Per-tensor x per-tensor, or 1xG activation groups x
                     GxG or 1xG weight blocks, G = 32 or 128 (ragged K too); any other layout
                     raises. CPU tensors need TRITON_INTERPRET=1 (else it raises). The backward
                     runs 'scaled_mm' on CUDA, 'fp32_accumulate' elsewhere;
- 'auto' (default):  'scaled_mm' on CUDA, 'exact' on CPU, because torch 2.13's CPU
                     `_scaled_mm` (no AMX here) runs ~100x slower than an fp32 matmul (measured:
                     1 s for 256x64x192), which would make the CPU tier's training unusable;
- 'batch_invariant': what aligned rollouts select on both sides (trainer and SGLang's `fp8rl`
                     method): 'triton_invariant' on CUDA, 'tiled' on CPU.
Q_g uses the recipe's backward format: E5M2 under 'hybrid', E4M3 under 'e4m3'. On the CPU, when
an operand is not per-tensor (blockwise recipes: `_scaled_mm` on CPU rejects 128x128 block
scales, and 1x128 activation groups split the wgrad's contraction dimension), that GEMM runs as
dequantize + fp32 matmul of the same FP8 values. On CUDA `fp8_matmul_nt` never does: every
layout a recipe makes runs an FP8 kernel (per tensor: cuBLAS `_scaled_mm`; per row: its row-wise
scaling; 1xG groups and GxG blocks: the Triton kernel) or raises naming it, and
`check_recipe_gemm` refuses at build time a recipe x GEMM without one (the CPU GEMMs 'exact',
'tiled', 'fp32_accumulate' on CUDA). Its `out_dtype` (fp32 or bf16) lets a caller take the
bf16 result the kernel's epilogue writes instead of casting an fp32 one. (`Fp8LinearFunction`'s
backward below still dequantizes block operands itself; the CUDA device linear replaces it.)
The weight stays a high-precision (FP32/BF16) master parameter; the FP8 copies of x and W saved
for the backward are 1 byte per element.
Speed on CPU (bench/fp8_linear_speed.py): a calibrated or frozen-scale weight's quantization is
cached (quantizer.WeightQuantCache) with its fp32 copy and transpose, which 'fp32_accumulate'
uses instead of casting the FP8 data again (`Fp8Tensor.dense`: the same values); a block
weight's with its codes' fp32 transpose (`dense_t`, what the grouped 'exact' GEMM reads) and its
dequantized values (`values`, what every backward's dgrad reads). The backward dequantizes a
block-scaled output gradient once for both of its GEMMs.
Device path: `fp8_linear` hands CUDA inputs (and CPU ones inside `device_kernels_on_cpu()`) to
fp8/device_linear.py (fused Triton quantization, FP8 dgrad and wgrad, no host sync); what follows
here, Fp8LinearFunction, is the CPU tier's path, which never imports triton (fp8_matmul_nt serves both).
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only; the
'triton_invariant' GEMM, and `check_recipe_gemm` where the GEMM resolves to it, import
fp8/triton_gemm.py, torch + triton, when first called; the device path imports
fp8/device_linear.py at its first call).
"""
from __future__ import annotations

import contextlib
import math

import torch

from megatron_fp8rl.fp8.quantize import Fp8Tensor
from megatron_fp8rl.fp8.quantizer import Fp8Quantizers, make_quantizers
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CalibratedDelayedScaling, Fp8Recipe

EXTRA_STATE_VERSION = 1
GEMMS = ("auto", "batch_invariant", "scaled_mm", "fp32_accumulate", "exact", "tiled", "triton_invariant")
CPU_GEMMS = ("exact", "tiled", "fp32_accumulate")
"""The GEMMs that sum dequantized codes in fp32 / fp64 on the CPU: refused on CUDA (no FP8 kernel)."""
EXACT_MAX_K = 2**17
"""Longest contraction for which fp64 sums of E4M3 x E4M3 products are exact (module docstring)."""
EXACT_ROW_CHUNK = 64
"""Rows per pass of the grouped 'exact' GEMM: the fp64 partial sums stay in cache (2048x576x1536,
CPU time on the dev box: 91 ms in 64-row passes, 213 ms as one batched product over all rows;
32 and 128 rows were no faster; 2026-12-03, 1x32 groups, 960 rows: 8, 16, 32 rows slower)."""
TILE_ROWS = 16
"""Rows of a per GEMM call of 'tiled' (module docstring): at least 5 rows so that CPU BLAS takes
its GEMM kernel (1 and 2 rows take a GEMV path with other bits), and a decode step's few rows
waste little padding."""
EXACT_SLAB_BYTES = 4 * 2**20
"""fp64 group sums one batched GEMM of the grouped 'exact' GEMM writes at most (a slab of
consecutive K groups). 2026-12-03, 2-core box, 1x32 groups, 960 rows x (K -> N): 576 -> 3072
89.7 ms (one GEMM per group, before: 104.5; all groups at once: 140.4; 1/2/8 MiB slabs: 96.0 /
95.7 / 112.4), 576 -> 960 29.8 (37.0), 1536 -> 576 54.3 (72.3); bit-identical to before."""


def resolve_gemm(gemm: str, device: torch.device) -> str:
    """'auto' -> 'scaled_mm' on CUDA, 'exact' elsewhere; 'batch_invariant' -> 'triton_invariant'
    on CUDA, 'tiled' elsewhere; ValueError for unknown names."""
    if gemm not in GEMMS:
        raise ValueError(f"unknown FP8 gemm {gemm!r}; valid: {', '.join(GEMMS)}")
    if gemm == "auto":
        return "scaled_mm" if device.type == "cuda" else "exact"
    if gemm == "batch_invariant":
        return "triton_invariant" if device.type == "cuda" else "tiled"
    return gemm


def check_recipe_gemm(recipe: Fp8Recipe, gemm: str, device: torch.device) -> None:
    """ValueError, at build time, naming a recipe x GEMM that has no FP8 kernel on `device`, so it
    cannot stop at the first forward (or run as a dequantize + fp32 matmul). On CUDA: the recipes
    the device path's quantization kernels refuse (device_quantize.check_device_recipe); the CPU
    GEMMs (CPU_GEMMS) whatever the recipe; block recipes need 1xG activation groups with GxG or 1xG
    weights, G in the Triton kernel's GROUPS (what `_triton_blocks` accepts), under 'scaled_mm' as
    under 'triton_invariant'. On the CPU every combination has code."""
    resolved = resolve_gemm(gemm, device)
    if device.type != "cuda":
        return
    if resolved in CPU_GEMMS:
        raise ValueError(f"FP8 gemm {gemm!r} is {resolved!r}, a CPU GEMM (fp32 or fp64 sums of the dequantized "
                         f"codes): on cuda it has no FP8 kernel; use 'auto' / 'scaled_mm' (cuBLAS, Triton for "
                         "groups) or 'batch_invariant' / 'triton_invariant' (aligned rollouts)")
    if isinstance(recipe, BlockwiseScaling):
        from megatron_fp8rl.fp8.triton_gemm import GROUPS  # the GEMM imports it on this device anyway

        if not _triton_blocks(recipe.activation_block, recipe.weight_block, GROUPS):
            raise ValueError(f"FP8 gemm {gemm!r} on cuda: the recipe's blocks activation {recipe.activation_block} x "
                             f"weight {recipe.weight_block} have no FP8 kernel; the Triton kernel takes (1, G) "
                             f"activations with (G, G) or (1, G) weights, G in {GROUPS}")
    from megatron_fp8rl.fp8.device_quantize import check_device_recipe

    check_device_recipe(recipe)


def _triton_blocks(a_block: tuple[int, int], b_block: tuple[int, int], groups: tuple[int, ...]) -> bool:
    """The block layouts the Triton kernel has code for: 1 x G activations (a) with G x G or
    1 x G weights (b), G one of `groups`."""
    group = a_block[1]
    return a_block[0] == 1 and group in groups and b_block in ((group, group), (1, group))


def _backward_gemm(gemm: str, device: torch.device) -> str:
    """The backward's GEMM: invariance only matters where trainer and rollout must agree (the
    forward), so the invariant GEMMs hand the backward to the fast one of the device."""
    if gemm == "triton_invariant":
        return "scaled_mm" if device.type == "cuda" else "fp32_accumulate"
    return "fp32_accumulate" if gemm in ("exact", "tiled") else gemm


def fp8_matmul_nt(a: Fp8Tensor, b: Fp8Tensor, gemm: str = "scaled_mm",
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b^T for a [M, K], b [N, K] (module docstring), in `out_dtype` (float32 or bfloat16:
    the fp32 result rounded once). On CUDA every layout runs an FP8 kernel or raises naming it
    (`_cuda_matmul_nt`); on the CPU per-tensor operands by `gemm`, 'triton_invariant' also block
    scales, other granularities dequantize + fp32 matmul."""
    if a.data.device.type == "cuda":
        return _cuda_matmul_nt(a, b, gemm, out_dtype)
    if gemm == "triton_invariant":
        return _triton_matmul_nt(a, b, out_dtype)
    y = _cpu_matmul_nt(a, b, gemm)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def _cpu_matmul_nt(a: Fp8Tensor, b: Fp8Tensor, gemm: str) -> torch.Tensor:
    """The CPU tier's GEMMs (module docstring), fp32 out."""
    if gemm == "exact" and _row_or_tensor(a, b) and _exact_sum_fits(a, b):
        return (_wide(a) @ _wide(b).t()).float() * _left_scale(a) * _left_scale(b).reshape(1, -1)
    if gemm == "exact" and _same_groups(a, b) and _exact_sum_fits(a, b):
        return _exact_grouped_matmul_nt(a, b)
    if gemm == "tiled":
        return _tiled_matmul_nt(a, b)
    if a.granularity != "tensor" or b.granularity != "tensor":
        return a.dequantize() @ b.dequantize().t()
    if gemm == "scaled_mm":
        return torch._scaled_mm(
            a.data,
            b.data.t(),
            scale_a=a.scale_inv.float(),
            scale_b=b.scale_inv.float(),
            out_dtype=torch.float32,
        )
    return (_dense(a) @ _dense(b).t()) * a.scale_inv.float() * b.scale_inv.float()


def _cuda_matmul_nt(a: Fp8Tensor, b: Fp8Tensor, gemm: str, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_matmul_nt on CUDA, an FP8 kernel for every layout a recipe makes, never a dequantize +
    fp32 matmul: 'triton_invariant' the Triton kernel (per-tensor, 1xG x GxG / 1xG); 'scaled_mm'
    per-tensor operands through cuBLAS `torch._scaled_mm`, per-row ones (either operand; a
    per-tensor partner's scale broadcast) through its row-wise scaling, block / group operands
    through the Triton kernel. The CPU GEMMs (CPU_GEMMS) raise, as any other layout does."""
    if gemm in CPU_GEMMS or gemm not in ("scaled_mm", "triton_invariant"):
        raise ValueError(f"FP8 gemm {gemm!r} on cuda: not an FP8 kernel (CPU GEMMs {CPU_GEMMS} would dequantize "
                         "and run an fp32 matmul); resolve 'auto' / 'batch_invariant' with resolve_gemm, or use "
                         "'scaled_mm' / 'triton_invariant'")
    if gemm == "triton_invariant" or a.granularity == "block" or b.granularity == "block":
        return _triton_matmul_nt(a, b, out_dtype)
    if a.granularity == b.granularity == "tensor":
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv.float(), scale_b=b.scale_inv.float(),
                                out_dtype=out_dtype)
    m, n = a.data.shape[0], b.data.shape[0]
    return torch._scaled_mm(a.data, b.data.t(), scale_a=_row_scales(a, m, (m, 1)),
                            scale_b=_row_scales(b, n, (1, n)), out_dtype=out_dtype)


def _row_scales(t: Fp8Tensor, rows: int, shape: tuple[int, int]) -> torch.Tensor:
    """t's multipliers as row-wise `_scaled_mm` takes them: fp32, contiguous, `shape` ([M, 1] for
    a, [1, N] for b); a per-tensor scale broadcast to every row (a device copy, no host sync)."""
    scales = t.scale_inv.float()
    if t.granularity == "tensor":
        return scales.reshape(1, 1).expand(shape).contiguous()
    return scales.reshape(shape).contiguous()


def _triton_matmul_nt(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Triton kernel for the layouts it has; ValueError naming any other (a fallback to
    another GEMM would silently lose batch invariance, or on CUDA run an fp32 matmul)."""
    from megatron_fp8rl.fp8.triton_gemm import GROUPS, triton_fp8_matmul_nt

    layout = (a.granularity, a.block, b.granularity, b.block)
    if layout == ("tensor", None, "tensor", None):
        return triton_fp8_matmul_nt(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=out_dtype)
    if layout[0] == layout[2] == "block" and _triton_blocks(a.block, b.block, GROUPS):
        return triton_fp8_matmul_nt(a.data, b.data, a.scale_inv, b.scale_inv, group=a.block[1],
                                    b_rows=b.block[0] == 1, out_dtype=out_dtype)
    raise ValueError(f"triton_invariant FP8 GEMM: operands {a.granularity} {a.block} x {b.granularity} {b.block} "
                     f"(shapes {tuple(a.data.shape)} x {tuple(b.data.shape)}) are not supported; per-tensor x "
                     f"per-tensor, or block (1, G) x block (G, G) or (1, G), G in {GROUPS}")


def _tiled_matmul_nt(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """'tiled' (module docstring): per-tensor and per-row operands multiply their codes and scale
    the product; block operands multiply their dequantized values (each element code x
    multiplier in fp32; a cached weight's are kept, `Fp8Tensor.values`)."""
    if _row_or_tensor(a, b):
        weight = _dense(b).contiguous()  # [n, k]: both sides hand BLAS the same layout
        y = _tiles(_dense(a), weight)
        return y.mul_(_left_scale(a)).mul_(_left_scale(b).reshape(1, -1))  # y: a fresh tensor
    return _tiles(a.dequantize(), b.dequantize().contiguous())


def tiled_matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ weight [n, k]^T in float32, TILE_ROWS rows of a per GEMM: a row's result does not
    depend on m (how many rows share the call). The aligned lm_head on both sides (the trainer's
    output layer in the served layout, SGLang's CPU lm_head: models/served_arithmetic.py)."""
    return _tiles(a, weight.float().contiguous())


def _tiles(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ weight [n, k]^T in fp32, TILE_ROWS rows of a per GEMM: one batched GEMM over the
    tiles (the weight broadcast to each; the last tile padded with zero rows), [m, n]; one call
    instead of a Python loop of per-tile GEMMs."""
    m, (n, k) = a.shape[0], weight.shape
    tiles = -(-m // TILE_ROWS)
    if tiles == 0:
        return a.new_zeros((0, n), dtype=torch.float32)
    rows = a.float()
    if tiles * TILE_ROWS != m:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, tiles * TILE_ROWS - m))
    out = torch.bmm(rows.contiguous().view(tiles, TILE_ROWS, k), weight.t().expand(tiles, k, n))
    return out.view(tiles * TILE_ROWS, n)[:m]


def _same_groups(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """Both operands block-scaled with the same group width along K."""
    return a.granularity == b.granularity == "block" and a.block[1] == b.block[1]


def _row_group_scales(t: Fp8Tensor) -> torch.Tensor:
    """t's block multipliers [ceil(rows/bn), groups] expanded to one row each: [rows, groups], fp64."""
    return t.scale_inv.double().repeat_interleave(t.block[0], 0)[: t.data.shape[0]]


def _exact_grouped_matmul_nt(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """'exact' for block operands (module docstring): y = 0 + sum over K groups g, in order, of
    exact_sum_g(a b) * sa[m, g] * sb[n, g], in fp64, rounded once to fp32.

    Computed EXACT_ROW_CHUNK rows at a time, the groups' [chunk, n] sums by batched fp64 GEMMs
    over slabs of consecutive groups (EXACT_SLAB_BYTES), results exact (module docstring), each
    slab scaled and added in K order while in cache. Every
    rounding step (the two multiplications, the additions in K order, the fp32 cast) is
    elementwise, so an element's bits depend on its row of a, its row of b and their multipliers
    only: not on M, on where the chunks fall, or on the other rows."""
    width, (m, k), n = a.block[1], a.data.shape, b.data.shape[0]
    groups = -(-k // width)
    # b's codes in fp64 (exact) as [groups, width, n], a K tail padded with zeros (exact zeros:
    # the sums do not change, and a zero sum's sign is lost to the +0 start anyway)
    b_wide = _padded_codes(b.dense_t if b.dense_t is not None else b.data.t(), groups * width).view(groups, width, n)
    a_scales, b_scales = _row_group_scales(a), _row_group_scales(b).t().contiguous()  # [m, g], [g, n]
    y = torch.empty(m, n, dtype=torch.float32, device=a.data.device)
    for start in range(0, m, EXACT_ROW_CHUNK):
        rows = slice(start, min(start + EXACT_ROW_CHUNK, m))
        _exact_grouped_rows(y[rows], a.data[rows], b_wide, a_scales[rows], b_scales)
    return y


def _exact_grouped_rows(out, a_codes, b_wide, a_scales, b_scales) -> None:
    """Write `_exact_grouped_matmul_nt` for a few rows into out [rows, n] (fp32): a_codes
    [rows, k] FP8, b_wide [groups, width, n] the weight codes in fp64."""
    groups, width, n = b_wide.shape
    rows = a_codes.shape[0]
    a_wide = _grouped_rows(a_codes, groups, width).contiguous()  # contiguous: bmm ran 1.3x faster
    a_scales = a_scales.t()
    slab = max(1, EXACT_SLAB_BYTES // (rows * n * 8))
    total = torch.zeros(rows, n, dtype=torch.float64, device=out.device)
    for first in range(0, groups, slab):
        part = slice(first, min(first + slab, groups))
        sums = torch.bmm(a_wide[part], b_wide[part])  # [slab, rows, n], each exact
        sums.mul_(a_scales[part, :, None]).mul_(b_scales[part, None, :])
        for group_sums in sums:  # in K order
            total.add_(group_sums)
    out.copy_(total)  # rounded once to fp32


def _grouped_rows(codes: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """FP8 codes [rows, k] as fp64 [groups, rows, width], a K tail padded with zeros."""
    wide = _padded_codes(codes.t(), groups * width).t()
    return wide.reshape(codes.shape[0], groups, width).transpose(0, 1)


def _padded_codes(codes: torch.Tensor, k: int) -> torch.Tensor:
    """codes [k0, n] (FP8 or their fp32 copy) in fp64, zero rows appended up to k: a fill only
    where k0 < k (aten::fill_ was 56 ms of the 2.2 s profiled in a groupwise32 SmolLM2 forward
    that zeroed every operand)."""
    if codes.shape[0] == k:
        return codes.to(torch.float64)
    wide = torch.zeros(k, codes.shape[1], dtype=torch.float64, device=codes.device)
    wide[:codes.shape[0]].copy_(codes)
    return wide


def _row_or_tensor(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    return a.granularity in ("tensor", "row") and b.granularity in ("tensor", "row")


def _left_scale(t: Fp8Tensor) -> torch.Tensor:
    """t's dequant multiplier as a column for its rows: [] per tensor, [rows, 1] per row."""
    return t.scale_inv.float() if t.granularity == "tensor" else t.scale_inv.float().reshape(-1, 1)


def _exact_sum_fits(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """Whether the fp64 sum of a @ b^T's products is exact (module docstring, 'exact')."""
    return (a.data.dtype == b.data.dtype == torch.float8_e4m3fn) and a.data.shape[-1] <= EXACT_MAX_K


def _dense(t: Fp8Tensor) -> torch.Tensor:
    """float(t.data): the copy its producer kept (cached weights), else a fresh cast."""
    return t.dense.float() if t.dense is not None else t.data.float()


def _wide(t: Fp8Tensor) -> torch.Tensor:
    """t.data in fp64, the 'exact' GEMM's operand: free when the producer kept an fp64 copy
    (SGLang's served weights, rollout/sglang_fp8.py), else one cast."""
    return (t.dense if t.dense is not None else t.data).double()


def _is_per_tensor(*tensors: Fp8Tensor) -> bool:
    return all(t.granularity == "tensor" for t in tensors)


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd function of y = x @ W^T + b with FP8 GEMMs (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantizers: Fp8Quantizers, gemm: str):
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"fp8_linear: input has {x.shape[-1]} features, weight {tuple(weight.shape)} "
                f"expects {weight.shape[1]}"
            )
        x2d = x.reshape(-1, x.shape[-1])
        x_q = quantizers.input.quantize(x2d)
        w_q = quantizers.weight.quantize(weight)
        gemm = resolve_gemm(gemm, x.device)
        y = fp8_matmul_nt(x_q, w_q, gemm)
        if bias is not None:
            y = y + bias.float()
        ctx.quantizers, ctx.gemm = quantizers, _backward_gemm(gemm, x.device)
        ctx.x_meta = (x_q.scale_inv, x_q.granularity, x_q.block, x.shape, x.dtype)
        ctx.w_meta = (w_q.scale_inv, w_q.granularity, w_q.block, weight.dtype)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x_q.data, w_q.data)
        # a cached weight quantization (quantizer.WeightQuantCache) carries its fp32 copies (block
        # weights: the dequantized values); keep the object so the backward reuses them (the
        # cache owns the memory)
        ctx.w_cached = w_q if w_q.dense is not None or w_q.values is not None else None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_data, w_data = ctx.saved_tensors
        x_scale_inv, x_gran, x_block, x_shape, x_dtype = ctx.x_meta
        w_scale_inv, w_gran, w_block, w_dtype = ctx.w_meta
        x_q = Fp8Tensor(x_data, x_scale_inv, x_gran, x_block)
        w_q = ctx.w_cached
        if w_q is None:
            w_q = Fp8Tensor(w_data, w_scale_inv, w_gran, w_block)
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        g_q = ctx.quantizers.grad_output.quantize(dy)
        if not _is_per_tensor(g_q):  # dequantized once for both GEMMs
            g_q.values = g_q.dequantize()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if _is_per_tensor(g_q, w_q):
                grad_x = fp8_matmul_nt(g_q, w_q.t(), ctx.gemm)
            else:
                grad_x = g_q.dequantize() @ w_q.dequantize()
            grad_x = grad_x.to(x_dtype).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            if _is_per_tensor(g_q, x_q):
                grad_w = fp8_matmul_nt(g_q.t(), x_q.t(), ctx.gemm)
            else:
                grad_w = g_q.dequantize().t() @ x_q.dequantize()
            grad_w = grad_w.to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.float().sum(0).to(w_dtype)
        return grad_x, grad_w, grad_b, None, None


_DEVICE_KERNELS_ON_CPU = [False]


@contextlib.contextmanager
def device_kernels_on_cpu():
    """Inside: `fp8_linear` runs the device path (fp8/device_linear.py: fused Triton quantization,
    FP8 GEMMs in the backward, no host sync) on CPU tensors too, under TRITON_INTERPRET=1; for the
    tests that check the CUDA path's code on a machine without a GPU."""
    previous, _DEVICE_KERNELS_ON_CPU[0] = _DEVICE_KERNELS_ON_CPU[0], True
    try:
        yield
    finally:
        _DEVICE_KERNELS_ON_CPU[0] = previous


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantizers: Fp8Quantizers,
    gemm: str = "auto",
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T + bias [N], GEMMs in FP8 (module docstring).
    CUDA inputs (and CPU ones inside `device_kernels_on_cpu()`) take fp8/device_linear.py's path."""
    if x.device.type == "cuda" or _DEVICE_KERNELS_ON_CPU[0]:
        from megatron_fp8rl.fp8.device_linear import device_fp8_linear  # imports triton: device path only

        return device_fp8_linear(x, weight, bias, quantizers, gemm)
    return Fp8LinearFunction.apply(x, weight, bias, quantizers, gemm)


def quantizers_extra_state(recipe: Fp8Recipe, quantizers: Fp8Quantizers) -> dict:
    """The FP8 scaling state of one layer as a checkpointable dict (TE's `_extra_state` role)."""
    return {
        "version": EXTRA_STATE_VERSION,
        "recipe": repr(recipe),
        "quantizers": quantizers.state_dict(),
    }


def load_quantizers_extra_state(quantizers: Fp8Quantizers, state, name: str) -> None:
    """Restore what `quantizers_extra_state` saved; None (a checkpoint without FP8 state, e.g.
    one written by a high-precision layer) keeps the fresh state."""
    if state is None:
        return
    if not isinstance(state, dict) or state.get("version") != EXTRA_STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{name}: FP8 extra state must be a dict with version {EXTRA_STATE_VERSION}, found {found!r}"
        )
    quantizers.load_state_dict(state["quantizers"], name)


class Fp8Linear(torch.nn.Module):
    """A linear layer whose GEMMs run in FP8; the weight is a high-precision master parameter.

    The FP8 scaling state travels in `state_dict()` under `_extra_state`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: Fp8Recipe | None = None,
        group=None,
        dtype: torch.dtype = torch.float32,
        gemm: str = "auto",
    ):
        super().__init__()
        self.recipe = CalibratedDelayedScaling() if recipe is None else recipe
        resolve_gemm(gemm, torch.device("cpu"))  # reject an unknown name now, not at first use
        self.gemm = gemm
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.fp8_quantizers = make_quantizers(self.recipe, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_quantizers, self.gemm)

    def fp8_stats(self) -> dict:
        """{role: QuantStats of the last quantization}."""
        return self.fp8_quantizers.stats()

    def get_extra_state(self) -> dict:
        return quantizers_extra_state(self.recipe, self.fp8_quantizers)

    def set_extra_state(self, state) -> None:
        load_quantizers_extra_state(self.fp8_quantizers, state, type(self).__name__)
