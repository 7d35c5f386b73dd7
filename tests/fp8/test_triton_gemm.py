"""The 'triton_invariant' FP8 GEMM (fp8/triton_gemm.py) on CPU under Triton's interpreter: agreement
with the 'exact' / float64 oracles within the fp32-accumulation bound, rows bit-identical whatever
the batch around them (per tensor, 1x128 and 1x32 groups, 128x128 blocks, ragged K), the bf16
epilogue, the GPU code path compiled for sm_90 (no GPU needed), and bad input and kernel-less
recipe x GEMM combinations refused by name (fp8/gemm.py's device routing: tests/fp8/test_gemm.py).

The bound (u = 2**-24, fp32's unit roundoff; |A|, |B| the dequantized operands' magnitudes):
products of FP8 values are exact in fp32, so the kernel's only errors are its fp32 additions
and its scale multiplications. Summing n terms in any order errs by at most (n - 1) u sum|terms|
to first order. Per tensor: (K - 1) u for the sum, 2 u for the two scales; the oracle rounds its
exact sum once and multiplies twice, 3 u: |y - oracle| <= (K + 4) u (|A| @ |B|^T). Groups of G:
each group's sum ((G - 1) u), its two scales (2 u) and the sum over ceil(K/G) groups (ceil(K/G) u),
against a float64 reference: (G + 2 + ceil(K/G)) u (|A| @ |B|^T). A 1 % allowance covers
second-order terms.
"""
import inspect
import math

import pytest
import torch

from bench import triton_gemm as triton_gemm_bench
from megatron_fp8rl.fp8 import triton_gemm
from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.gemm import check_recipe_gemm, fp8_matmul_nt, resolve_gemm
from megatron_fp8rl.fp8.linear import fp8_linear
from megatron_fp8rl.fp8.quantize import (
    ACTIVATION_BLOCK,
    WEIGHT_BLOCK,
    Fp8Tensor,
    quantize_blockwise,
    quantize_per_row,
    quantize_per_tensor,
)
from megatron_fp8rl.fp8.quantizer import make_quantizers
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CurrentScaling, groupwise, groupwise32, recipe_by_name
from megatron_fp8rl.fp8.triton_gemm import triton_fp8_matmul_nt

pytestmark = pytest.mark.triton

U = 2.0**-24
M, N, K = 70, 200, 384  # M crosses a 64-row tile (groups), N a 128-column tile; K = 3 groups of 128
SCHEMES = {  # name: (activation block, weight block) or None per tensor
    "tensor": None,
    "block128": (ACTIVATION_BLOCK, WEIGHT_BLOCK),
    "group128": (ACTIVATION_BLOCK, ACTIVATION_BLOCK),
    "group32": ((1, 32), (1, 32)),
    "block32": ((1, 32), (32, 32)),
}


def _operands(scheme: str, m=M, n=N, k=K, seed=0, fmt_b=E4M3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)  # channels of unequal range
    w = torch.randn(n, k, generator=gen) * 0.05
    if SCHEMES[scheme] is None:
        return quantize_per_tensor(x, E4M3), quantize_per_tensor(w, fmt_b)
    a_block, b_block = SCHEMES[scheme]
    return quantize_blockwise(x, E4M3, a_block), quantize_blockwise(w, fmt_b, b_block)


