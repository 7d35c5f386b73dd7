"""Our FP8 linear layer: y = x @ W^T + b with FP8 GEMMs (torch.float8_* and fp8/gemm.py's GEMMs).

Owns: the autograd function `Fp8LinearFunction` (the CPU tier's path), the functional
`fp8_linear` (which hands CUDA inputs, and CPU ones inside `device_kernels_on_cpu()`, to
fp8/device_linear.py), the plain torch module `Fp8Linear` and the FP8 extra state of a layer. The
GEMMs, their names and routing (`gemm` argument: 'auto', 'batch_invariant', 'scaled_mm', 'exact',
'tiled', ...) are fp8/gemm.py's. The Megatron-facing layers (Column/RowParallelLinear drop-ins)
live in megatron_fp8rl/models/megatron_fp8_linear.py and call `fp8_linear`.

Arithmetic (x [..., K] flattened to [M, K], W [N, K], dy [M, N]):
- forward: y = Q_in(x) @ Q_w(W)^T, an FP8 GEMM with fp32 output, cast to x's dtype;
- dgrad:   dx = Q_g(dy) @ Q_w(W), FP8 GEMM (the per-tensor W data is transposed, exact);
- wgrad:   dW = Q_g(dy)^T @ Q_in(x), FP8 GEMM (both per-tensor operands transposed);
- bias gradient: sum of dy in high precision.
Q_g uses the recipe's backward format: E5M2 under 'hybrid', E4M3 under 'e4m3'. The backward's
GEMM is `gemm.backward_gemm` of the forward's. When an operand of a backward GEMM is not
per-tensor (block recipes), this path multiplies the dequantized operands in fp32 (the device
path instead runs FP8 GEMMs on column-wise quantizations, fp8/device_linear.py).
The weight stays a high-precision (FP32/BF16) master parameter; the FP8 copies of x and W saved
for the backward are 1 byte per element.
Speed on CPU (bench/fp8_linear_speed.py): a calibrated or frozen-scale weight's quantization is
cached (quantizer.WeightQuantCache) with its fp32 copy and transpose, which 'fp32_accumulate'
uses instead of casting the FP8 data again (`Fp8Tensor.dense`: the same values); a block
weight's with its codes' fp32 transpose (`dense_t`, what the grouped 'exact' GEMM reads) and its
dequantized values (`values`, what every backward's dgrad reads). The backward dequantizes a
block-scaled output gradient once for both of its GEMMs.
Device path: `fp8_linear` hands CUDA inputs (and CPU ones inside `device_kernels_on_cpu()`) to
fp8/device_linear.py (fused Triton quantization, FP8 forward, dgrad and wgrad through
`gemm.device_matmul_nt`, no host sync); Fp8LinearFunction, the CPU tier's path, never imports
triton.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only; the
'triton_invariant' GEMM imports fp8/triton_gemm.py, torch + triton, when first called; the device
path imports fp8/device_linear.py at its first call).
"""
from __future__ import annotations

import contextlib
import math

import torch

from megatron_fp8rl.fp8.gemm import backward_gemm, fp8_matmul_nt, resolve_gemm
from megatron_fp8rl.fp8.quantize import Fp8Tensor
from megatron_fp8rl.fp8.quantizer import Fp8Quantizers, make_quantizers
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling, Fp8Recipe

EXTRA_STATE_VERSION = 1


