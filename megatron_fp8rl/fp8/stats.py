"""Per-quantizer statistics, cheap enough to log every step.

Owns: `QuantStats`, `quantization_stats` and `block_quantization_stats`, computed from the
high-precision tensor x, the scale it was quantized with and the FP8 result q (elementwise
passes, no host sync on accelerators):
- bound: the value mapped to fp8_max, fp8_max / scale (the largest one for row/block scales);
- scale: the scale (the smallest one for row/block scales);
- saturated_fraction: finite elements clipped by saturation, |x * scale| > fmt.rounding_limit
  (smaller ones round to fp8_max anyway), over all elements;
- underflow_fraction: finite non-zero elements whose q is zero, over the finite non-zero elements;
- nonfinite_count: NaN and +-inf elements of x.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megatron_fp8rl.fp8.formats import Fp8Format
from megatron_fp8rl.fp8.quantize import Fp8Tensor, cpu_finite_peak


@dataclass
class QuantStats:
    """Statistics of one quantization (fp32 / int64 scalar tensors; `as_floats()` for logging)."""

    bound: torch.Tensor
    """Value mapped to fp8_max: fp8_max / scale."""
    scale: torch.Tensor
    """Quantization scale (x * scale is what gets rounded to FP8)."""
    saturated_fraction: torch.Tensor
    """Fraction of all elements clipped by saturation (finite inputs only)."""
    underflow_fraction: torch.Tensor
    """Fraction of the finite non-zero inputs that quantized to zero."""
    nonfinite_count: torch.Tensor
    """Number of NaN / inf inputs."""
    recalibrated: torch.Tensor
    """1 when the bound was recalibrated on this tensor instead of predicted from history."""

    def as_floats(self) -> dict[str, float]:
        """Plain Python numbers, for a logger."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


def quantization_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    q: torch.Tensor,
    fmt: Fp8Format,
    recalibrated: bool | torch.Tensor = False,
    peak: torch.Tensor | None = None,
) -> QuantStats:
    """Statistics of q = quantize(x, scale, fmt); `scale` broadcasts against x (any shape).
    `peak`: `cpu_finite_peak(x)` when the caller has it already (saves a pass).

    A finite CPU tensor with one positive scale takes `_per_tensor_cpu_stats` (the same values
    from ~3 cheap passes instead of ~12); everything else `reference_stats`."""
    fast = _per_tensor_cpu_stats(x, scale, q, fmt, recalibrated, peak)
    return fast if fast is not None else reference_stats(x, scale, q, fmt, recalibrated)


def _per_tensor_cpu_stats(x, scale, q, fmt, recalibrated, peak=None) -> QuantStats | None:
    """`reference_stats` for a CPU x with no inf/NaN and one finite positive scale, else None.

    With every x finite: saturated = #(|x * s| > limit), and since fl(|x| * s) is monotone in |x|
    it is 0 whenever fl(max|x| * s) <= limit (else counted); x == 0 gives q == 0, so
    underflow = #(q == 0) - #(x == 0), counted on q's bytes (FP8 zero is 0x00 / 0x80)."""
    if scale.numel() != 1 or q.shape != x.shape or q.element_size() != 1:
        return None
    peak = cpu_finite_peak(x) if peak is None else peak
    s = scale.detach().float().reshape(())
    if peak is None or not bool(torch.isfinite(s) & (s > 0)):
        return None
    x = x.detach()
    total = x.numel()
    if bool(peak * s > fmt.rounding_limit):
        saturated = ((x.float() * s).abs() > fmt.rounding_limit).sum()
    else:
        saturated = torch.zeros((), dtype=torch.int64)
    q_zeros = total - torch.count_nonzero(q.view(torch.uint8) & 0x7F)
    # x == 0 gives q == 0: without zeros in q there are none in x, and no pass over x is needed
    x_zeros = total - torch.count_nonzero(x) if bool(q_zeros > 0) else q_zeros
    nonzero = total - x_zeros
    smallest_scale = scale.float().min()
    return QuantStats(
        bound=fmt.max / smallest_scale,
        scale=smallest_scale,
        saturated_fraction=saturated.float() / total,
        underflow_fraction=(q_zeros - x_zeros).float() / nonzero.clamp(min=1).float(),
        nonfinite_count=torch.zeros((), dtype=torch.int64),
        recalibrated=torch.as_tensor(recalibrated, device=x.device).float(),
    )