def _magnitude(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    return a.dequantize().double().abs() @ b.dequantize().double().abs().t()


def _bound(scheme: str, a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    k = a.data.shape[1]
    if SCHEMES[scheme] is None:
        return 1.01 * (k + 4) * U * _magnitude(a, b)
    group = SCHEMES[scheme][0][1]
    return 1.01 * (group + 2 + math.ceil(k / group)) * U * _magnitude(a, b)


def _rows(t: Fp8Tensor, index) -> Fp8Tensor:
    """The rows `index` of an activation operand (their scales with them)."""
    scale_inv = t.scale_inv if t.granularity == "tensor" else t.scale_inv[index].contiguous()
    return Fp8Tensor(t.data[index].contiguous(), scale_inv, t.granularity, t.block)


def test_per_tensor_agrees_with_exact_oracle_within_fp32_accumulation():
    a, b = _operands("tensor")
    y = fp8_matmul_nt(a, b, "triton_invariant")
    error = (y.double() - fp8_matmul_nt(a, b, "exact").double()).abs()
    bound = _bound("tensor", a, b)
    print(f"max |triton - exact| / bound: {(error / bound).max():.3f}")
    assert bool((error <= bound).all())


@pytest.mark.parametrize("k", [K, 300, 40])  # 40, 300: a ragged last group (and a K step past K)
@pytest.mark.parametrize("scheme", ["block128", "group128", "group32", "block32"])
def test_grouped_agrees_with_a_float64_oracle_within_fp32_accumulation(scheme, k):
    a, b = _operands(scheme, k=k)
    y = fp8_matmul_nt(a, b, "triton_invariant")
    reference = a.dequantize().double() @ b.dequantize().double().t()
    error, bound = (y.double() - reference).abs(), _bound(scheme, a, b)
    print(f"{scheme} K={k}: max |triton - reference| / bound: {(error / bound).max():.3f}")
    assert bool((error <= bound).all())


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_rows_are_bit_identical_whatever_the_batch(scheme):
    """Rows of M = 1..N (leading slices, single rows, a shuffled batch) equal those of M = 150."""
    a, b = _operands(scheme, m=150, k=300)
    full = fp8_matmul_nt(a, b, "triton_invariant")
    gen = torch.Generator().manual_seed(1)
    indices = [torch.arange(m) for m in (1, 2, 3, 17, 64, 65, 129)]
    indices += [torch.tensor([137]), torch.tensor([5, 66, 0]), torch.randperm(150, generator=gen)]
    for index in indices:
        alone = fp8_matmul_nt(_rows(a, index), b, "triton_invariant")
        assert torch.equal(alone, full[index]), f"rows {index.tolist()[:8]} (M={len(index)}) changed bits"


def test_per_tensor_rows_of_small_batches_equal_those_of_a_large_one():
    """Per tensor (128-row tiles, the product promoted a step late): rows of M = 1, 7, 50, 333 equal
    the same rows of M = 400, and the last rows of M = 333 those at its position in M = 400."""
    a, b = _operands("tensor", m=400, n=136, k=384)
    full = fp8_matmul_nt(a, b, "triton_invariant")
    for m in (1, 7, 50, 333):
        assert torch.equal(fp8_matmul_nt(_rows(a, torch.arange(m)), b, "triton_invariant"), full[:m]), f"M={m}"
    tail = torch.arange(67, 400)
    assert torch.equal(fp8_matmul_nt(_rows(a, tail), b, "triton_invariant"), full[tail])


@pytest.mark.parametrize("scheme", ["tensor", "group32", "block128"])
def test_bf16_epilogue_rounds_the_fp32_result_to_nearest_even(scheme):
    a, b = _operands(scheme, k=300)
    y32 = fp8_matmul_nt(a, b, "triton_invariant")
    y16 = fp8_matmul_nt(a, b, "triton_invariant", out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16.view(torch.int16), y32.bfloat16().view(torch.int16))


def test_e5m2_gradients_times_e4m3_operands():
    """The backward's operand pair under 'hybrid' (E5M2 output gradient, E4M3 weight)."""
    for scheme in ("tensor", "group128"):
        a, b = _operands(scheme, fmt_b=E5M2)
        y = triton_fp8_matmul_nt(b.data, a.data, b.scale_inv, a.scale_inv,
                                 group=None if scheme == "tensor" else 128, b_rows=scheme != "tensor")
        reference = b.dequantize().double() @ a.dequantize().double().t()
        assert bool(((y.double() - reference).abs() <= _bound(scheme, b, a)).all())


def test_one_kernel_body_the_interpreter_differs_in_tile_product_only():
    """The kernel calls `_tile_product` for every tile product and has no `tl.dot` or interpreter
    branch of its own; `_tile_product` is the only place that reads ROW_SUMS."""
    kernel = inspect.getsource(triton_gemm._fp8_gemm_nt_kernel).split('"""')[2]
    assert "tl.dot" not in kernel and "if ROW_SUMS" not in kernel and kernel.count("_tile_product(") == 2
    assert "if ROW_SUMS" in inspect.getsource(triton_gemm._tile_product)


@pytest.mark.parametrize("variant", list(triton_gemm_bench.AUDIT_VARIANTS))
def test_gpu_code_path_compiles_for_sm90_with_wgmma_and_no_spills(monkeypatch, variant):
    """Triton compiles the kernel's GPU path (ROW_SUMS False: `tl.dot`) for an H100/H200 without a
    GPU, with a launch's specialization at a Qwen3-8B shape (bench/triton_gemm.py --audit): its SASS
    uses Hopper's wgmma, ptxas spills nothing and reports no wgmma serialization (C7514 / C7515 /
    C7517: a wait injected before instructions that read the MMA's registers). The CPU tier's
    triton (3.9) is newer than the GPU machine's (3.6): the kit (bench/gpu_smoke.py) runs it there."""
    monkeypatch.delenv("TRITON_INTERPRET")
    report = triton_gemm_bench.audit_variant(*triton_gemm_bench.AUDIT_VARIANTS[variant])
    print(variant, report)
    assert report["wgmma"] > 0 and report["spill_stores"] == report["spill_loads"] == 0
    assert report["ptxas_notes"] == []


def test_per_tensor_promotion_runs_while_the_next_wgmma_does(monkeypatch):
    """Per tensor, the 128 x 128 fp32 adds that promote a K step's product (64 per thread over 8
    warps) are issued between the next step's WARPGROUP.ARRIVE and its WARPGROUP.DEPBAR (most of
    them: ptxas interleaves them with the wgmmas), and no wait is injected before them."""
    monkeypatch.delenv("TRITON_INTERPRET")
    tile, launch = triton_gemm.kernel_config(None)
    adds_per_thread = tile["BLOCK_M"] * tile["BLOCK_N"] // (32 * launch["num_warps"])
    report = triton_gemm_bench.audit_variant(0, 1)
    assert report["depbar"] == 1 and report["ptxas_notes"] == []
    assert report["fp_in_flight"] >= 0.75 * adds_per_thread, report


def test_fp8_linear_runs_it_forward_and_fp32_sums_backward():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 50, 200, generator=gen, requires_grad=True)
    weight = (torch.randn(130, 200, generator=gen) * 0.05).requires_grad_()
    dy = torch.randn(3, 50, 130, generator=gen)
    outputs = {}
    for gemm in ("triton_invariant", "fp32_accumulate"):
        for t in (x, weight):
            t.grad = None
        y = fp8_linear(x, weight, None, make_quantizers(CurrentScaling()), gemm)  # hybrid: E5M2 grads
        y.backward(dy)
        outputs[gemm] = (y.detach(), x.grad.clone(), weight.grad.clone())
    (y_t, dx_t, dw_t), (y_f, dx_f, dw_f) = outputs["triton_invariant"], outputs["fp32_accumulate"]
    torch.testing.assert_close(y_t, y_f, rtol=1e-5, atol=1e-5)  # same FP8 values, other sum order
    assert torch.equal(dx_t, dx_f) and torch.equal(dw_t, dw_f)  # the backward is 'fp32_accumulate'


def test_fp8_linear_runs_groupwise32_through_the_kernel():
    x, weight = torch.randn(4, 200), torch.randn(64, 200)  # K 200: a ragged last 1x32 group
    y = fp8_linear(x, weight, None, make_quantizers(groupwise32()), "triton_invariant")
    torch.testing.assert_close(y, fp8_linear(x, weight, None, make_quantizers(groupwise32()), "exact"),
                               rtol=1e-5, atol=1e-5)


def test_batch_invariant_gemm_is_triton_on_cuda_and_tiled_on_cpu():
    assert resolve_gemm("batch_invariant", torch.device("cuda")) == "triton_invariant"
    assert resolve_gemm("batch_invariant", torch.device("cpu")) == "tiled"
    assert resolve_gemm("auto", torch.device("cuda")) == "scaled_mm"


def test_check_recipe_gemm_on_cuda_refuses_cpu_gemms_and_blocks_without_a_kernel():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    recipes = [recipe_by_name(name) for name in ("calibrated", "tensorwise", "te_delayed", "blockwise", "groupwise",
                                                 "groupwise32")]
    for recipe in recipes:
        for gemm in ("auto", "batch_invariant", "scaled_mm", "triton_invariant"):
            check_recipe_gemm(recipe, gemm, cuda)
        for gemm in ("exact", "tiled", "fp32_accumulate"):
            with pytest.raises(ValueError, match=rf"FP8 gemm '{gemm}' is '{gemm}', a CPU GEMM.*no FP8 kernel"):
                check_recipe_gemm(recipe, gemm, cuda)
            check_recipe_gemm(recipe, gemm, cpu)
    odd = BlockwiseScaling(activation_block=(1, 64), weight_block=(64, 64))
    with pytest.raises(ValueError, match=r"activation \(1, 64\) x weight \(64, 64\) have no FP8 kernel"):
        check_recipe_gemm(odd, "auto", cuda)
    check_recipe_gemm(groupwise(group=64), "batch_invariant", cpu)  # 'tiled' takes any group


def test_megatron_fp8_layer_refuses_a_cpu_gemm_where_cuda_is_present(monkeypatch):
    """At layer build, not at the first forward: with CUDA present the CPU GEMMs have no FP8
    kernel; every named recipe builds with auto and batch_invariant (groupwise32's 1x32 groups
    included)."""
    from megatron_fp8rl.models.megatron_fp8_linear import _Fp8LinearMixin

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"FP8 gemm 'exact' is 'exact', a CPU GEMM"):
        _Fp8LinearMixin()._init_fp8(groupwise32(), "exact")
    for recipe in (groupwise32(), groupwise(), BlockwiseScaling(), recipe_by_name("calibrated")):
        for gemm in ("auto", "batch_invariant"):
            _Fp8LinearMixin()._init_fp8(recipe, gemm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _Fp8LinearMixin()._init_fp8(groupwise32(), "exact")


def test_block_scales_of_the_wrong_shape_are_refused():
    a, b = _operands("block128")
    with pytest.raises(ValueError, match=r"sa must .* shape \(70, 3\).*found torch.float32 \(70, 4\)"):
        fp8_matmul_nt(Fp8Tensor(a.data, torch.ones(70, 4), "block", ACTIVATION_BLOCK), b, "triton_invariant")


def test_group_scales_of_the_wrong_shape_are_refused():
    a, b = _operands("group128")
    with pytest.raises(ValueError, match=r"sb must .* \(200, 3\).*1x128 group scales.*found torch.float32 \(2, 3\)"):
        fp8_matmul_nt(a, Fp8Tensor(b.data, torch.ones(2, 3), "block", ACTIVATION_BLOCK), "triton_invariant")


def test_non_contiguous_operands_are_refused():
    a, b = _operands("tensor")
    strided = Fp8Tensor(a.data[:, ::2], a.scale_inv, "tensor")
    with pytest.raises(ValueError, match=r"contiguous.*a \(70, 192\)"):
        fp8_matmul_nt(strided, Fp8Tensor(b.data[:, :192].contiguous(), b.scale_inv, "tensor"), "triton_invariant")


@pytest.mark.parametrize("scale_inv", [torch.ones(1), torch.ones((), dtype=torch.float64)])
def test_per_tensor_scales_of_the_wrong_shape_or_dtype_are_refused(scale_inv):
    a, b = _operands("tensor")
    with pytest.raises(ValueError, match=r"sb must be a contiguous float32 tensor of shape \(\)"):
        fp8_matmul_nt(a, Fp8Tensor(b.data, scale_inv, "tensor"), "triton_invariant")


def test_bad_arguments_are_refused_by_name():
    a, b = _operands("group128")
    with pytest.raises(ValueError, match=r"group 64 .* the kernel has groups \(32, 128\)"):
        triton_fp8_matmul_nt(a.data, b.data, a.scale_inv, b.scale_inv, group=64)
    with pytest.raises(ValueError, match="b_rows .* needs group=G"):
        triton_fp8_matmul_nt(a.data, b.data, torch.ones(()), torch.ones(()), b_rows=True)
    with pytest.raises(ValueError, match=r"out_dtype torch.float16"):
        triton_fp8_matmul_nt(a.data, b.data, a.scale_inv, b.scale_inv, group=128, b_rows=True, out_dtype=torch.float16)


def test_layouts_without_a_kernel_are_refused():
    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match=r"row None x tensor None \(shapes \(8, 128\) x \(16, 128\)\)"):
        fp8_matmul_nt(quantize_per_row(x, E4M3), quantize_per_tensor(torch.randn(16, 128), E4M3), "triton_invariant")
    with pytest.raises(ValueError, match="float8_e4m3fn/e5m2"):
        fp8_matmul_nt(Fp8Tensor(x, torch.ones(()), "tensor"), quantize_per_tensor(x, E5M2), "triton_invariant")
    a = quantize_blockwise(x, E4M3, (1, 64))
    with pytest.raises(ValueError, match=r"block \(1, 64\) x block \(1, 64\).*G in \(32, 128\)"):
        fp8_matmul_nt(a, quantize_blockwise(torch.randn(16, 128), E4M3, (1, 64)), "triton_invariant")


@pytest.mark.triton  # marked, then the interpreter switched off again inside
def test_cpu_tensors_without_the_interpreter_raise_naming_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    a, b = _operands("tensor", m=2, n=8, k=32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET is not set to 1"):
        fp8_matmul_nt(a, b, "triton_invariant")


def test_rows_viewed_at_an_unaligned_offset_get_the_same_bits():
    """A contiguous view starting mid-batch (row 3 of a 300-column FP8 matrix: 900 bytes in, not
    16-byte aligned) is copied to an aligned start, so triton runs the same compiled variant."""
    a, b = _operands("group32", m=40, k=300)
    full = fp8_matmul_nt(a, b, "triton_invariant")
    view = Fp8Tensor(a.data[3:], a.scale_inv[3:], "block", a.block)
    assert view.data.data_ptr() % 16 != 0 and view.data.is_contiguous()
    aligned = triton_gemm._aligned(view.data)  # what the kernel is handed
    assert aligned.data_ptr() % 16 == 0 and torch.equal(aligned.view(torch.uint8), view.data.view(torch.uint8))
    assert torch.equal(fp8_matmul_nt(view, b, "triton_invariant"), full[3:])
