"""Quantize/dequantize against independent oracles: ml_dtypes casts and a brute-force
nearest-representable search over all 256 codes of each FP8 format."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8rl.fp8 import formats
from megatron_fp8rl.fp8.quantize import (
    dequantize,
    dequantize_blockwise,
    quantize,
    quantize_blockwise,
    quantize_per_row,
    quantize_per_tensor,
    transposed_codes,
)

ORACLE_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FORMATS = [formats.E4M3, formats.E5M2]


def oracle_quantize(x: np.ndarray, scale: np.ndarray, fmt) -> np.ndarray:
    """numpy fp32 product, clip to +-max, ml_dtypes round-to-nearest-even cast; uint8 codes."""
    scaled = (x.astype(np.float32) * np.asarray(scale, dtype=np.float32)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        clipped = np.clip(scaled, -fmt.max, fmt.max)
    return clipped.astype(ORACLE_DTYPES[fmt.name]).view(np.uint8)


def torch_scale(fp8_max: float, amax: np.ndarray) -> np.ndarray:
    """fp8_max / amax as eager torch evaluates `float / Tensor` (and TE's eager
    `_default_sf_compute`): fp8_max * reciprocal(amax), two fp32 roundings; 1 where amax is 0."""
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(divide="ignore"):
        scale = np.float32(fp8_max) * (np.float32(1) / amax)
    return np.where(amax > 0, scale, np.float32(1)).astype(np.float32)


def codes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def assert_same_codes(ours: torch.Tensor, expected: np.ndarray, fmt) -> None:
    """Bit-exact, except that any NaN encoding matches any other."""
    got = codes(ours)
    ours_nan = np.isnan(got.view(ORACLE_DTYPES[fmt.name]).astype(np.float32))
    oracle_nan = np.isnan(expected.view(ORACLE_DTYPES[fmt.name]).astype(np.float32))
    np.testing.assert_array_equal(ours_nan, oracle_nan)
    np.testing.assert_array_equal(got[~ours_nan], expected[~oracle_nan])


def edge_values(fmt) -> np.ndarray:
    sub = fmt.min_subnormal
    values = [
        0.0, -0.0, sub, -sub, sub / 2, sub / 4, 0.75 * sub, 1.5 * sub, 2.5 * sub, sub * 3,
        fmt.max, -fmt.max, fmt.max + 1, -(fmt.max + 1), fmt.rounding_limit, fmt.rounding_limit + 1,
        -fmt.rounding_limit - 1, 1e30, -1e30, np.finfo(np.float32).max, 1e-40, -1e-45,
        math.inf, -math.inf, math.nan, 1.0, 1.0625, 1.125, 1.1875, 3.0 * 2**-7,
    ]
    return np.array(values, dtype=np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_matches_ml_dtypes_on_edges(fmt):
    x = edge_values(fmt)
    ours = quantize(torch.from_numpy(x), torch.tensor(1.0), fmt)
    assert ours.dtype == fmt.dtype
    assert_same_codes(ours, oracle_quantize(x, 1.0, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 0.37, 1234.5, 2.0**-20])
def test_quantize_matches_ml_dtypes_on_random_values(fmt, scale):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-24, 24, (4096,), generator=gen).float())
    ours = quantize(x, torch.tensor(scale), fmt)
    assert_same_codes(ours, oracle_quantize(x.numpy(), scale, fmt), fmt)


def _finite_table(fmt):
    """All finite values of the format and their codes, from ml_dtypes' decoding of 0..255."""
    all_codes = np.arange(256, dtype=np.uint8)
    values = all_codes.view(ORACLE_DTYPES[fmt.name]).astype(np.float64)
    keep = np.isfinite(values)
    return values[keep], all_codes[keep]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_is_saturating_round_to_nearest_even(fmt):
    """Brute force: nearest finite value (ties to the even code), clipped inputs to +-max."""
    values, value_codes = _finite_table(fmt)
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(3000, generator=gen) * 2 - 1) * fmt.max * 1.5
    x = torch.cat([x, torch.from_numpy(values.astype(np.float32))])
    x = torch.cat([x, torch.from_numpy(((values[1:] + values[:-1]) / 2).astype(np.float32))])
    got = codes(quantize(x, torch.tensor(1.0), fmt))
    for xi, code in zip(x.double().numpy(), got):
        distance = np.abs(values - np.clip(xi, -fmt.max, fmt.max))
        best = np.flatnonzero(distance == distance.min())
        if len(best) > 1:  # tie: the even mantissa (code's lowest bit 0); +-0 both allowed
            best = [b for b in best if value_codes[b] % 2 == 0] or best
        assert code in value_codes[best], (xi, code, value_codes[best])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64),
    st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
    st.sampled_from(FORMATS),
)
def test_finite_or_infinite_inputs_never_become_nan(values, scale, fmt):
    q = quantize(torch.tensor(values, dtype=torch.float32), torch.tensor(scale), fmt)
    restored = q.float()
    assert not torch.isnan(restored).any()
    assert restored.abs().max() <= fmt.max


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_per_tensor_scale_maps_amax_to_max(fmt):
    x = torch.tensor([0.5, -3.0, 1.25, float("nan"), float("inf")])
    result = quantize_per_tensor(x, fmt)
    scale = torch_scale(fmt.max, 3.0)
    assert result.scale_inv.item() == np.float32(1) / scale
    assert_same_codes(result.data, oracle_quantize(x.numpy(), scale, fmt), fmt)
    assert result.data.float()[1].item() == -fmt.max
    margin = quantize_per_tensor(x, fmt, margin=2)
    assert margin.scale_inv.item() == pytest.approx(4 / scale, rel=2e-7)


