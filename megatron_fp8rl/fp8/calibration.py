"""Calibration criteria: the bound of a tensor derived from its high-precision values.

Owns: the three criteria the calibrated recipe offers, as free functions over the finite elements
of a tensor (non-finite elements are left to the statistics, never to a bound):
- 'max':        c = max |x|;
- 'percentile': c = the smallest |x| value with at most floor(budget * n) elements above it, so
                the fraction that saturates stays within the saturation budget;
- 'mse':        c = argmin over candidates c_k = amax * 2**(-k/4), k = 0..K-1, of
                sum (dequantize(quantize(x, fp8_max / c_k)) - x)**2 (the first, largest, on ties).
A bound is the value mapped to fp8_max (before the recipe's margin).
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only).
"""
from __future__ import annotations

import torch

from megatron_fp8rl.fp8.formats import Fp8Format
from megatron_fp8rl.fp8.quantize import dequantize, finite_amax, quantize, scale_from_bound

CRITERIA = ("max", "percentile", "mse")
MSE_CANDIDATES = 16
"""Candidates of the 'mse' search: amax * 2**(-k/4) for k < 16, i.e. down to amax / 2**3.75."""


def check_criterion(name: str) -> str:
    """`name` if it is a known calibration criterion, else ValueError listing the valid ones."""
    if name not in CRITERIA:
        raise ValueError(f"unknown calibration criterion {name!r}; valid: {', '.join(CRITERIA)}")
    return name


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().float().abs().flatten()
    return flat[torch.isfinite(flat)]


def percentile_bound(x: torch.Tensor, saturation_budget: float) -> torch.Tensor:
    """The k-th smallest |x|, k = n - floor(budget * n): at most floor(budget * n) of the n
    finite elements exceed it. budget 0 gives max |x|; 0 for a tensor without finite elements."""
    if not 0.0 <= saturation_budget < 1.0:
        raise ValueError(f"saturation_budget must be in [0, 1), found {saturation_budget}")
    values = _finite_abs(x)
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    allowed = int(saturation_budget * values.numel())
    return values.kthvalue(values.numel() - allowed).values


def mse_bound(x: torch.Tensor, fmt: Fp8Format, candidates: int = MSE_CANDIDATES) -> torch.Tensor:
    """The candidate bound amax * 2**(-k/4), k < candidates, with the least squared
    quantization error of x in `fmt` (per-tensor scale fp8_max / bound)."""
    values = _finite_abs(x)
    top = finite_amax(values)
    if top <= 0:
        return top
    exponents = torch.arange(candidates, dtype=torch.float32, device=values.device)
    bounds = top * torch.exp2(-exponents / 4)
    errors = torch.stack([_squared_error(values, bound, fmt) for bound in bounds])
    return bounds[torch.argmin(errors)]


def _squared_error(values: torch.Tensor, bound: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    scale = scale_from_bound(bound, fmt.max)
    restored = dequantize(quantize(values, scale, fmt), scale.reciprocal())
    return ((restored - values) ** 2).sum()


def calibrate_bound(
    x: torch.Tensor, criterion: str, fmt: Fp8Format, saturation_budget: float = 0.0
) -> torch.Tensor:
    """The bound of x under `criterion` ('max', 'percentile' or 'mse'); fp32 scalar."""
    check_criterion(criterion)
    if criterion == "max":
        return finite_amax(x)
    if criterion == "percentile":
        return percentile_bound(x, saturation_budget)
    return mse_bound(x, fmt)
