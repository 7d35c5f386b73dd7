"""Saturating FP8 quantize / dequantize: per tensor, per row, and blockwise.

Owns: the arithmetic of one quantization, `q = saturate(x * scale)` stored as FP8 with the
dequantization multiplier `scale_inv = 1 / scale`, at three granularities:
- per tensor: one scale;
- per row: one scale per row (per token for activations, per output channel for weights);
- blockwise: one scale per (bn x bk) block, 128x128 for weights [N, K] (the DeepSeek / SGLang
  `weight_scale_inv` layout [ceil(N/128), ceil(K/128)]) and 1x128 per-token groups for
  activations [M, K] (scale_inv [M, ceil(K/128)]).
Also the scale-from-bound formula shared with TE's delayed scaling (`scale_from_bound`) and its
power-of-two rounding (`pow2_scale`: UE8M0 scales, as MXFP8 and DeepSeek-V3.1 store them).

Saturation: every finite or infinite input is clamped to +-fp8_max before the cast, so an
overflowing input never becomes NaN (E4M3 has no inf; E5M2's inf is never produced). NaN stays NaN.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megatron_fp8rl.fp8.formats import Fp8Format

FP32_MAX = torch.finfo(torch.float32).max
WEIGHT_BLOCK = (128, 128)
"""Block shape for weights [N, K] (DeepSeek / SGLang checkpoint format)."""
ACTIVATION_BLOCK = (1, 128)
"""Block shape for activations [M, K]: per token, per group of 128 channels."""

GRANULARITIES = ("tensor", "row", "block")


@dataclass
class Fp8Tensor:
    """A quantized tensor: FP8 data and the FP32 multiplier(s) that dequantize it."""

    data: torch.Tensor
    """FP8 values, same shape as the high-precision tensor."""
    scale_inv: torch.Tensor
    """Dequantization multiplier: shape [] (tensor), [..., 1] (row) or [nb, kb] (block)."""
    granularity: str
    """'tensor', 'row' or 'block'."""
    block: tuple[int, int] | None = None
    """Block shape for granularity 'block'."""
    dense: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Optional fp32 or fp64 copy of `data` (the same values), kept by a producer that reuses this
    tensor (the cached weight quantization in quantizer.py: fp32; SGLang's served weights: fp64
    under the 'exact' GEMM, fp32 under 'tiled') so GEMMs skip the cast from FP8."""
    transposed: "Fp8Tensor | None" = field(default=None, repr=False, compare=False)
    """Optional precomputed `t()` (same values, kept by the same producers)."""
    dense_t: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Optional contiguous fp32 or fp64 copy of `data.t()` (2-D), kept by the same producers for
    block operands: the [K, N] layout in which fp8/gemm.py's grouped 'exact' GEMM reads a weight."""
    values: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Optional fp32 result of `dequantize()` kept by the same producers (the cached weight's
    backward reads it every micro-batch); shared, so callers must not modify what
    `dequantize()` returns."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x ≈ q * scale_inv, in `dtype`."""
        if self.values is not None:
            return self.values.to(dtype)
        if self.granularity == "block":
            return dequantize_blockwise(self.data, self.scale_inv, self.block).to(dtype)
        return dequantize(self.data, self.scale_inv).to(dtype)

    def t(self) -> "Fp8Tensor":
        """The transpose of a 2-D per-tensor quantized matrix (exact: the scale is shared)."""
        if self.granularity != "tensor" or self.data.dim() != 2:
            raise ValueError(
                f"only 2-D per-tensor Fp8Tensors transpose exactly; found granularity "
                f"{self.granularity!r} with shape {tuple(self.data.shape)}"
            )
        if self.transposed is not None:
            return self.transposed
        return Fp8Tensor(self.data.t().contiguous(), self.scale_inv, "tensor")


