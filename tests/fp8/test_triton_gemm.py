"""The 'triton_invariant' FP8 GEMM (fp8/triton_gemm.py) on CPU under Triton's interpreter: agreement
with the 'exact' oracle and with dequantize + matmul within the fp32-accumulation bound, rows
bit-identical whatever the batch around them, the FP8 linear running it, and bad input refused.

The bound (u = 2**-24, fp32's unit roundoff; |A|, |B| the dequantized operands' magnitudes):
products of FP8 values are exact in fp32, so the kernel's only errors are its fp32 additions
and its scale multiplications. Summing n terms in any order errs by at most (n - 1) u sum|terms|
to first order. Per tensor: (K - 1) u for the sum, 2 u for the two scales; the oracle rounds its
exact sum once and multiplies twice, 3 u: |y - oracle| <= (K + 4) u (|A| @ |B|^T). Block: each
128-group's sum (127 u), its two scales (2 u) and the sum over K/128 groups (K/128 u), against a
float64 reference: (128 + 2 + K/128) u (|A| @ |B|^T). A 1 % allowance covers second-order terms.
"""
import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.linear import fp8_linear, fp8_matmul_nt, resolve_gemm
from megatron_fp8rl.fp8.quantize import (
    ACTIVATION_BLOCK,
    WEIGHT_BLOCK,
    Fp8Tensor,
    quantize_blockwise,
    quantize_per_row,
    quantize_per_tensor,
)
from megatron_fp8rl.fp8.quantizer import make_quantizers
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CurrentScaling, groupwise32

pytestmark = pytest.mark.triton

U = 2.0**-24
M, N, K = 70, 200, 384  # M crosses a 64-row tile, N a 128-column tile; K = 3 groups of 128


def _operands(scheme: str, m=M, n=N, k=K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)  # channels of unequal range
    w = torch.randn(n, k, generator=gen) * 0.05
    if scheme == "tensor":
        return quantize_per_tensor(x, E4M3), quantize_per_tensor(w, E4M3)
    weight_block = WEIGHT_BLOCK if scheme == "block" else ACTIVATION_BLOCK  # "group": 1x128 weights
    return quantize_blockwise(x, E4M3, ACTIVATION_BLOCK), quantize_blockwise(w, E4M3, weight_block)