def test_dequantize_is_product_with_scale_inv():
    q = torch.tensor([1.0, -2.5, 448.0]).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize(q, torch.tensor(0.5)), torch.tensor([0.5, -1.25, 224.0]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_per_row_matches_oracle(fmt):
    x = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.0, 5.0])[:, None]
    result = quantize_per_row(x, fmt)
    assert result.scale_inv.shape == (6, 1)
    scale = torch_scale(fmt.max, np.abs(x.numpy()).max(axis=1, keepdims=True))
    assert_same_codes(result.data, oracle_quantize(x.numpy(), scale, fmt), fmt)


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((5, 300), (1, 128)), ((6, 576), (1, 128)),
                                         ((4, 100), (1, 128)), ((3, 512), (1, 128))])
def test_blockwise_matches_oracle(shape, block):
    """Including 1x128 groups with a partial last group (quantized without padding) whose values
    are all negative, or all zero."""
    fmt = formats.E4M3
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=gen) * torch.rand(*shape, generator=gen).pow(4) * 100
    x[: block[0], : block[1]] = 0.0  # an all-zero block keeps scale 1
    x[-1] = -x[-1].abs()
    x[-2, -(shape[1] % 128 or 128):] = 0.0
    result = quantize_blockwise(x, fmt, block)
    nb, kb = math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
    assert result.scale_inv.shape == (nb, kb)
    xn = x.numpy()
    for i in range(nb):
        for j in range(kb):
            tile = xn[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale = torch_scale(fmt.max, np.abs(tile).max())
            got = result.data[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            assert_same_codes(got.contiguous(), oracle_quantize(tile, scale, fmt), fmt)
            assert result.scale_inv[i, j].item() == np.float32(1) / scale
    restored = dequantize_blockwise(result.data, result.scale_inv, block)
    # relative rounding error <= 2**-4 for normals; absolute <= half the subnormal step
    subnormal_step = result.scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    half_step = subnormal_step[: shape[0], : shape[1]] * fmt.min_subnormal / 2
    assert ((restored - x).abs() <= x.abs() * 2.0**-4 + half_step).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_transposed_codes_are_the_transposed_fp32_values(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype)[torch.randperm(256)[:240]].reshape(16, 15)
    got = transposed_codes(codes)
    assert got.is_contiguous() and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), codes.float().t().contiguous().view(torch.int32))


def test_dequantize_blockwise_rejects_wrong_scale_shape():
    q = torch.zeros(130, 10).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"must have shape \(2, 1\), found \(1, 1\)"):
        dequantize_blockwise(q, torch.ones(1, 1))


def test_unknown_format_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid: e4m3, e5m2"):
        formats.get_format("e3m4")
    with pytest.raises(ValueError, match="valid: e4m3, hybrid"):
        formats.recipe_formats("e5m2")