def transposed_codes(data: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 copy of 2-D FP8 data [N, K] transposed, [K, N] (`Fp8Tensor.dense_t`):
    the bytes are transposed first, then cast in one contiguous pass (casting the strided
    transpose took ~1.3x as long: 17 vs 13 ms for [3072, 576] here)."""
    return data.view(torch.uint8).t().contiguous().view(data.dtype).float()


def amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| in fp32 (over `dim`, or all elements); NaN propagates, so a NaN amax tells the
    delayed-scaling update to keep its old scale (TE semantics)."""
    absolute = x.detach().abs().float()
    if dim is None:
        return absolute.amax() if absolute.numel() else absolute.new_zeros(())
    return absolute.amax(dim=dim, keepdim=keepdim)


_PEAK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def cpu_finite_peak(x: torch.Tensor) -> torch.Tensor | None:
    """max |x| in fp32 from one `aminmax` pass when x is a non-empty CPU tensor whose elements
    are all finite (then it equals `finite_amax(x)` bit for bit: abs is exact and max |x| =
    max(max x, -min x); `.abs()` turns a -0 peak into +0); None otherwise (some inf or NaN, an
    empty tensor, or an accelerator tensor, where the finiteness check would be a host sync)."""
    if x.device.type != "cpu" or x.numel() == 0 or x.dtype not in _PEAK_DTYPES:
        return None
    low, high = torch.aminmax(x.detach())
    peak = torch.maximum(high.float(), low.float().neg()).abs()
    return peak if bool(torch.isfinite(peak)) else None


def finite_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over the finite elements only (0 when there are none), in fp32 (whole-tensor
    maxima of finite CPU tensors take `cpu_finite_peak`'s one pass, the same value)."""
    if dim is None:
        peak = cpu_finite_peak(x)
        if peak is not None:
            return peak
    absolute = x.detach().abs().float()
    absolute = torch.where(torch.isfinite(absolute), absolute, torch.zeros_like(absolute))
    if dim is None:
        return absolute.amax() if absolute.numel() else absolute.new_zeros(())
    return absolute.amax(dim=dim, keepdim=keepdim)


def scale_from_bound(
    bound: torch.Tensor, fp8_max: float, margin: int = 0, old_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """TE's delayed-scaling formula: scale = (fp8_max / bound) / 2**margin.

    `bound` is the value that maps to fp8_max / 2**margin (TE calls it amax). Where the bound is
    <= 0, NaN or inf the old scale is kept (1.0 when none is given); a scale that overflows fp32
    (tiny bound) becomes FP32_MAX. Elementwise over any shape; returns fp32 of bound's shape.
    Evaluated exactly as TE's eager `_default_sf_compute` is (torch computes `float / Tensor` as
    fp8_max * reciprocal(bound)), so the two agree bit for bit.
    """
    bound = bound.float()
    if old_scale is None:
        old_scale = torch.ones_like(bound)
    old_scale = old_scale.float().expand_as(bound)
    scale = (fp8_max / bound) / (2**margin)
    scale = torch.where(bound > 0.0, scale, old_scale)
    scale = torch.where(torch.isfinite(bound), scale, old_scale)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)


def pow2_scale(scale: torch.Tensor) -> torch.Tensor:
    """`scale` rounded down to a power of two, 2**floor(log2(scale)) (UE8M0: MXFP8's and
    DeepSeek-V3.1's scale format), so its dequant multiplier 1/scale is exact and x * scale stays
    within the bound's range (no new saturation). Exact for every positive finite fp32 (frexp, no
    log2 rounding); FP32_MAX maps to 2**127. Elementwise, fp32."""
    mantissa, exponent = torch.frexp(scale.float())  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(mantissa), exponent - 1)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """q = cast_fp8(clamp(x * scale, -fp8_max, fp8_max)); `scale` broadcasts against x.

    The product is formed in fp32 and rounded once to FP8 (round to nearest even). Infinite
    inputs saturate to +-fp8_max, NaN stays NaN, -0 stays -0.
    """
    scaled = x.float() * scale.float()
    return scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype)  # in place: `scaled` is ours