def _magnitude(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    return a.dequantize().double().abs() @ b.dequantize().double().abs().t()


def _rows(t: Fp8Tensor, index) -> Fp8Tensor:
    """The rows `index` of an activation operand (their scales with them)."""
    scale_inv = t.scale_inv if t.granularity == "tensor" else t.scale_inv[index].contiguous()
    return Fp8Tensor(t.data[index].contiguous(), scale_inv, t.granularity, t.block)


def test_per_tensor_agrees_with_exact_oracle_within_fp32_accumulation():
    a, b = _operands("tensor")
    y = fp8_matmul_nt(a, b, "triton_invariant")
    error = (y.double() - fp8_matmul_nt(a, b, "exact").double()).abs()
    bound = 1.01 * (K + 4) * U * _magnitude(a, b)
    print(f"max |triton - exact| / bound: {(error / bound).max():.3f}")
    assert bool((error <= bound).all())


@pytest.mark.parametrize("scheme", ["block", "group"])
def test_block_scaled_agrees_with_dequantize_matmul_within_fp32_accumulation(scheme):
    a, b = _operands(scheme)
    y = fp8_matmul_nt(a, b, "triton_invariant")
    reference = a.dequantize().double() @ b.dequantize().double().t()
    bound = 1.01 * (128 + 2 + K // 128) * U * _magnitude(a, b)
    error = (y.double() - reference).abs()
    print(f"max |triton - reference| / bound: {(error / bound).max():.3f}")
    assert bool((error <= bound).all())


@pytest.mark.parametrize("scheme", ["tensor", "block", "group"])
def test_rows_are_bit_identical_whatever_the_batch(scheme):
    a, b = _operands(scheme)
    full = fp8_matmul_nt(a, b, "triton_invariant")
    gen = torch.Generator().manual_seed(1)
    for index in (torch.tensor([37]), torch.tensor([5, 66, 0]), torch.arange(3, 67), torch.randperm(M, generator=gen)):
        alone = fp8_matmul_nt(_rows(a, index), b, "triton_invariant")
        assert torch.equal(alone, full[index]), f"rows {index.tolist()[:8]} (M={len(index)}) changed bits"


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


def test_batch_invariant_gemm_is_triton_on_cuda_and_tiled_on_cpu():
    assert resolve_gemm("batch_invariant", torch.device("cuda")) == "triton_invariant"
    assert resolve_gemm("batch_invariant", torch.device("cpu")) == "tiled"
    assert resolve_gemm("auto", torch.device("cuda")) == "scaled_mm"


def test_block_scales_need_k_a_multiple_of_128():
    a, b = _operands("block", k=200)
    with pytest.raises(ValueError, match=r"multiple of 128.*a \(70, 200\), b \(200, 200\)"):
        fp8_matmul_nt(a, b, "triton_invariant")


def test_non_contiguous_operands_are_refused():
    a, b = _operands("tensor")
    strided = Fp8Tensor(a.data[:, ::2], a.scale_inv, "tensor")
    with pytest.raises(ValueError, match=r"contiguous.*a \(70, 192\)"):
        fp8_matmul_nt(strided, Fp8Tensor(b.data[:, :192].contiguous(), b.scale_inv, "tensor"), "triton_invariant")


@pytest.mark.parametrize("scale_inv", [torch.ones(1), torch.ones((), dtype=torch.float64)])
def test_per_tensor_scales_of_the_wrong_shape_or_dtype_are_refused(scale_inv):
    a, b = _operands("tensor")
    with pytest.raises(ValueError, match=r"b_scale_inv must be a contiguous float32 tensor of shape \(\)"):
        fp8_matmul_nt(a, Fp8Tensor(b.data, scale_inv, "tensor"), "triton_invariant")


def test_block_scales_of_the_wrong_shape_are_refused():
    a, b = _operands("block")
    with pytest.raises(ValueError, match=r"a_scale_inv .* shape \(70, 3\).*found torch.float32 \(70, 4\)"):
        fp8_matmul_nt(Fp8Tensor(a.data, torch.ones(70, 4), "block", ACTIVATION_BLOCK), b, "triton_invariant")


def test_group_scales_of_the_wrong_shape_are_refused():
    a, b = _operands("group")
    with pytest.raises(ValueError, match=r"b_scale_inv .* shape \(200, 3\).*1x128 group scales.*found torch.float32 \(2, 3\)"):
        fp8_matmul_nt(a, Fp8Tensor(b.data, torch.ones(2, 3), "block", ACTIVATION_BLOCK), "triton_invariant")


def test_layouts_without_a_kernel_are_refused():
    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match=r"row None x tensor None \(shapes \(8, 128\) x \(16, 128\)\)"):
        fp8_matmul_nt(quantize_per_row(x, E4M3), quantize_per_tensor(torch.randn(16, 128), E4M3), "triton_invariant")
    with pytest.raises(ValueError, match="float8_e4m3fn/e5m2"):
        fp8_matmul_nt(Fp8Tensor(x, torch.ones(()), "tensor"), quantize_per_tensor(x, E5M2), "triton_invariant")


def test_fp8_linear_with_the_invariant_gemm_refuses_a_ragged_block_k():
    x, weight = torch.randn(4, 200), torch.randn(64, 200)
    with pytest.raises(ValueError, match=r"multiple of 128.*a \(4, 200\), b \(64, 200\)"):
        fp8_linear(x, weight, None, make_quantizers(BlockwiseScaling()), "triton_invariant")
    y = fp8_linear(x, weight, None, make_quantizers(CurrentScaling()), "triton_invariant")  # per tensor: any K
    assert y.shape == (4, 64)


def test_groupwise32_is_refused_by_name_not_run_another_way():
    """The kernel sums 1x128 groups only: groupwise32's 1x32 operands raise naming their blocks
    (a fallback GEMM would silently lose batch invariance on the GPU)."""
    x, weight = torch.randn(4, 256), torch.randn(64, 256)
    with pytest.raises(ValueError, match=r"operands block \(1, 32\) x block \(1, 32\).*are not supported"):
        fp8_linear(x, weight, None, make_quantizers(groupwise32()), "triton_invariant")


@pytest.mark.triton  # marked, then the interpreter switched off again inside
def test_cpu_tensors_without_the_interpreter_raise_naming_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    a, b = _operands("tensor", m=2, n=8, k=32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET is not set to 1"):
        fp8_matmul_nt(a, b, "triton_invariant")


def test_megatron_fp8_layer_refuses_groupwise32_where_batch_invariant_is_the_kernel(monkeypatch):
    """At layer build, not at the first forward: with CUDA present 'batch_invariant' is the Triton
    kernel, which has no 1x32 groups; groupwise (1x128), blockwise and per-tensor recipes build."""
    from megatron_fp8rl.fp8.recipe import groupwise, recipe_by_name
    from megatron_fp8rl.models.megatron_fp8_linear import _Fp8LinearMixin

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"'batch_invariant' on cuda is the Triton kernel.*\[\(1, 32\)\].*groupwise32"):
        _Fp8LinearMixin()._init_fp8(groupwise32(), "batch_invariant")
    for recipe in (groupwise(), BlockwiseScaling(), recipe_by_name("calibrated")):
        _Fp8LinearMixin()._init_fp8(recipe, "batch_invariant")
    _Fp8LinearMixin()._init_fp8(groupwise32(), "auto")  # scaled_mm / dequantized on CUDA: no kernel
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _Fp8LinearMixin()._init_fp8(groupwise32(), "batch_invariant")  # 'tiled' on the CPU
