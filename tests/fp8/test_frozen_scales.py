"""Frozen-scale quantization (what aligned FP8 rollouts share with the trainer): quantizing from a
stored dequant multiplier, the scales a quantizer would use next, and frozen quantizers."""
import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.linear import fp8_linear
from megatron_fp8rl.fp8.quantize import quantize_with_scale_inv
from megatron_fp8rl.fp8.quantizer import frozen_quantizers, make_quantizers, next_scale
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CalibratedDelayedScaling, DelayedScaling


def test_quantize_with_scale_inv_matches_a_float8_cast_of_x_over_the_reciprocal():
    x = torch.randn(64, 48) * 3
    scale_inv = torch.tensor(0.011)
    q = quantize_with_scale_inv(x, scale_inv, E4M3)
    expected = (x * (1.0 / scale_inv)).clamp(-448, 448).to(torch.float8_e4m3fn)  # independent cast
    assert torch.equal(q.data.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(q.scale_inv, scale_inv)  # the GEMM multiplier is the stored value itself
    assert (q.data.float().abs() == 448).any()  # 3 / 0.011 > 448: saturation is exercised


def test_next_scale_of_a_calibrated_weight_is_the_scale_its_next_forward_uses():
    recipe = CalibratedDelayedScaling()
    quantizers = make_quantizers(recipe)
    weight = torch.randn(32, 16)
    predicted = next_scale(quantizers.weight, weight)
    used = quantizers.weight.quantize(weight).scale_inv.reciprocal()
    assert torch.equal(predicted, used)
    assert predicted == pytest.approx(448 / weight.abs().max() / 2**recipe.margin)


def test_next_scale_of_an_input_needs_a_recorded_bound():
    quantizers = make_quantizers(CalibratedDelayedScaling())
    with pytest.raises(ValueError, match="no bound yet"):
        next_scale(quantizers.input)
    x = torch.randn(8, 16)
    quantizers.input.quantize(x)
    # max over the window of recorded bounds, with the recipe's margin: (448 / amax) / 2
    assert next_scale(quantizers.input) == pytest.approx(448 / x.abs().max() / 2)
    with pytest.raises(ValueError, match="no fixed per-tensor scale"):
        next_scale(make_quantizers(BlockwiseScaling()).input)


def test_frozen_quantizers_reproduce_the_live_forward_and_leave_state_alone():
    """A delayed-scaling layer's next forward, replayed with its scales frozen, gives the same
    output bit for bit; frozen passes change no scaling state."""
    torch.manual_seed(0)
    quantizers = make_quantizers(DelayedScaling(fp8_format="e4m3", amax_history_len=4))
    weight, x = torch.randn(24, 16), torch.randn(10, 16)
    fp8_linear(x, weight, None, quantizers)  # step 1 records amaxes
    w_inv = next_scale(quantizers.weight, weight).reciprocal()
    in_inv = next_scale(quantizers.input).reciprocal()
    state = quantizers.state_dict()
    frozen = fp8_linear(x, weight, None, frozen_quantizers(quantizers, w_inv, in_inv), "fp32_accumulate")
    assert all(torch.equal(state[r][k], quantizers.state_dict()[r][k]) for r in ("input", "weight") for k in state[r])
    scales = (quantizers.weight.state.scale, quantizers.input.state.scale)
    live = fp8_linear(x, weight, None, quantizers, "fp32_accumulate")
    # live quantizes with s, frozen with 1 / (1 / s); for this seed that fp32 round trip is exact
    assert torch.equal(w_inv.reciprocal(), scales[0]) and torch.equal(in_inv.reciprocal(), scales[1])
    assert torch.equal(frozen, live)


def test_observing_frozen_quantizers_advance_the_live_state_as_a_live_pass_would():
    """observe=True (the aligned training forward): the output is the frozen one, bit for bit,
    and the live calibrated quantizers end in exactly the state a live pass over the same tensors
    leaves; observe=False leaves it untouched."""
    torch.manual_seed(1)
    recipe = CalibratedDelayedScaling(amax_history_len=4)
    weight, x1, x2 = torch.randn(24, 16), torch.randn(10, 16), 3 * torch.randn(10, 16)
    observed, reference = make_quantizers(recipe), make_quantizers(recipe)
    for quantizers in (observed, reference):
        fp8_linear(x1, weight, None, quantizers)
    w_inv = next_scale(observed.weight, weight).reciprocal()
    in_inv = next_scale(observed.input).reciprocal()
    plain_frozen = fp8_linear(x2, weight, None, frozen_quantizers(observed, w_inv, in_inv))
    assert torch.equal(observed.state_dict()["input"]["amax_history"],
                       reference.state_dict()["input"]["amax_history"])
    frozen = fp8_linear(x2, weight, None, frozen_quantizers(observed, w_inv, in_inv, observe=True))
    fp8_linear(x2, weight, None, reference)  # the live pass over the same tensors
    assert torch.equal(frozen, plain_frozen)
    for role in ("input", "weight"):
        for key, value in reference.state_dict()[role].items():
            assert torch.equal(observed.state_dict()[role][key], value), (role, key)
    # x2 escapes x1's bound: the live input scale recalibrated, the frozen pass used the old one
    assert not torch.equal(observed.input.state.scale, in_inv.reciprocal())
    assert observed.input.last_stats.saturated_fraction > 0