def _is_per_tensor(*tensors: Fp8Tensor) -> bool:
    return all(t.granularity == "tensor" for t in tensors)


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd function of y = x @ W^T + b with FP8 GEMMs (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantizers: Fp8Quantizers, gemm: str):
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"fp8_linear: input has {x.shape[-1]} features, weight {tuple(weight.shape)} "
                f"expects {weight.shape[1]}"
            )
        x2d = x.reshape(-1, x.shape[-1])
        x_q = quantizers.input.quantize(x2d)
        w_q = quantizers.weight.quantize(weight)
        gemm = resolve_gemm(gemm, x.device)
        y = fp8_matmul_nt(x_q, w_q, gemm)
        if bias is not None:
            y = y + bias.float()
        ctx.quantizers, ctx.gemm = quantizers, backward_gemm(gemm, x.device)
        ctx.x_meta = (x_q.scale_inv, x_q.granularity, x_q.block, x.shape, x.dtype)
        ctx.w_meta = (w_q.scale_inv, w_q.granularity, w_q.block, weight.dtype)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x_q.data, w_q.data)
        # a cached weight quantization (quantizer.WeightQuantCache) carries its fp32 copies (block
        # weights: the dequantized values); keep the object so the backward reuses them (the
        # cache owns the memory)
        ctx.w_cached = w_q if w_q.dense is not None or w_q.values is not None else None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_data, w_data = ctx.saved_tensors
        x_scale_inv, x_gran, x_block, x_shape, x_dtype = ctx.x_meta
        w_scale_inv, w_gran, w_block, w_dtype = ctx.w_meta
        x_q = Fp8Tensor(x_data, x_scale_inv, x_gran, x_block)
        w_q = ctx.w_cached
        if w_q is None:
            w_q = Fp8Tensor(w_data, w_scale_inv, w_gran, w_block)
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        g_q = ctx.quantizers.grad_output.quantize(dy)
        if not _is_per_tensor(g_q):  # dequantized once for both GEMMs
            g_q.values = g_q.dequantize()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if _is_per_tensor(g_q, w_q):
                grad_x = fp8_matmul_nt(g_q, w_q.t(), ctx.gemm)
            else:
                grad_x = g_q.dequantize() @ w_q.dequantize()
            grad_x = grad_x.to(x_dtype).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            if _is_per_tensor(g_q, x_q):
                grad_w = fp8_matmul_nt(g_q.t(), x_q.t(), ctx.gemm)
            else:
                grad_w = g_q.dequantize().t() @ x_q.dequantize()
            grad_w = grad_w.to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.float().sum(0).to(w_dtype)
        return grad_x, grad_w, grad_b, None, None


_DEVICE_KERNELS_ON_CPU = [False]


@contextlib.contextmanager
def device_kernels_on_cpu():
    """Inside: `fp8_linear` runs the device path (fp8/device_linear.py: fused Triton quantization,
    FP8 GEMMs in the backward, no host sync) on CPU tensors too, under TRITON_INTERPRET=1; for the
    tests that check the CUDA path's code on a machine without a GPU."""
    previous, _DEVICE_KERNELS_ON_CPU[0] = _DEVICE_KERNELS_ON_CPU[0], True
    try:
        yield
    finally:
        _DEVICE_KERNELS_ON_CPU[0] = previous


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantizers: Fp8Quantizers,
    gemm: str = "auto",
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T + bias [N], GEMMs in FP8 (module docstring).
    CUDA inputs (and CPU ones inside `device_kernels_on_cpu()`) take fp8/device_linear.py's path."""
    if x.device.type == "cuda" or _DEVICE_KERNELS_ON_CPU[0]:
        from megatron_fp8rl.fp8.device_linear import device_fp8_linear  # imports triton: device path only

        return device_fp8_linear(x, weight, bias, quantizers, gemm)
    return Fp8LinearFunction.apply(x, weight, bias, quantizers, gemm)


def quantizers_extra_state(recipe: Fp8Recipe, quantizers: Fp8Quantizers) -> dict:
    """The FP8 scaling state of one layer as a checkpointable dict (TE's `_extra_state` role)."""
    return {
        "version": EXTRA_STATE_VERSION,
        "recipe": repr(recipe),
        "quantizers": quantizers.state_dict(),
    }


def load_quantizers_extra_state(quantizers: Fp8Quantizers, state, name: str) -> None:
    """Restore what `quantizers_extra_state` saved; None (a checkpoint without FP8 state, e.g.
    one written by a high-precision layer) keeps the fresh state."""
    if state is None:
        return
    if not isinstance(state, dict) or state.get("version") != EXTRA_STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{name}: FP8 extra state must be a dict with version {EXTRA_STATE_VERSION}, found {found!r}"
        )
    quantizers.load_state_dict(state["quantizers"], name)


class Fp8Linear(torch.nn.Module):
    """A linear layer whose GEMMs run in FP8; the weight is a high-precision master parameter.

    The FP8 scaling state travels in `state_dict()` under `_extra_state`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: Fp8Recipe | None = None,
        group=None,
        dtype: torch.dtype = torch.float32,
        gemm: str = "auto",
    ):
        super().__init__()
        self.recipe = CalibratedDelayedScaling() if recipe is None else recipe
        resolve_gemm(gemm, torch.device("cpu"))  # reject an unknown name now, not at first use
        self.gemm = gemm
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.fp8_quantizers = make_quantizers(self.recipe, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_quantizers, self.gemm)

    def fp8_stats(self) -> dict:
        """{role: QuantStats of the last quantization}."""
        return self.fp8_quantizers.stats()

    def get_extra_state(self) -> dict:
        return quantizers_extra_state(self.recipe, self.fp8_quantizers)

    def set_extra_state(self, state) -> None:
        load_quantizers_extra_state(self.fp8_quantizers, state, type(self).__name__)
