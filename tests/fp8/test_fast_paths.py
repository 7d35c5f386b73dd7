"""The CPU fast paths of fp8/ give bit-identical results to the definitions they replace.

Fast paths (bench/fp8_linear_speed.py): `finite_amax` from one aminmax pass, per-tensor
statistics from ~3 passes (stats._per_tensor_cpu_stats), the calibrated quantizer's overflow check
from the peak, and the weight quantization cache (quantizer.WeightQuantCache). Oracles: the
elementwise definitions (`reference_stats`, abs/isfinite/amax written out here) and the same
layer with its weight cache removed.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.linear import Fp8Linear
from megatron_fp8rl.fp8.quantize import (
    Fp8Tensor, dequantize_blockwise, finite_amax, quantize, quantize_blockwise_bounded,
)
from megatron_fp8rl.fp8.quantizer import BlockQuantizer, CalibratedQuantizer, frozen_quantizers
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling, groupwise
from megatron_fp8rl.fp8.stats import block_quantization_stats, quantization_stats, reference_stats


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _inputs():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 96, generator=g) * torch.logspace(-6, 3, 96)
    with_zeros = base.clone()
    with_zeros[::3, ::5] = 0.0
    with_zeros[1, 1] = -0.0
    nonfinite = base.clone()
    nonfinite[0, 0], nonfinite[2, 3], nonfinite[5, 7] = float("nan"), float("inf"), -float("inf")
    return {
        "normal": base,
        "zeros": with_zeros,
        "all_zero": torch.zeros(8, 8),
        "neg_zero": -torch.zeros(8, 8),
        "nonfinite": nonfinite,
        "bf16": base.bfloat16(),
        "negative": -base.abs(),
    }


@pytest.mark.parametrize("name", list(_inputs()))
def test_finite_amax_matches_definition(name):
    x = _inputs()[name]
    absolute = x.abs().float()
    expected = torch.where(torch.isfinite(absolute), absolute, torch.zeros_like(absolute)).amax()
    assert _same(finite_amax(x), expected)


@pytest.mark.parametrize("name", list(_inputs()))
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("scale_factor", [0.5, 1.0, 40.0, 1e6])
def test_stats_match_reference(name, fmt, scale_factor):
    x = _inputs()[name]
    peak = finite_amax(x)
    scale = (fmt.max / peak if peak > 0 else torch.tensor(1.0)) * scale_factor
    q = quantize(x, scale, fmt)
    fast, slow = quantization_stats(x, scale, q, fmt, True), reference_stats(x, scale, q, fmt, True)
    for field in ("bound", "scale", "saturated_fraction", "underflow_fraction", "nonfinite_count",
                  "recalibrated"):
        assert _same(getattr(fast, field), getattr(slow, field)), field
    if scale_factor == 40.0 and name == "normal":
        assert fast.saturated_fraction > 0 and fast.underflow_fraction > 0  # both counts exercised


@pytest.mark.parametrize("name", list(_inputs()))
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("block", [(1, 128), (1, 32), (16, 32), (128, 128)])
def test_block_stats_match_reference(name, fmt, block):
    """Block statistics (from the FP8 bytes and either the quantization's block bounds or the
    fp8_max elements) == the definition over the scales expanded to x's shape, for
    quantize_blockwise's own scales and for scales 1.1x and 40x too large (saturating: the block
    peaks only, or most elements)."""
    x = _inputs()[name]
    result, bounds = quantize_blockwise_bounded(x, fmt, block)
    assert (bounds is None) == (name == "nonfinite")
    for factor in (1.0, 1.1, 40.0):
        scale_inv = result.scale_inv / factor
        full = dequantize_blockwise(torch.ones(x.shape), scale_inv.reciprocal(), block)  # scales, [N, K]
        q = Fp8Tensor(quantize(x, full, fmt), scale_inv, "block", block)
        slow = reference_stats(x, full, q.data, fmt, True)
        for fast in (block_quantization_stats(x, q, fmt), block_quantization_stats(x, q, fmt, bounds)):
            for field in ("bound", "scale", "saturated_fraction", "underflow_fraction", "nonfinite_count",
                          "recalibrated"):
                assert _same(getattr(fast, field), getattr(slow, field)), (field, factor)
        if name == "normal":  # both counts exercised
            assert (slow.saturated_fraction > 0) == (factor > 1)
            assert slow.underflow_fraction > 0 or factor > 1 or fmt is E5M2


def _uncached(layer: Fp8Linear) -> Fp8Linear:
    reference = copy.deepcopy(layer)
    reference.fp8_quantizers.weight.cache = None
    return reference


def _same_forward_backward(layer: Fp8Linear, reference: Fp8Linear, x: torch.Tensor, dy: torch.Tensor, step: int) -> None:
    """Both layers give the same bits: output, input/weight/bias gradients."""
    outputs = []
    for module in (layer, reference):
        xg = x.clone().requires_grad_()
        y = module(xg)
        y.backward(dy)
        outputs.append((y, xg.grad, module.weight.grad, module.bias.grad))
    for got, want in zip(*outputs):
        assert _same(got, want), f"step {step}"


def _sgd_step(step: int, *modules: Fp8Linear) -> None:
    """One plain update of each module's weight, alternating in place and through .data (which
    skips the version counter: a weight cache must still see it)."""
    for module in modules:
        with torch.no_grad():
            if step % 2:
                module.weight.data.add_(module.weight.grad, alpha=-0.05)
            else:
                module.weight.sub_(0.05 * module.weight.grad)
        module.weight.grad = module.bias.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_cache_is_bit_identical_across_steps(dtype):
    torch.manual_seed(1)
    layer = Fp8Linear(96, 48, recipe=CalibratedDelayedScaling(), dtype=dtype)
    reference = _uncached(layer)
    assert isinstance(layer.fp8_quantizers.weight, CalibratedQuantizer)
    assert layer.fp8_quantizers.weight.cache is not None
    for step in range(4):
        for _ in range(2):  # two micro-batches: the second reuses the cached weight
            _same_forward_backward(layer, reference, torch.randn(5, 7, 96, dtype=dtype),
                                   torch.randn(5, 7, 48, dtype=dtype), step)
            for role, stats in layer.fp8_stats().items():
                other = reference.fp8_stats()[role]
                assert _same(stats.scale, other.scale) and _same(stats.recalibrated, other.recalibrated)
                assert _same(stats.underflow_fraction, other.underflow_fraction)
        _sgd_step(step, layer, reference)
        state, ref_state = layer.get_extra_state(), reference.get_extra_state()
        for role in ("input", "weight", "grad_output"):
            for key in ("amax_history", "scale"):
                assert _same(state["quantizers"][role][key], ref_state["quantizers"][role][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_weight_cache_is_bit_identical_and_follows_updates(dtype):
    """The groupwise weight's cached quantization (its [K, N] codes and dequantized values
    included) gives the bits an uncached layer gives, forward and backward; the second
    micro-batch reuses it, and an optimizer update (also one through .data, which skips the
    version counter) replaces it."""
    torch.manual_seed(3)
    layer = Fp8Linear(300, 48, recipe=groupwise(), dtype=dtype)  # K = 300: a partial last group
    reference = _uncached(layer)
    cache = layer.fp8_quantizers.weight.cache
    assert isinstance(layer.fp8_quantizers.weight, BlockQuantizer) and cache is not None
    entries = []
    for step in range(3):
        for _ in range(2):
            _same_forward_backward(layer, reference, torch.randn(3, 7, 300, dtype=dtype),
                                   torch.randn(3, 7, 48, dtype=dtype), step)
            ours, theirs = layer.fp8_stats()["weight"], reference.fp8_stats()["weight"]
            for field in ("scale", "bound", "underflow_fraction"):
                assert _same(getattr(ours, field), getattr(theirs, field))
            entries.append(cache.block_entry)
        _sgd_step(step, layer, reference)
    assert [e is entries[0] for e in entries[:2]] == [True, True]
    assert len({id(e) for e in entries}) == 3  # one quantization per optimizer step


def test_frozen_weight_quantizer_shares_the_cache_bit_identically():
    torch.manual_seed(2)
    layer = Fp8Linear(64, 32, recipe=CalibratedDelayedScaling())
    x = torch.randn(10, 64)
    layer(x)  # calibrates the input quantizer and fills the cache
    weight_scale_inv = layer.fp8_stats()["weight"].scale.reciprocal()
    input_scale_inv = torch.tensor(0.0123)
    cached = frozen_quantizers(layer.fp8_quantizers, weight_scale_inv, input_scale_inv)
    plain = frozen_quantizers(layer.fp8_quantizers, weight_scale_inv, input_scale_inv)
    plain.weight.cache = None
    assert cached.weight.cache is layer.fp8_quantizers.weight.cache
    got, want = cached.weight.quantize(layer.weight), plain.weight.quantize(layer.weight)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert _same(got.scale_inv, want.scale_inv) and _same(got.dense, want.data.float())
    assert _same(got.t().dense, want.t().data.float())
    for field in ("scale", "saturated_fraction", "underflow_fraction", "recalibrated"):
        assert _same(getattr(cached.weight.last_stats, field), getattr(plain.weight.last_stats, field))