def quantize_finite(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, peak: torch.Tensor) -> torch.Tensor:
    """`quantize(x, scale, fmt)` for an x whose `cpu_finite_peak` is `peak`: the saturating clamp
    is skipped when fl(peak * scale) <= fp8_max, where it is the identity (same result)."""
    if scale.numel() == 1 and bool(peak * scale.float() <= fmt.max):
        return (x.float() * scale.float()).to(fmt.dtype)
    return quantize(x, scale, fmt)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x ≈ float(q) * scale_inv, fp32; `scale_inv` broadcasts against q."""
    return q.float() * scale_inv.float()


def quantize_per_tensor(
    x: torch.Tensor, fmt: Fp8Format, bound: torch.Tensor | None = None, margin: int = 0
) -> Fp8Tensor:
    """One scale for all of x: scale = scale_from_bound(bound or finite amax(x)); any shape."""
    bound = finite_amax(x) if bound is None else bound.float().reshape(())
    scale = scale_from_bound(bound, fmt.max, margin)
    return Fp8Tensor(quantize(x, scale, fmt), scale.reciprocal(), "tensor")


def quantize_with_scale_inv(x: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format) -> Fp8Tensor:
    """Per-tensor static quantization from a stored dequant multiplier (a checkpoint's
    `weight_scale` / `input_scale`): q = saturate(x * (1 / scale_inv)), dequantized by scale_inv
    itself. The trainer's frozen-scale passes and the rollout engine both quantize through this
    one function from the same fp32 `scale_inv`, so their FP8 values and GEMM multipliers are
    bit-identical (1 / (1 / s) need not equal s in fp32)."""
    scale_inv = scale_inv.detach().float().reshape(())
    return Fp8Tensor(quantize(x, scale_inv.reciprocal(), fmt), scale_inv, "tensor")


def quantize_per_row(x: torch.Tensor, fmt: Fp8Format, margin: int = 0) -> Fp8Tensor:
    """One scale per row of x [..., K] from each row's finite amax; scale_inv [..., 1]."""
    scale = scale_from_bound(finite_amax(x, dim=-1, keepdim=True), fmt.max, margin)
    return Fp8Tensor(quantize(x, scale, fmt), scale.reciprocal(), "row")


def _block_view(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Zero-pad x [N, K] to block multiples and view it as [nb, bn, kb, bk]."""
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization expects a 2-D tensor, found shape {tuple(x.shape)}")
    bn, bk = block
    rows, cols = x.shape
    nb, kb = math.ceil(rows / bn), math.ceil(cols / bk)
    x = x.float()
    if (rows, cols) != (nb * bn, kb * bk):  # only a ragged edge needs the padded copy
        x = torch.nn.functional.pad(x, (0, kb * bk - cols, 0, nb * bn - rows))
    return x.contiguous().view(nb, bn, kb, bk), nb, kb


def _block_amax(blocks: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(finite_amax of each block of blocks [nb, bn, kb, bk] -> [nb, kb], whether every element
    is known finite).

    On CPU: max(max x, -min x), which reads x twice and allocates no |x| temporary
    (bench/fp8_recipes.py's throughput check); a non-finite result means some block holds inf or
    NaN, and then every block takes the exact finite_amax path. Elsewhere finite_amax directly:
    the finiteness check would be a host sync on an accelerator.
    """
    if blocks.device.type == "cpu":
        bound = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
        if bool(torch.isfinite(bound).all()):
            return bound, True
    return finite_amax(blocks, dim=(1, 3)), False


def quantize_blockwise(
    x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int] = WEIGHT_BLOCK, margin: int = 0,
    scale_pow2: bool = False,
) -> Fp8Tensor:
    """One scale per (bn x bk) block of x [N, K]; scale_inv [ceil(N/bn), ceil(K/bk)].

    Use WEIGHT_BLOCK (128x128) for weights and ACTIVATION_BLOCK (1x128) for activations and
    gradients flattened to [tokens, channels]. An all-zero block gets scale 1. `scale_pow2`: each
    block's scale rounded down to a power of two (`pow2_scale`).
    """
    return quantize_blockwise_bounded(x, fmt, block, margin, scale_pow2)[0]


def block_scales(bound: torch.Tensor, fmt: Fp8Format, margin: int = 0, scale_pow2: bool = False) -> torch.Tensor:
    """The quantization multipliers of blocks whose max |x| is `bound` (any shape): TE's formula,
    rounded down to powers of two when `scale_pow2`."""
    scale = scale_from_bound(bound, fmt.max, margin)
    return pow2_scale(scale) if scale_pow2 else scale


