"""FP8 GEMM routing: which kernel computes a @ b^T for FP8 operands, on the CPU and on the device path.

Owns: the GEMM names (`GEMMS`) and `resolve_gemm`, `check_recipe_gemm` (a recipe the resolved GEMM
has no code for, refused at build time), `backward_gemm`, `fp8_matmul_nt` (every GEMM by name, CPU
or CUDA tensors), `device_matmul_nt` (the one function every GEMM of the device path goes through:
fp8/device_linear.py's forward, dgrad and wgrad), the CPU tier's GEMMs ('exact', 'tiled',
'fp32_accumulate') and `tiled_matmul`. fp8/linear.py (the CPU path) and fp8/device_linear.py (the
device path) both call it; fp8/cuda_gemm.py holds the CUDA kernels' calls and their rules.

The FP8 GEMMs (`gemm` argument, GEMMS), a [M, K] and b [N, K] FP8 with dequant multipliers:
- 'scaled_mm':       on the CPU `torch._scaled_mm(a_fp8, b_fp8, scale_a, scale_b, out_dtype=fp32)`
                     (per-tensor operands); on the device path the vendor kernels (below);
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
On the CPU, when an operand is not per-tensor (blockwise recipes: `_scaled_mm` on CPU rejects
128x128 block scales, and 1x128 activation groups split the wgrad's contraction dimension), the
CPU GEMMs run dequantize + fp32 matmul of the same FP8 values.
The device path (`device_matmul_nt`: CUDA tensors, and CPU ones inside
`linear.device_kernels_on_cpu()`) never does: the GEMM resolves as on CUDA, and every call runs an
FP8 kernel (fp8/cuda_gemm.py) or raises naming why:
- 'scaled_mm' (what 'auto' resolves to): per-tensor operands through cuBLAS `torch._scaled_mm`,
  per-row ones (either operand; a per-tensor partner's scale broadcast) through its row-wise
  scaling; 1x128 activation groups with 128x128 or 1x128 weight blocks, both E4M3, through cuBLAS
  blockwise `torch.nn.functional.scaled_mm` (forward, dgrad and wgrad alike). The token dimension
  is padded to what cuBLAS takes; where it still cannot take the operands (a weight dimension off
  its multiples, E5M2 x E5M2, E5M2 gradients of a block recipe under 'hybrid', 1x32 groups, which
  no vendor kernel on Hopper takes) the Triton kernel runs, or, for a layout it has no code for,
  the rules check raises;
- 'triton_invariant' (what 'batch_invariant' resolves to): the Triton kernel;
- the CPU GEMMs (CPU_GEMMS) raise, and `check_recipe_gemm` refuses them at build time.
Every call is checked against its kernel's rules first (`cuda_gemm.check_cuda_gemm`: host-side,
cheap), on CUDA as on CPU, so a shape cuBLAS would refuse fails in the CPU tests too. The result
is written in the caller's dtype (`out_dtype`) by the kernel itself, a bias added by cuBLAS's
epilogue where it takes one (a 16-bit output of the bias's dtype); elsewhere the kernel writes
fp32, the bias is added in fp32 and the sum rounded once (as SGLang's served layer does, so
aligned rollouts keep their bits).
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only; the
Triton kernel, and `check_recipe_gemm` where the GEMM resolves to it, import fp8/triton_gemm.py,
torch + triton, when first called).
"""
from __future__ import annotations

import torch

from megatron_fp8rl.fp8 import cuda_gemm
from megatron_fp8rl.fp8.quantize import Fp8Tensor
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, Fp8Recipe

CUDA = torch.device("cuda")
"""The device whose routing the device path follows on every device (module docstring)."""
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


def backward_gemm(gemm: str, device: torch.device) -> str:
    """The backward's GEMM: invariance only matters where trainer and rollout must agree (the
    forward), so the invariant GEMMs hand the backward to the fast one of the device."""
    if gemm == "triton_invariant":
        return "scaled_mm" if device.type == "cuda" else "fp32_accumulate"
    return "fp32_accumulate" if gemm in ("exact", "tiled") else gemm


