"""The FP8 linear's device path: forward, dgrad and wgrad as FP8 GEMMs of fused-kernel quantizations.

Owns: `DeviceFp8LinearFunction` and `device_fp8_linear`, what fp8/linear.py's `fp8_linear` runs
for CUDA inputs (and for CPU inputs inside `linear.device_kernels_on_cpu()`, the tests, under
TRITON_INTERPRET=1). Same arithmetic as the CPU path's (fp8/linear.py's and fp8/gemm.py's module docstrings), same
quantizers and scaling state, with these differences:
- every quantization is one fused kernel pass (fp8/device_quantize.py), statistics stay on the
  device, no host synchronization anywhere in forward or backward;
- the weight's quantization (and its transposed copy) is cached until the weight changes
  (`device_quantize.device_quantize_weight`);
- every GEMM is `gemm.device_matmul_nt` on FP8 operands, routed as on CUDA whatever the device
  (vendor kernels under 'auto', the Triton kernel under 'batch_invariant', fp8/gemm.py), each
  call checked against its kernel's rules, the result written in x's (dgrad) or the weight's
  (wgrad) dtype by the kernel, the bias fused where cuBLAS takes it; the backward's too: dgrad =
  Q_g(dy) [M, N] x Q(W)^T [K, N], wgrad = Q_g(dy)^T [N, M] x Q(x)^T [K, M] (the tokens M are its
  contraction, padded to what cuBLAS takes). Per-tensor operands transpose exactly;
  1xG-group operands get a column-wise quantization of the high-precision tensor in the same
  kernel pass (Gx1 groups: the groups run along the wgrad's / dgrad's contraction), 128x128 weight
  blocks transpose exactly. The CPU path's backward instead multiplies the dequantized row-wise
  operands of the block recipes, so block recipes' gradients differ from it within the
  quantization error (tests/fp8/test_device_linear.py bounds both against an fp64 oracle).
Only the transposed copy of x is saved for the backward (the row-wise codes are not needed).
No-grad passes (torch.no_grad(), or no input requiring a gradient: logprob recomputes, eval, the
shadow forward) quantize once: no transposed or column-wise copy of x or of the weight, nothing saved.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch; triton
through fp8/device_quantize.py at the first call).
"""
from __future__ import annotations

import torch

from megatron_fp8rl.fp8.device_quantize import device_quantize, device_quantize_weight
from megatron_fp8rl.fp8.gemm import CUDA, backward_gemm, device_matmul_nt, resolve_gemm
from megatron_fp8rl.fp8.quantize import Fp8Tensor
from megatron_fp8rl.fp8.quantizer import Fp8Quantizers


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as a 2-D [rows, C] view with unit column stride (a copy only when needed)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class DeviceFp8LinearFunction(torch.autograd.Function):
    """Autograd function of y = x @ W^T + b on the device path (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantizers: Fp8Quantizers, gemm: str, grad: bool):
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"fp8_linear: input has {x.shape[-1]} features, weight {tuple(weight.shape)} "
                             f"expects {weight.shape[1]}")
        # `grad`: grad mode at the call (inside forward it is off, and needs_input_grad ignores it)
        wgrad = grad and ctx.needs_input_grad[1]
        x_q = device_quantize(quantizers.input, _flat(x), transposed=wgrad)
        w_q = device_quantize_weight(quantizers.weight, weight, transposed=grad and ctx.needs_input_grad[0])
        gemm = resolve_gemm(gemm, CUDA)
        y = device_matmul_nt(x_q, w_q, gemm, x.dtype, bias=bias, tokens="rows")
        ctx.quantizers, ctx.gemm, ctx.w_q = quantizers, backward_gemm(gemm, CUDA), w_q
        ctx.meta = (x.shape, x.dtype, weight.dtype, bias is not None)
        x_t = x_q.transposed
        ctx.x_t_meta = None if x_t is None else (x_t.granularity, x_t.block)
        ctx.save_for_backward(*(() if x_t is None else (x_t.data, x_t.scale_inv)))
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_shape, x_dtype, w_dtype, has_bias = ctx.meta
        dy = _flat(grad_output)
        g_q = device_quantize(ctx.quantizers.grad_output, dy, transposed=ctx.needs_input_grad[1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = device_matmul_nt(g_q, ctx.w_q.transposed, ctx.gemm, x_dtype, tokens="rows").reshape(x_shape)
        if ctx.needs_input_grad[1]:
            x_t = Fp8Tensor(*ctx.saved_tensors, *ctx.x_t_meta)
            grad_w = device_matmul_nt(g_q.transposed, x_t, ctx.gemm, w_dtype, tokens="contraction")
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.sum(0, dtype=torch.float32).to(w_dtype)  # fp32 sum, one cast: 2 launches
        return grad_x, grad_w, grad_b, None, None, None


def device_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      quantizers: Fp8Quantizers, gemm: str = "auto") -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T + bias [N] on the device path (module docstring)."""
    grad = torch.is_grad_enabled()  # with it, forward's needs_input_grad holds each input's requires_grad
    return DeviceFp8LinearFunction.apply(x, weight, bias, quantizers, gemm, grad)
