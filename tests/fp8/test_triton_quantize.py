"""The fused Triton quantization kernels (fp8/triton_quantize.py) and the device path's quantizers
(fp8/device_quantize.py) under Triton's interpreter: codes, scales, transposed and column-wise
copies and statistics equal the CPU quantizers (fp8/quantize.py, fp8/quantizer.py) bit for bit,
and the codes equal ml_dtypes' round-to-nearest-even casts (an oracle outside torch), for ragged
shapes, all-zero groups, inf / NaN, saturation, -0 and ties; scaling state evolves identically."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_fp8rl.fp8 import triton_quantize as tq
from megatron_fp8rl.fp8.device_quantize import DeviceQuantStats, device_quantize, device_quantize_rows
from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.quantize import (
    finite_amax,
    quantize,
    quantize_blockwise,
    quantize_per_row,
    quantize_per_tensor,
)
from megatron_fp8rl.fp8.quantizer import StaticQuantizer, make_quantizers
from megatron_fp8rl.fp8.recipe import recipe_by_name
from megatron_fp8rl.fp8.stats import reference_stats

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
ML_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _edge_tensor(m=70, k=300, seed=0) -> torch.Tensor:
    """Channels of unequal range (ragged K: 300 = 2 groups of 128 + 44), an all-zero row and an
    all-zero 1x32 group, NaN, +-inf, -0, one huge outlier, subnormal-range values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-6, 2, k)
    x[3] = 0.0
    x[5, 32:64] = 0.0
    x[0, 0], x[1, 1], x[1, -1], x[2, 2], x[4, 5] = float("nan"), float("inf"), -float("inf"), -0.0, 3e7
    x[6, :8] = torch.tensor([1e-30, -1e-30, 2.0**-130, 1e-9, -1e-12, 1e-5, -2e-6, 7e-7])
    return x


def _ties(fmt_name: str) -> torch.Tensor:
    """Values exactly halfway between neighbours of the FP8 grid (normal and subnormal), their
    negatives, values just off the ties, and values beyond fp8_max (saturation)."""
    if fmt_name == "e4m3":
        values = [1 + 1 / 16, 1 + 3 / 16, 2**-10, 3 * 2**-10, 5 * 2**-10, 2**-6 - 2**-10, 240 + 8, 440, 460, 470, 1e9]
    else:
        values = [1 + 1 / 8, 1 + 3 / 8, 2**-17, 3 * 2**-17, 5 * 2**-17, 2**-14 - 2**-17, 49152 + 4096, 60000, 1e9]
    values = torch.tensor(values, dtype=torch.float32)
    near = torch.nextafter(values, torch.full_like(values, float("inf")))
    return torch.cat([values, -values, near, -near, torch.tensor([0.0, -0.0])]).reshape(1, -1)


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
def test_codes_round_to_nearest_even_like_ml_dtypes(fmt_name):
    fmt, x = FORMATS[fmt_name], _ties(fmt_name)
    out = tq.quantize_codes(x, fmt, "tensor", scale=torch.tensor(1.0))
    clamped = np.clip(x.numpy(), -fmt.max, fmt.max)  # saturation first, as fp8/quantize.py does
    oracle = torch.from_numpy(clamped.astype(ML_DTYPES[fmt_name]).view(np.uint8).copy())
    assert torch.equal(out["codes"].view(torch.uint8), oracle)
    assert _same(out["codes"], quantize(x, torch.tensor(1.0), fmt))


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
def test_per_tensor_and_per_row_codes_equal_the_cpu_quantizers(fmt_name):
    fmt, x = FORMATS[fmt_name], _edge_tensor()
    reference = quantize_per_tensor(x, fmt, margin=1)
    scale = reference.scale_inv.reciprocal()
    out = tq.quantize_codes(x, fmt, "tensor", scale=scale, transposed=True)
    assert _same(out["codes"], reference.data)
    assert _same(out["codes_t"], reference.data.t().contiguous())
    rows = quantize_per_row(x, fmt, margin=1)
    got = device_quantize_rows(x, fmt, margin=1)
    assert _same(got.data, rows.data) and _same(got.scale_inv, rows.scale_inv)


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(1, 128), (1, 32), (128, 128)])
def test_group_and_block_codes_scales_and_backward_copies_equal_the_cpu_quantizers(fmt_name, block):
    fmt, x = FORMATS[fmt_name], _edge_tensor(m=130)  # M crosses a 128-row block
    grouped = block[0] == 1
    out = tq.quantize_codes(x, fmt, "group" if grouped else "block", block=block[1],
                            colwise=grouped, transposed=not grouped)
    reference = quantize_blockwise(x, fmt, block)
    assert _same(out["codes"], reference.data) and _same(out["scale_inv"], reference.scale_inv)
    if grouped:  # the column-wise copy: x^T quantized in 1xG groups (Gx1 groups of x)
        columns = quantize_blockwise(x.t().contiguous(), fmt, block)
        assert _same(out["codes_t"], columns.data) and _same(out["scale_inv_t"], columns.scale_inv)
    else:
        assert _same(out["codes_t"], reference.data.t().contiguous())
        assert _same(out["scale_inv_t"], reference.scale_inv.t().contiguous())


