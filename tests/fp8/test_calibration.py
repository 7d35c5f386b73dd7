"""Calibration criteria on hand-worked tensors and against a brute-force search with ml_dtypes."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_fp8rl.fp8.calibration import CRITERIA, calibrate_bound, mse_bound, percentile_bound
from megatron_fp8rl.fp8.formats import E4M3, E5M2


def test_max_ignores_non_finite_elements():
    x = torch.tensor([1.0, -6.0, math.nan, math.inf, 2.0])
    assert calibrate_bound(x, "max", E4M3).item() == 6.0


def test_percentile_keeps_saturation_within_budget():
    x = torch.arange(1, 1001, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(500)
    bound = percentile_bound(x, 0.01)
    assert bound.item() == 990.0
    assert (x.abs() > bound).float().mean().item() <= 0.01
    assert percentile_bound(x, 0.0).item() == 1000.0
    assert percentile_bound(torch.tensor([math.nan]), 0.1).item() == 0.0
    with pytest.raises(ValueError, match=r"saturation_budget must be in \[0, 1\), found 1.5"):
        percentile_bound(x, 1.5)


def _oracle_error(values: np.ndarray, bound: float, fmt) -> float:
    scale = np.float32(fmt.max) * (np.float32(1) / np.float32(bound))
    oracle_type = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt.name]
    scaled = np.clip(values * scale, -fmt.max, fmt.max).astype(np.float32)
    restored = scaled.astype(oracle_type).astype(np.float32) * (np.float32(1) / scale)
    return float(((restored.astype(np.float64) - values) ** 2).sum())


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_mse_bound_is_the_brute_force_minimum(fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.distributions.StudentT(2.0).sample((4000,)) if seed else torch.randn(4000, generator=gen)
    bound = mse_bound(x, fmt)
    values = x.abs().numpy()
    candidates = [values.max() * 2.0 ** (-k / 4) for k in range(16)]
    errors = [_oracle_error(values, c, fmt) for c in candidates]
    best = candidates[int(np.argmin(errors))]
    assert bound.item() == pytest.approx(best, rel=1e-6)


def test_mse_of_a_gaussian_is_its_amax_as_measured_in_design():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(4))
    assert mse_bound(x, E4M3).item() == pytest.approx(x.abs().max().item())


def test_unknown_criterion_lists_the_valid_ones():
    assert CRITERIA == ("max", "percentile", "mse")
    with pytest.raises(ValueError, match="valid: max, percentile, mse"):
        calibrate_bound(torch.ones(3), "p99", E4M3)
