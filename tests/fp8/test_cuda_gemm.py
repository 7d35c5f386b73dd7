"""The CUDA rules check of the device path's GEMM calls (fp8/cuda_gemm.py), on CPU: every call the
device path plans for the RL token counts (1, 50, 333, 4095) and every recipe layout, forward,
dgrad and wgrad, passes our check and torch's own (its `_scaled_mm` / `_scaled_mm_v2` meta
kernels, which apply the CUDA layout rules to meta tensors: an independent oracle); calls that
break a rule are refused by our check naming the dimension or tensor and the rule, and torch's
meta check refuses the same ones where it knows the rule. No kernel runs here: the planned calls
are checked, which is what runs on CUDA before every launch.
"""
import pytest
import torch
from torch.nn.functional import ScalingType, scaled_mm

from megatron_fp8rl.fp8.cuda_gemm import BLOCKWISE_KERNELS, DeviceGemm, check_cuda_gemm, plan_device_gemm
from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.gemm import device_kernel
from megatron_fp8rl.fp8.quantize import quantize_blockwise, quantize_per_tensor

RL_TOKENS = [1, 50, 333, 4095]
K, N = 256, 384  # hidden dimensions: multiples of 128, K / 128 = 2 not a multiple of 4 (scale_b padding)
LAYOUTS = {  # recipe layout: (activation / gradient quantization, weight quantization, wgrad operands')
    "tensor": (None, None, None),
    "block128": ((1, 128), (128, 128), (1, 128)),
    "group128": ((1, 128), (1, 128), (1, 128)),
}


def _quantized(rows: int, cols: int, fmt, block):
    """A [rows, cols] FP8 operand: per tensor (block None) or with `block` scales."""
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 7 + cols))
    return quantize_per_tensor(values, fmt) if block is None else quantize_blockwise(values, fmt, block)


def _linear_gemms(layout: str, tokens: int, grad_fmt):
    """(label, a, b, tokens dimension) of the device path's three GEMMs of one linear (fp8/device_linear.py):
    forward x [M, K] @ W [N, K]^T; dgrad dy [M, N] @ (W^T [K, N])^T; wgrad (dy^T [N, M]) @ (x^T [K, M])^T."""
    act, weight, colwise = LAYOUTS[layout]
    return [("forward", _quantized(tokens, K, E4M3, act), _quantized(N, K, E4M3, weight), "rows"),
            ("dgrad", _quantized(tokens, N, grad_fmt, act), _quantized(K, N, E4M3, weight), "rows"),
            ("wgrad", _quantized(N, tokens, grad_fmt, colwise), _quantized(K, tokens, E4M3, colwise), "contraction")]


def _meta(t):
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def torch_refuses(call: DeviceGemm) -> bool:
    """Whether torch's meta kernel of `call` (its CUDA layout and shape checks) raises."""
    a, b, sa, sb, bias = (_meta(t) for t in (call.mat_a, call.mat_b, call.scale_a, call.scale_b, call.bias))
    try:
        if call.kernel in ("cublas_tensor", "cublas_row"):
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=call.out_dtype)
        else:
            groups_b = call.kernel.endswith("1x128_1x128")
            recipe_b = ScalingType.BlockWise1x128 if groups_b else ScalingType.BlockWise128x128
            scaled_mm(a, b, sa, ScalingType.BlockWise1x128, sb, recipe_b, bias=bias, output_dtype=call.out_dtype)
    except (RuntimeError, ValueError):
        return True
    return False


