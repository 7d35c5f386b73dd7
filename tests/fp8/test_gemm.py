"""fp8/gemm.py's device routing, run on CPU tensors: which kernel computes each layout under each
GEMM name (cuBLAS `_scaled_mm` per tensor and per row, cuBLAS blockwise for 1x128 groups with 128x128
or 1x128 weights in E4M3, the Triton kernel for batch_invariant, 1x32 groups, E5M2 block operands
and weights off cuBLAS's multiples), the CPU GEMMs refused there, the CPU stand-in of the cuBLAS
kernels equal to 'fp32_accumulate' (per tensor) or within fp32 rounding of 'exact', and the result
written in the caller's dtype, the bias fused where cuBLAS takes it or else added in fp32 and
rounded once (SGLang's served layer's arithmetic, so aligned rollouts keep their bits).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.gemm import device_kernel, device_matmul_nt, fp8_matmul_nt
from megatron_fp8rl.fp8.linear import device_kernels_on_cpu, fp8_linear
from megatron_fp8rl.fp8.quantize import quantize_blockwise, quantize_per_row, quantize_per_tensor
from megatron_fp8rl.fp8.quantizer import make_quantizers
from megatron_fp8rl.fp8.recipe import recipe_by_name

pytestmark = pytest.mark.triton
M = 70  # rows: neither a multiple of 16 nor of the Triton kernel's 64-row tile


def _values(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.logspace(-1, 1, cols)


def _operands(scheme: str, n=256, k=256, fmt_a=E4M3):
    """(a [M, k], b [n, k]) quantized as `scheme`: 'tensor', 'row' (a per row), 'block128'
    (1x128 x 128x128), 'group128' (1x128 x 1x128), 'group32' (1x32 x 1x32)."""
    x, w = _values(M, k, 1), _values(n, k, 2) * 0.05
    if scheme == "tensor":
        return quantize_per_tensor(x, fmt_a), quantize_per_tensor(w, E4M3)
    if scheme == "row":
        return quantize_per_row(x, fmt_a), quantize_per_tensor(w, E4M3)
    group = 32 if scheme == "group32" else 128
    weight_block = (128, 128) if scheme == "block128" else (1, group)
    return quantize_blockwise(x, fmt_a, (1, group)), quantize_blockwise(w, E4M3, weight_block)


ROUTES = [  # (scheme, operand options, gemm, tokens dimension, kernel)
    ("tensor", {}, "scaled_mm", "rows", "cublas_tensor"),
    ("tensor", {"fmt_a": E5M2}, "scaled_mm", "rows", "cublas_tensor"),
    ("row", {}, "scaled_mm", "rows", "cublas_row"),
    ("tensor", {"n": 200}, "scaled_mm", "rows", "triton"),  # N off cuBLAS's multiples of 16
    ("tensor", {"k": 200}, "scaled_mm", "contraction", "cublas_tensor"),  # the tokens: padded
    ("block128", {}, "scaled_mm", "rows", "cublas_1x128_128x128"),
    ("group128", {}, "scaled_mm", "rows", "cublas_1x128_1x128"),
    ("group128", {"k": 200}, "scaled_mm", "contraction", "cublas_1x128_1x128"),
    ("block128", {"k": 300}, "scaled_mm", "rows", "triton"),  # K off the multiples of 128
    ("block128", {"fmt_a": E5M2}, "scaled_mm", "rows", "triton"),  # 'hybrid' gradients: no cuBLAS kernel
    ("group32", {}, "scaled_mm", "rows", "triton"),  # 1x32: no vendor kernel on Hopper
    ("tensor", {}, "triton_invariant", "rows", "triton"),
    ("block128", {}, "triton_invariant", "rows", "triton"),
]


@pytest.mark.parametrize("scheme, options, gemm, tokens, kernel", ROUTES)
def test_device_routing_picks_the_kernel_of_each_layout(scheme, options, gemm, tokens, kernel):
    a, b = _operands(scheme, **options)
    assert device_kernel(a, b, gemm, tokens) == kernel


def test_device_routing_refuses_cpu_gemms_and_layouts_without_a_kernel():
    a, b = _operands("tensor")
    for gemm in ("exact", "tiled", "fp32_accumulate", "auto"):
        with pytest.raises(ValueError, match=rf"FP8 gemm '{gemm}' on cuda: not an FP8 kernel"):
            device_kernel(a, b, gemm)
    rows, blocks = _operands("row")[0], _operands("block128")[1]
    with pytest.raises(ValueError, match=r"triton_invariant FP8 GEMM: operands row None x block \(128, 128\)"):
        device_kernel(rows, blocks, "scaled_mm")
    x, w = torch.randn(4, 64, requires_grad=True), torch.randn(32, 64)
    with device_kernels_on_cpu(), pytest.raises(ValueError, match="'exact' on cuda: not an FP8 kernel"):
        fp8_linear(x, w, None, make_quantizers(recipe_by_name("calibrated")), "exact")


def test_cublas_stand_in_on_cpu_equals_fp32_accumulate_bit_for_bit():
    a, b = _operands("tensor")
    assert torch.equal(device_matmul_nt(a, b, "scaled_mm", torch.float32), fp8_matmul_nt(a, b, "fp32_accumulate"))


@pytest.mark.parametrize("scheme", ["row", "block128", "group128"])
def test_cublas_stand_in_on_cpu_within_fp32_rounding_of_the_exact_gemm(scheme):
    a, b = _operands(scheme)
    got, exact = device_matmul_nt(a, b, "scaled_mm", torch.float32), fp8_matmul_nt(a, b, "exact")
    magnitude = a.dequantize().abs().double() @ b.dequantize().abs().double().t()
    assert ((got.double() - exact.double()).abs() <= (256 + 4) * 2.0**-24 * magnitude).all()


def test_routes_to_the_triton_kernel_give_its_bits():
    for scheme, options in (("block128", {"k": 300}), ("group32", {}), ("tensor", {"n": 200})):
        a, b = _operands(scheme, **options)
        assert torch.equal(device_matmul_nt(a, b, "scaled_mm", torch.float32), fp8_matmul_nt(a, b, "triton_invariant"))


class ScaledMmArguments(TorchDispatchMode):
    """Records (out dtype, bias dtype or None) of each `_scaled_mm` call (on CPU tensors, the meta
    call fp8/cuda_gemm.py hands to torch's checks)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == "_scaled_mm":
            bias = kwargs.get("bias", args[4] if len(args) > 4 else None)
            self.calls.append((out.dtype, None if bias is None else bias.dtype))
        return out


def test_the_kernel_writes_the_callers_dtype_and_cublas_fuses_a_bias_of_that_dtype():
    a, b = _operands("tensor")
    bias = torch.randn(256, generator=torch.Generator().manual_seed(5))
    fp32 = fp8_matmul_nt(a, b, "fp32_accumulate")
    with ScaledMmArguments() as seen:
        fused = device_matmul_nt(a, b, "scaled_mm", torch.bfloat16, bias=bias.bfloat16())
        device_matmul_nt(a, b, "scaled_mm", torch.float32, bias=bias)  # no bias epilogue with an fp32 output
    assert seen.calls == [(torch.bfloat16, torch.bfloat16), (torch.float32, None)]
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused, (fp32 + bias.bfloat16().float()).bfloat16())  # one rounding after the bias
    assert torch.equal(device_matmul_nt(a, b, "scaled_mm", torch.bfloat16), fp32.bfloat16())


def test_a_bias_the_kernel_cannot_fuse_is_added_in_fp32_and_rounded_once():
    # the Triton kernel has no bias epilogue: SGLang's served layer computes (y_fp32 + bias).to(dtype)
    a, b = _operands("tensor")
    bias = torch.randn(256, generator=torch.Generator().manual_seed(5))
    served = (fp8_matmul_nt(a, b, "triton_invariant") + bias).to(torch.bfloat16)
    assert torch.equal(device_matmul_nt(a, b, "triton_invariant", torch.bfloat16, bias=bias), served)


@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_a_micro_batch_without_tokens_gives_empty_outputs_and_zero_weight_gradients(name):
    x, w, b = torch.randn(0, 256, requires_grad=True), torch.randn(128, 256, requires_grad=True), torch.ones(128)
    with device_kernels_on_cpu():
        y = fp8_linear(x, w, b.requires_grad_(), make_quantizers(recipe_by_name(name)))
        y.backward(torch.randn(0, 128))
    assert y.shape == (0, 128) and x.grad.shape == (0, 256)
    assert torch.equal(w.grad, torch.zeros(128, 256)) and torch.equal(b.grad, torch.zeros(128))
