"""Per-quantizer statistics, cheap enough to log every step.

Owns: `QuantStats` and `quantization_stats`, computed from the high-precision tensor x, the scale
it was quantized with and the FP8 result q (one elementwise pass, no host sync):
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
) -> QuantStats:
    """Statistics of q = quantize(x, scale, fmt); `scale` broadcasts against x (any shape)."""
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