def block_quantization_stats(x: torch.Tensor, q: Fp8Tensor, fmt: Fp8Format,
                             bounds: torch.Tensor | None = None) -> QuantStats:
    """`quantization_stats` of a blockwise quantization q of x [N, K] (quantize.quantize_blockwise,
    recalibrated: each block's scale comes from the block itself), without expanding the scales
    to x's shape. For a CPU x with no inf/NaN, underflow counts as in `_per_tensor_cpu_stats`, and
    saturation is 0 when every block's fl(max|x| * scale) <= the limit (`bounds`: the blocks' max
    |x| [N/bn, K/bk] of a finite x, quantize_blockwise_bounded's; fl(|x| * s) is monotone in |x|),
    else counted on the elements whose FP8 magnitude code is fp8_max or above (only they can be
    saturated). Anything else takes `reference_stats`."""
    scale = q.scale_inv.reciprocal()
    (bn, bk), total = q.block, x.numel()
    if bounds is None and cpu_finite_peak(x) is None:
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: x.shape[0], : x.shape[1]]
        return reference_stats(x, full, q.data, fmt, True)
    x = x.detach()
    codes = q.data.view(torch.uint8) & 0x7F
    if bounds is not None and not bool((bounds.float() * scale.float() > fmt.rounding_limit).any()):
        saturated = torch.zeros((), dtype=torch.int64)
    else:
        rows, cols = (codes >= _max_code(fmt)).nonzero(as_tuple=True)
        scaled = x[rows, cols].float() * scale.float()[rows // bn, cols // bk]
        saturated = (scaled.abs() > fmt.rounding_limit).sum()
    q_zeros = total - torch.count_nonzero(codes)
    x_zeros = total - torch.count_nonzero(x) if bool(q_zeros > 0) else q_zeros
    smallest_scale = scale.float().min()
    return QuantStats(
        bound=fmt.max / smallest_scale,
        scale=smallest_scale,
        saturated_fraction=saturated.float() / total,
        underflow_fraction=(q_zeros - x_zeros).float() / (total - x_zeros).clamp(min=1).float(),
        nonfinite_count=torch.zeros((), dtype=torch.int64),
        recalibrated=torch.ones((), device=x.device),
    )


def _max_code(fmt: Fp8Format) -> int:
    """The magnitude byte of fp8_max (E4M3 0x7E, E5M2 0x7B); larger codes are inf or NaN."""
    return int(torch.tensor(fmt.max).to(fmt.dtype).view(torch.uint8))


def reference_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    q: torch.Tensor,
    fmt: Fp8Format,
    recalibrated: bool | torch.Tensor = False,
) -> QuantStats:
    """`quantization_stats` by the definition, elementwise (the oracle of the fast path)."""
    x = x.detach().float()
    finite = torch.isfinite(x)
    scaled = (x * scale.float()).abs()
    saturated = (finite & (scaled > fmt.rounding_limit)).sum()
    nonzero = finite & (x != 0)
    underflow = (nonzero & (q.float() == 0)).sum()
    total = max(x.numel(), 1)
    smallest_scale = scale.float().min()
    return QuantStats(
        bound=fmt.max / smallest_scale,
        scale=smallest_scale,
        saturated_fraction=saturated.float() / total,
        underflow_fraction=underflow.float() / nonzero.sum().clamp(min=1).float(),
        nonfinite_count=(~finite).sum(),
        recalibrated=torch.as_tensor(recalibrated, device=x.device).float(),
    )