def test_statistics_counters_equal_the_reference_counts():
    x = _edge_tensor()
    scale = torch.tensor(30.0)  # saturates the wide channels
    counts = tq.new_counters(x.device)
    out = tq.quantize_codes(x, E4M3, "tensor", scale=scale, counts=counts, amax=True)
    finite = torch.isfinite(x)
    saturated = (finite & ((x * scale).abs() > E4M3.rounding_limit)).sum()
    nonzero = finite & (x != 0)
    underflow = (nonzero & (out["codes"].float() == 0)).sum()
    expected = torch.stack([saturated, underflow, nonzero.sum(), (~finite).sum(), torch.isnan(x).sum()])
    assert torch.equal(counts, expected) and int(saturated) > 0 and int(underflow) > 0
    assert torch.equal(out["amax_partial"].amax(), torch.tensor(float("inf")))  # max |x| over non-NaN elements
    stats = DeviceQuantStats(counts, x.numel(), scale, E4M3, torch.tensor(0.0)).as_floats()
    assert stats == reference_stats(x, scale, out["codes"], E4M3).as_floats()


def test_amax_pass_gives_finite_row_maxima_and_the_overflow_count():
    x = _edge_tensor()
    assert _same(tq.row_bounds(x).amax(0), finite_amax(x, dim=1))
    partial, overflow = tq.tensor_bounds(x, torch.tensor(30.0), "e4m3")
    assert partial.shape == overflow.shape == (3 * 3,)  # one per program: 70 rows / 32, 300 columns / 128
    assert _same(partial.amax(), finite_amax(x))
    scaled = (x * 30.0).abs()
    assert int(overflow.sum()) == int((torch.isfinite(scaled) & (scaled > E4M3.rounding_limit)).sum()) > 0


def test_cpu_tensors_without_the_interpreter_are_refused():
    with tq.triton.knobs.runtime.scope():  # restores the knob to reading the environment afterwards
        tq.triton.knobs.runtime.interpret = False
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            tq.quantize_codes(torch.ones(2, 4), E4M3, "tensor", scale=torch.tensor(1.0))


RECIPES = ["calibrated", "te_delayed", "megatron_delayed", "tensorwise", "blockwise", "groupwise", "groupwise32"]


