"""The two FP8 scale schemes that keep a step's later mini-batches' ratio from carrying scale moves
(issue 61 item 4; bench/ratio_noise.py measures them): power-of-two block scales
(BlockwiseScaling.scale_pow2) and weight scales held at θ_old's (HeldScaleWeightQuantizer,
models/megatron_fp8_linear.held_fp8_weight_scales). Oracles: ml_dtypes casts and float64 math."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.quantize import blockwise_scales, pow2_scale, quantize_blockwise
from megatron_fp8rl.fp8.quantizer import HeldScaleWeightQuantizer, make_quantizers
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling, CurrentScaling, groupwise32, recipe_by_name


def _spread(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Values whose 1x32 groups span many binades (each group its own magnitude)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-12, 12, (rows, math.ceil(cols / 32)), generator=generator).float())
    return torch.randn(rows, cols, generator=generator) * magnitudes.repeat_interleave(32, 1)[:, :cols]


def _cast(values: np.ndarray) -> np.ndarray:
    """The E4M3 bytes of float64 values, saturated at 448 first (ml_dtypes: an independent cast)."""
    return np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@pytest.mark.parametrize("cols", [96, 80], ids=["whole_groups", "ragged_last_group"])
def test_pow2_scales_are_powers_of_two_and_codes_match_an_independent_cast(cols):
    x = _spread(16, cols)
    q = quantize_blockwise(x, E4M3, (1, 32), scale_pow2=True)
    scale_inv = q.scale_inv.double().numpy()
    mantissa, _ = np.frexp(scale_inv)
    assert (mantissa == 0.5).all()  # every dequant multiplier is an exact power of two
    groups = np.pad(x.double().numpy(), ((0, 0), (0, -cols % 32))).reshape(16, -1, 32)
    amax = np.abs(groups).max(-1)
    assert np.array_equal(scale_inv, np.exp2(np.ceil(np.log2(amax / 448))))  # UE8M0: 2**ceil(log2(amax/448))
    expanded = np.repeat(scale_inv, 32, 1)[:, :cols]
    assert np.array_equal(q.data.view(torch.uint8).numpy(), _cast(x.double().numpy() / expanded))
    if cols % 32 == 0:  # each group's max lands in [224, 448]: at most one binade of range given up
        peaks = np.abs(q.data.float().numpy()).reshape(16, -1, 32).max(-1)
        assert ((peaks >= 224) & (peaks <= 448)).all()


def test_pow2_scale_rounds_down_exactly():
    scales = torch.tensor([1.0, 1.5, 0.75, 448 / 3.0, 2.0**-140, torch.finfo(torch.float32).max])
    expected = torch.tensor([1.0, 1.0, 0.5, 128.0, 2.0**-140, 2.0**127])
    assert torch.equal(pow2_scale(scales), expected)


def test_a_pow2_recipe_reaches_its_quantizers_and_fp32_scales_stay_the_default():
    x = _spread(8, 64, seed=1)
    pow2 = make_quantizers(recipe_by_name("groupwise32", scale_pow2=True))
    plain = make_quantizers(groupwise32())
    for quantizers, expect_pow2 in ((pow2, True), (plain, False)):
        for role in ("input", "weight"):
            scale_inv = getattr(quantizers, role).quantize(x).scale_inv
            assert bool((torch.frexp(scale_inv).mantissa == 0.5).all()) is expect_pow2, role


@pytest.mark.parametrize("recipe", [groupwise32(), recipe_by_name("groupwise32", scale_pow2=True), CurrentScaling()],
                         ids=["groupwise32", "groupwise32_pow2", "tensorwise"])
def test_held_weight_scales_match_the_live_quantizer_then_stay_as_the_weight_moves(recipe):
    torch.manual_seed(0)
    live = make_quantizers(recipe).weight
    old = torch.randn(24, 96) * 0.02
    held = HeldScaleWeightQuantizer(live, old)
    at_old, live_at_old = held.quantize(old), live.quantize(old)
    assert torch.equal(at_old.data.view(torch.uint8), live_at_old.data.view(torch.uint8))
    assert torch.equal(at_old.scale_inv, live_at_old.scale_inv)  # m = 0: exactly the recompute's FP8
    new = old + 1e-3 * torch.randn(24, 96)
    new[:, ::32] = old[:, ::32] * 1.5 + 0.05  # every group's first element grows past the old max
    moved = held.quantize(new)
    assert torch.equal(moved.scale_inv, live_at_old.scale_inv)
    scale_inv = live_at_old.scale_inv.double().numpy()
    expanded = scale_inv if scale_inv.ndim == 0 else np.repeat(scale_inv, 32, 1)
    assert np.array_equal(moved.data.view(torch.uint8).numpy(), _cast(new.double().numpy() / expanded))
    assert float(held.last_stats.saturated_fraction) > 0  # grown elements saturate at the held bound
    assert not torch.equal(live.quantize(new).scale_inv, live_at_old.scale_inv)  # live scales moved


def test_held_weight_scales_refuse_a_stateful_recipe_by_name():
    with pytest.raises(ValueError, match="not for CalibratedQuantizer"):
        HeldScaleWeightQuantizer(make_quantizers(CalibratedDelayedScaling()).weight, torch.randn(4, 32))


def test_blockwise_scales_are_the_ones_quantize_blockwise_uses():
    x = _spread(8, 80, seed=2)
    for pow2 in (False, True):
        assert torch.equal(blockwise_scales(x, E4M3, (1, 32), scale_pow2=pow2).reciprocal(),
                           quantize_blockwise(x, E4M3, (1, 32), scale_pow2=pow2).scale_inv)


def test_the_device_path_refuses_what_it_has_no_kernel_for():
    from megatron_fp8rl.fp8.device_quantize import check_device_quantizer, check_device_recipe

    pow2 = recipe_by_name("groupwise32", scale_pow2=True)
    with pytest.raises(ValueError, match=r"BlockwiseScaling\(scale_pow2=True\) has no device kernel"):
        check_device_recipe(pow2)
    with pytest.raises(ValueError, match=r"BlockQuantizer\(scale_pow2=True\) has no device kernel"):
        check_device_quantizer(make_quantizers(pow2).weight)
    held = HeldScaleWeightQuantizer(make_quantizers(groupwise32()).weight, torch.randn(4, 32))
    with pytest.raises(ValueError, match="HeldScaleWeightQuantizer has no device quantization"):
        check_device_quantizer(held)
    check_device_recipe(groupwise32())  # fp32 scales: the device kernels' own