def quantize_blockwise_bounded(
    x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int] = WEIGHT_BLOCK, margin: int = 0,
    scale_pow2: bool = False,
) -> tuple[Fp8Tensor, torch.Tensor | None]:
    """(`quantize_blockwise(x, ...)`, each block's max |x| [ceil(N/bn), ceil(K/bk)] in fp32 when
    every element of x is known finite (CPU), else None): the bounds let the block statistics
    rule out saturation without another pass over x."""
    if block[0] == 1 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % block[1]:
        groups = _quantize_ragged_groups(x, fmt, block[1], margin, scale_pow2)
        if groups is not None:
            return groups
    blocks, nb, kb = _block_view(x, block)
    bound, finite = _block_amax(blocks)
    scale = block_scales(bound, fmt, margin, scale_pow2)
    if finite:  # |x| <= its block's bound, so fl(x * scale) < the FP8 overflow threshold: no clamp
        q = (blocks * scale[:, None, :, None]).to(fmt.dtype)
    else:
        q = quantize(blocks, scale[:, None, :, None], fmt)
    q = q.view(nb * block[0], kb * block[1])
    result = Fp8Tensor(q[: x.shape[0], : x.shape[1]].contiguous(), scale.reciprocal(), "block", block)
    return result, bound if finite else None


def blockwise_scales(x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int], margin: int = 0,
                     scale_pow2: bool = False) -> torch.Tensor:
    """The multipliers [ceil(N/bn), ceil(K/bk)] with which `quantize_blockwise(x, ...)` scales
    each block of x [N, K] (bit for bit: the same bounds, the same formula)."""
    blocks, _, _ = _block_view(x, block)
    return block_scales(_block_amax(blocks)[0], fmt, margin, scale_pow2)


def quantize_with_block_scales(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                               block: tuple[int, int]) -> Fp8Tensor:
    """x [N, K] quantized blockwise with given multipliers `scale` [ceil(N/bn), ceil(K/bk)]
    (`blockwise_scales` of another tensor, e.g. the same weight before an update): saturating, so
    an element grown past its block's old bound maps to +-fp8_max. With x's own scales this equals
    `quantize_blockwise(x, ...)` bit for bit."""
    blocks, nb, kb = _block_view(x, block)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(f"block scales for a {tuple(x.shape)} tensor with {block} blocks must have shape "
                         f"{(nb, kb)}, found {tuple(scale.shape)}")
    q = quantize(blocks, scale[:, None, :, None], fmt).view(nb * block[0], kb * block[1])
    return Fp8Tensor(q[: x.shape[0], : x.shape[1]].contiguous(), scale.reciprocal(), "block", block)


def _quantize_ragged_groups(x: torch.Tensor, fmt: Fp8Format, width: int, margin: int, scale_pow2: bool):
    """`quantize_blockwise_bounded` for 1 x width groups of a CPU x [N, K] whose K is not a
    multiple of width, without the zero-padded copy of x and the cropped copy of q: the whole
    groups as one [N, K // width, width] view, the partial last group apart. Same codes, scales
    and bounds: the padding's zeros never raise a group's max(max x, -min x). None when x holds
    inf or NaN (the padded path handles those)."""
    rows, cols = x.shape
    whole = cols - cols % width
    x = x.float()
    parts = [x[:, :whole].view(rows, -1, width), x[:, None, whole:]] if whole else [x[:, None, :]]
    bound = torch.cat([torch.maximum(part.amax(-1), part.amin(-1).neg()) for part in parts], 1)
    if not bool(torch.isfinite(bound).all()):
        return None
    scale = block_scales(bound, fmt, margin, scale_pow2)  # [N, groups]
    q = torch.empty(rows, cols, dtype=fmt.dtype)
    groups = [q[:, :whole].view(rows, -1, width), q[:, None, whole:]] if whole else [q[:, None, :]]
    start = 0
    for part, codes in zip(parts, groups):  # finite, scaled by its own bound: no clamp needed
        codes.copy_(part * scale[:, start:start + part.shape[1], None])
        start += part.shape[1]
    return Fp8Tensor(q, scale.reciprocal(), "block", (1, width)), bound


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK
) -> torch.Tensor:
    """x ≈ q * scale_inv expanded over blocks; q [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]."""
    expected = (math.ceil(q.shape[0] / block[0]), math.ceil(q.shape[1] / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv for a {tuple(q.shape)} tensor with {block} blocks must have shape "
            f"{expected}, found {tuple(scale_inv.shape)}"
        )
    (rows, cols), bk = q.shape, block[1]
    values = q.float()  # scaled in place, whole groups then a partial last one: no [N, K] scales
    row_scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows]  # [N, ceil(K/bk)]
    whole = cols // bk
    values[:, : whole * bk].view(rows, whole, bk).mul_(row_scales[:, :whole, None])
    values[:, whole * bk:].mul_(row_scales[:, whole:])
    return values