def _steps(seed=1):
    """Three tensors a quantizer sees in turn: the scale grows, then NaN/inf arrive, then an outlier."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randn(40, 160, generator=gen)
    second = _edge_tensor(40, 160, seed) * 0.1
    third = torch.randn(40, 160, generator=gen) * 50
    return [first, second, third]


def _state(quantizer):
    state = getattr(quantizer, "state", None)
    return None if state is None else (state.amax_history.clone(), state.scale.clone())


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_device_quantize_equals_the_cpu_quantizer_call_for_call(name, role):
    recipe = recipe_by_name(name, fp8_format="hybrid")
    cpu, device = (getattr(make_quantizers(recipe), role) for _ in range(2))
    for x in _steps():
        expected, got = cpu.quantize(x), device_quantize(device, x, transposed=True)
        assert _same(got.data, expected.data) and _same(got.scale_inv.float(), expected.scale_inv.float())
        assert (got.granularity, got.block) == (expected.granularity, expected.block)
        assert device.last_stats.as_floats() == cpu.last_stats.as_floats()
        cpu_state, device_state = _state(cpu), _state(device)
        if cpu_state is not None:
            assert all(_same(a, b) for a, b in zip(device_state, cpu_state))


def test_static_quantizer_and_its_observer_equal_the_cpu_path():
    live_cpu, live_device = (make_quantizers(recipe_by_name("calibrated")).input for _ in range(2))
    scale_inv = torch.tensor(0.013)
    cpu = StaticQuantizer(E4M3, scale_inv, observer=live_cpu)
    device = StaticQuantizer(E4M3, scale_inv, observer=live_device)
    for x in _steps():
        assert _same(device_quantize(device, x).data, cpu.quantize(x).data)
        assert device.last_stats.as_floats() == cpu.last_stats.as_floats()
        assert all(_same(a, b) for a, b in zip(_state(live_device), _state(live_cpu)))


def test_stats_object_reads_nothing_until_asked():
    quantizer = make_quantizers(recipe_by_name("tensorwise")).input
    device_quantize(quantizer, torch.randn(8, 64))
    stats = quantizer.last_stats
    assert isinstance(stats, DeviceQuantStats) and stats.counts.dtype == torch.int64
    assert [f.name for f in dataclasses.fields(stats.materialize())] == list(stats.as_floats())


@pytest.mark.parametrize("scales,colwise,transposed", [(0, False, True), (2, True, False), (3, False, True)])
def test_gpu_code_path_of_the_quantize_kernels_compiles_for_sm90(monkeypatch, scales, colwise, transposed):
    """Triton compiles both kernels' GPU path (the JIT-wrapped helpers `_load_slab`, `_fp8_codes`,
    `_scale_of` and tl.max / tl.sum, every output and counter on) for an H100/H200 without a GPU:
    what the interpreter tests above run is the body the GPU compiles."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    quantize, amax = tq._kernels(False)
    ints = ("M", "K", "stride_xm", "stride_qm", "stride_qtk", "stride_sm", "stride_stk")
    signature = {**dict.fromkeys(ints, "i32"), "x_ptr": "*bf16", "q_ptr": "*u8", "qt_ptr": "*u8", "s_ptr": "*fp32",
                 "st_ptr": "*fp32", "scale_ptr": "*fp32", "amax_ptr": "*fp32", "counts_ptr": "*i64"}
    block = (128, 128) if scales == 3 or colwise else (32, 128)
    constants = dict(tq.format_constants("e4m3"), MARGIN_MUL=1.0, SCALES=scales, TRANSPOSED=transposed,
                     COLWISE=colwise, AMAX=True, STATS=True, BLOCK_M=block[0], BLOCK_K=block[1],
                     SLAB_M=tq.SLAB_ROWS)
    signature.update(dict.fromkeys(constants, "constexpr"))
    ptx = compile(ASTSource(quantize, signature, constants), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "atom.global" in ptx or "red.global" in ptx  # the statistics counters, added on the device
    signature = {"x_ptr": "*fp32", "bound_ptr": "*fp32", "scale_ptr": "*fp32", "overflow_ptr": "*i32", "M": "i32",
                 "K": "i32", "stride_xm": "i32"}
    constants = dict(LIMIT=464.0, OVERFLOW=True, ROWS=scales == 0, BLOCK_M=32, BLOCK_K=128)
    signature.update(dict.fromkeys(constants, "constexpr"))
    assert ".entry" in compile(ASTSource(amax, signature, constants), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
