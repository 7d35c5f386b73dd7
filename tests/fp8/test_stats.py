"""Per-quantizer statistics on a hand-made tensor."""
import math

import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.quantize import quantize
from megatron_fp8rl.fp8.stats import quantization_stats


def test_counts_saturation_underflow_and_non_finite():
    x = torch.tensor([1000.0, 460.0, 1e-4, 0.0, math.nan, math.inf, 1.0, -2e-5])
    scale = torch.tensor(1.0)
    stats = quantization_stats(x, scale, quantize(x, scale, E4M3), E4M3).as_floats()
    assert stats["bound"] == 448.0 and stats["scale"] == 1.0
    assert stats["saturated_fraction"] == 1 / 8  # 1000 clipped; 460 rounds to 448 anyway
    assert stats["underflow_fraction"] == pytest.approx(2 / 5)  # 1e-4 and -2e-5 of the 5 finite non-zeros
    assert stats["nonfinite_count"] == 2
    assert stats["recalibrated"] == 0.0


def test_row_scales_report_the_largest_bound():
    x = torch.tensor([[1.0, 2.0], [100.0, 0.0]])
    scale = torch.tensor([[224.0], [4.5]])
    stats = quantization_stats(x, scale, quantize(x, scale, E5M2), E5M2, recalibrated=True)
    assert stats.scale.item() == 4.5
    assert stats.bound.item() == pytest.approx(57344.0 / 4.5)
    assert stats.recalibrated.item() == 1.0
