"""Quantizer behaviour per recipe: TE's delayed timing, our recalibration, weights calibrated
from current values, non-finite inputs."""
import math

import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.quantize import quantize_per_tensor
from megatron_fp8rl.fp8.quantizer import (
    CalibratedQuantizer,
    DelayedQuantizer,
    make_quantizers,
)
from megatron_fp8rl.fp8.recipe import (
    BlockwiseScaling,
    CalibratedDelayedScaling,
    CurrentScaling,
    megatron_default_delayed,
    te_default_delayed,
)


def gaussian(seed: int, scale: float = 1.0, n: int = 512) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def test_delayed_uses_the_previous_steps_amax():
    quantizer = DelayedQuantizer(E4M3, megatron_default_delayed())
    first, second = gaussian(0), gaussian(1, 10.0)
    quantizer.quantize(first)
    assert quantizer.last_stats.scale.item() == 1.0  # first use: scale 1 (TE)
    quantizer.quantize(second)
    assert quantizer.last_stats.scale.item() == pytest.approx(448.0 / first.abs().max().item(), rel=1e-6)
    assert quantizer.last_stats.saturated_fraction.item() > 0  # a 10x jump clips under TE delayed


def test_calibrated_recalibrates_at_once_when_the_tensor_escapes():
    spec = CalibratedDelayedScaling(margin=1, amax_history_len=4)
    quantizer = CalibratedQuantizer(E4M3, spec, is_weight=False)
    first = gaussian(0)
    out = quantizer.quantize(first)  # no bound yet: calibrated on the tensor itself
    assert quantizer.last_stats.recalibrated.item() == 1.0
    assert out.scale_inv.item() == pytest.approx(2 * first.abs().max().item() / 448.0, rel=1e-6)
    quantizer.quantize(gaussian(1))  # inside the predicted bound: delayed
    assert quantizer.last_stats.recalibrated.item() == 0.0
    predicted = quantizer.state.scale.clone()
    escaping = gaussian(2, 10.0)
    out = quantizer.quantize(escaping)
    assert quantizer.last_stats.recalibrated.item() == 1.0
    assert quantizer.last_stats.saturated_fraction.item() == 0.0
    fresh = quantize_per_tensor(escaping, E4M3, bound=escaping.abs().max(), margin=1)
    assert torch.equal(out.data.view(torch.uint8), fresh.data.view(torch.uint8))
    assert quantizer.state.scale.item() < predicted.item()


def test_calibrated_weights_follow_their_current_values():
    quantizer = CalibratedQuantizer(E4M3, CalibratedDelayedScaling(margin=0), is_weight=True)
    weight = gaussian(3)
    for factor in (1.0, 4.0, 0.25):
        out = quantizer.quantize(weight * factor)
        assert out.scale_inv.item() == pytest.approx(factor * weight.abs().max().item() / 448.0, rel=1e-6)
        assert quantizer.last_stats.recalibrated.item() == 1.0


def test_percentile_criterion_saturates_within_budget():
    spec = CalibratedDelayedScaling(criterion="percentile", saturation_budget=0.01,
                                    overflow_tolerance=0.02, margin=0)
    quantizer = CalibratedQuantizer(E4M3, spec, is_weight=True)
    x = gaussian(5, n=4000)
    quantizer.quantize(x)
    assert 0 < quantizer.last_stats.saturated_fraction.item() <= 0.01


def test_non_finite_inputs_are_counted_and_never_reach_a_scale():
    x = gaussian(6)
    x[:3] = torch.tensor([math.nan, math.inf, -math.inf])
    for quantizer in (DelayedQuantizer(E4M3, te_default_delayed()),
                      CalibratedQuantizer(E4M3, CalibratedDelayedScaling(), is_weight=False)):
        quantizer.quantize(gaussian(7))
        good = quantizer.state.scale.clone()
        out = quantizer.quantize(x)
        assert quantizer.last_stats.nonfinite_count.item() == 3
        assert torch.isfinite(quantizer.state.scale) and quantizer.state.scale > 0
        assert torch.isnan(out.data[0].float()) and out.data[1].float() == E4M3.max
        if isinstance(quantizer, DelayedQuantizer):
            assert torch.equal(quantizer.state.scale, good)  # TE: keep the last good scale


def test_make_quantizers_uses_e5m2_for_gradients_under_hybrid():
    for recipe in (CalibratedDelayedScaling(), te_default_delayed(), CurrentScaling(),
                   BlockwiseScaling(fp8_format="hybrid")):
        quantizers = make_quantizers(recipe)
        assert quantizers.input.fmt is E4M3 and quantizers.weight.fmt is E4M3
        assert quantizers.grad_output.fmt is E5M2
    e4m3 = make_quantizers(CalibratedDelayedScaling(fp8_format="e4m3"))
    assert e4m3.grad_output.fmt is E4M3
    with pytest.raises(TypeError, match="unknown FP8 recipe type str"):
        make_quantizers("calibrated")


def test_quantizer_state_roundtrip_names_missing_roles():
    quantizers = make_quantizers(CalibratedDelayedScaling())
    quantizers.input.quantize(gaussian(8))
    state = quantizers.state_dict()
    fresh = make_quantizers(CalibratedDelayedScaling())
    fresh.load_state_dict(state)
    assert torch.equal(fresh.input.state.scale, quantizers.input.state.scale)
    del state["grad_output"]
    with pytest.raises(KeyError, match="layer: FP8 scaling state has no 'grad_output' entry"):
        fresh.load_state_dict(state, "layer")