@pytest.mark.parametrize("tokens", RL_TOKENS)
@pytest.mark.parametrize("grad_fmt", [E4M3, E5M2], ids=["e4m3", "hybrid"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planned_calls_for_rl_token_counts_pass_our_rules_and_torchs(layout, grad_fmt, tokens):
    for label, a, b, dim in _linear_gemms(layout, tokens, grad_fmt):
        kernel = device_kernel(a, b, "scaled_mm", dim)
        call = plan_device_gemm(kernel, a, b, torch.bfloat16, dim)
        if kernel == "triton":  # E5M2 gradients of a block recipe: no cuBLAS kernel takes them
            assert layout != "tensor" and grad_fmt is E5M2 and label != "forward", (layout, label)
            continue
        check_cuda_gemm(call)
        assert not torch_refuses(call), (label, kernel, call.mat_a.shape)
        assert call.rows == a.data.shape[0]
        if kernel in BLOCKWISE_KERNELS:
            assert call.mat_a.shape[0] % 16 == 0  # cuBLAS refused M = 1, 2, 3, 7, 17, 333, 4095 (DESIGN.md)


def _wgrad_call(tokens: int, pad: bool) -> DeviceGemm:
    """A per-tensor wgrad dy^T [N, tokens] @ x^T [K, tokens]^T, its contraction padded or not."""
    _, a, b, _ = _linear_gemms("tensor", tokens, E5M2)[2]
    if pad:
        return plan_device_gemm("cublas_tensor", a, b, torch.float32, "contraction")
    return DeviceGemm("cublas_tensor", a.data, b.data.t(), a.scale_inv, b.scale_inv, torch.float32, rows=N)


def test_an_unpadded_wgrad_over_50_tokens_is_refused_naming_the_contraction_and_the_rule():
    unpadded = _wgrad_call(50, pad=False)
    assert torch_refuses(unpadded)  # what cuBLAS would do on the first RL step
    with pytest.raises(ValueError, match=r"cublas_tensor .*the contraction dimension K = 50 must be a multiple of 16"):
        check_cuda_gemm(unpadded)
    padded = _wgrad_call(50, pad=True)
    assert padded.mat_a.shape == (N, 64) and padded.mat_b.shape == (64, K)  # zero codes appended
    check_cuda_gemm(padded)
    assert not torch_refuses(padded)


def _blockwise_forward(tokens: int) -> tuple:
    _, a, b, _ = _linear_gemms("block128", tokens, E4M3)[0]
    return a, b, plan_device_gemm("cublas_1x128_128x128", a, b, torch.bfloat16, "rows")


def _replace(call: DeviceGemm, **fields) -> DeviceGemm:
    return DeviceGemm(**{**call.__dict__, **fields})


def _violations():
    """(name, call breaking one rule, what our message names, whether torch's meta check knows the rule)."""
    tensor = _wgrad_call(64, pad=True)
    a, b, block = _blockwise_forward(64)
    odd_m = DeviceGemm("cublas_1x128_128x128", a.data[:50], block.mat_b, block.scale_a[:50], block.scale_b,
                       torch.bfloat16, rows=50)
    row_major_scales = _replace(block, scale_a=block.scale_a.contiguous())
    unpadded_l4 = _replace(block, scale_b=b.scale_inv.t())  # (K/128 = 2, N/128): no padding to a multiple of 4
    e5m2 = _replace(tensor, mat_a=tensor.mat_a.view(torch.uint8).view(torch.float8_e5m2),
                    mat_b=tensor.mat_b.view(torch.uint8).view(torch.float8_e5m2))
    return [
        ("mat_a column-major", _replace(tensor, mat_a=tensor.mat_a.t().contiguous().t()), "mat_a must be row-major",
         True),
        ("mat_b row-major", _replace(tensor, mat_b=tensor.mat_b.contiguous()), "mat_b must be column-major", True),
        ("N = 40", _replace(tensor, mat_b=tensor.mat_b[:, :40]),
         r"the output dimension N = 40 \(mat_b.s columns\) must be a multiple of 16", True),
        ("fp64 scale", _replace(tensor, scale_a=tensor.scale_a.double()), "scales must be float32", True),
        ("both E5M2", e5m2, "both operands E5M2", False),
        ("bias with fp32 out", _replace(tensor, bias=torch.zeros(K)), "a bias needs a 16-bit output", False),
        ("blockwise M = 50", odd_m, "the rows M = 50 must be a multiple of 16", False),
        ("blockwise scale_a row-major", row_major_scales, "scale_a must be .* column-major", True),
        ("blockwise scale_b unpadded", unpadded_l4, r"scale_b must be \(4, 3\) with strides \(1, 4\)", True),
        ("blockwise E5M2", _replace(block, mat_b=block.mat_b.view(torch.uint8).view(torch.float8_e5m2)),
         "blockwise operands must be E4M3", False),
    ]


@pytest.mark.parametrize("name, call, message, torch_knows", _violations(), ids=[v[0] for v in _violations()])
def test_calls_breaking_a_rule_are_refused_by_name(name, call, message, torch_knows):
    with pytest.raises(ValueError, match=message):
        check_cuda_gemm(call)
    if torch_knows:  # the meta kernels check layouts and shapes, not what cuBLAS refuses at run time
        assert torch_refuses(call), name


def test_the_triton_kernel_takes_no_bias_and_no_float16():
    _, a, b, _ = _linear_gemms("tensor", 50, E4M3)[0]
    call = plan_device_gemm("triton", a, b, torch.float32, "rows")
    check_cuda_gemm(call)
    with pytest.raises(ValueError, match="no bias epilogue"):
        check_cuda_gemm(_replace(call, bias=torch.zeros(N)))
    with pytest.raises(ValueError, match="out dtype must be one of"):
        check_cuda_gemm(_replace(call, out_dtype=torch.float16))