def fp8_matmul_nt(a: Fp8Tensor, b: Fp8Tensor, gemm: str = "scaled_mm",
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b^T for a [M, K], b [N, K] (module docstring), in `out_dtype` (float32 or bfloat16:
    the fp32 result rounded once). CUDA tensors, and 'triton_invariant' on any device, take
    `device_matmul_nt` (a's rows the tokens): an FP8 kernel for every layout, or a ValueError
    naming it; on the CPU per-tensor operands by `gemm`, other granularities dequantize + fp32
    matmul."""
    if a.data.device.type == "cuda" or gemm == "triton_invariant":
        return device_matmul_nt(a, b, gemm, out_dtype)
    y = _cpu_matmul_nt(a, b, gemm)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def device_matmul_nt(a: Fp8Tensor, b: Fp8Tensor, gemm: str, out_dtype: torch.dtype,
                     bias: torch.Tensor | None = None, tokens: str = "rows") -> torch.Tensor:
    """a [M, K] @ b [N, K]^T (+ bias [N]) in `out_dtype` on the device path (module docstring):
    the kernel `device_kernel` picks, its call planned, checked against the kernel's rules and
    launched by fp8/cuda_gemm.py. `tokens` names the dimension holding the tokens, padded where
    the kernel needs it: 'rows' (forward, dgrad) or 'contraction' (wgrad)."""
    kernel = device_kernel(a, b, gemm, tokens)
    fused = (bias is not None and kernel in cuda_gemm.CUBLAS_KERNELS and out_dtype != torch.float32
             and bias.dtype == out_dtype)
    if bias is None or fused:
        return cuda_gemm.run_device_gemm(cuda_gemm.plan_device_gemm(kernel, a, b, out_dtype, tokens, bias))
    y = cuda_gemm.run_device_gemm(cuda_gemm.plan_device_gemm(kernel, a, b, torch.float32, tokens))
    # in place: the fp32 sum with the bias promoted inside the add (no cast of its own); one rounding,
    # as SGLang's served layer adds its bias
    return y.add_(bias).to(out_dtype)


def device_kernel(a: Fp8Tensor, b: Fp8Tensor, gemm: str, tokens: str = "rows") -> str:
    """The fp8/cuda_gemm.py kernel that computes a @ b^T on the device path under `gemm`
    ('scaled_mm' or 'triton_invariant', resolved for cuda): module docstring. ValueError naming
    a CPU GEMM, or a layout no kernel has code for."""
    if gemm not in ("scaled_mm", "triton_invariant"):
        raise ValueError(f"FP8 gemm {gemm!r} on cuda: not an FP8 kernel (CPU GEMMs {CPU_GEMMS} would dequantize "
                         "and run an fp32 matmul); resolve 'auto' / 'batch_invariant' with resolve_gemm, or use "
                         "'scaled_mm' / 'triton_invariant'")
    if gemm == "scaled_mm":
        kernel = _cublas_kernel(a, b)
        if kernel == "cublas_row" or (kernel is not None and cuda_gemm.cublas_takes(kernel, a, b, tokens)):
            return kernel
    _check_triton_layout(a, b)
    return "triton"


def _cublas_kernel(a: Fp8Tensor, b: Fp8Tensor) -> str | None:
    """The cuBLAS kernel for the operands' layout, whatever their shapes; None where there is none."""
    if _row_or_tensor(a, b):
        return "cublas_tensor" if a.granularity == b.granularity == "tensor" else "cublas_row"
    if _same_groups(a, b) and a.block == (1, cuda_gemm.BLOCK) and b.block[0] in (1, cuda_gemm.BLOCK):
        return "cublas_1x128_1x128" if b.block[0] == 1 else "cublas_1x128_128x128"
    return None


def _check_triton_layout(a: Fp8Tensor, b: Fp8Tensor) -> None:
    """ValueError naming a layout the Triton kernel has no code for (a fallback to another GEMM
    would silently lose batch invariance, or on CUDA run an fp32 matmul)."""
    if a.granularity == b.granularity == "tensor":
        return
    from megatron_fp8rl.fp8.triton_gemm import GROUPS

    if a.granularity == b.granularity == "block" and _triton_blocks(a.block, b.block, GROUPS):
        return
    raise ValueError(f"triton_invariant FP8 GEMM: operands {a.granularity} {a.block} x {b.granularity} {b.block} "
                     f"(shapes {tuple(a.data.shape)} x {tuple(b.data.shape)}) are not supported; per-tensor x "
                     f"per-tensor, or block (1, G) x block (G, G) or (1, G), G in {GROUPS}")


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


