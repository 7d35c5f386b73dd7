"""The device path's FP8 GEMM calls and the rules CUDA's kernels enforce for them, checked on the host.

Owns: `DeviceGemm` (one planned call: the kernel, its operands and scales in the layouts that
kernel takes, the out dtype, a fused bias), `plan_device_gemm` (a @ b^T of two Fp8Tensors as the
call of a kernel fp8/gemm.py's routing chose, the token dimension zero-padded where the kernel
needs it), `cublas_takes` (whether padding the tokens is enough for a cuBLAS kernel),
`check_cuda_gemm` (the rules; ValueError naming the dimension or tensor and the rule) and
`run_device_gemm` (the check, then the launch). fp8/gemm.py's `device_matmul_nt` is the caller.

Kernels and their rules (torch 2.13's meta checks of `_scaled_mm` / `_scaled_mm_v2`, aten's
ScaledBlas.cpp, and what cuBLAS refused on the lent H200, ../shared/DESIGN.md):
- 'cublas_tensor' / 'cublas_row': `torch._scaled_mm(mat_a [M, K], mat_b [K, N], scale_a, scale_b,
  bias=, out_dtype=)`: mat_a row-major, mat_b column-major, K and N multiples of 16, not both
  E5M2; scales float32, one element each per tensor, (M, 1) and (1, N) contiguous per row.
- 'cublas_1x128_128x128' / 'cublas_1x128_1x128': `torch.nn.functional.scaled_mm` with
  ScalingType.BlockWise1x128 for a and BlockWise128x128 / BlockWise1x128 for b (cuBLAS >= 12.9 on
  sm_90): the same layouts and multiples of 16; both operands E4M3; K and N multiples of 128 (the
  meta check sizes the scales by K // 128 and N // 128, ScaledBlas.cpp by ceil division: the two
  agree only there); M a multiple of 16 (cuBLAS answered NOT_SUPPORTED for M = 1, 2, 3, 7, 17,
  333, 4095 and ran M = 16); scale_a float32 (M, K/128) column-major (strides (1, M)); scale_b
  float32, for 128x128 blocks (L4, N/128) with L4 = K/128 rounded up to a multiple of 4, strides
  (1, L4), for 1x128 groups (N, K/128), strides (1, N).
- every cuBLAS kernel: out dtype float32, bfloat16 or float16; a bias only with a 16-bit output
  of the bias's own dtype, shape (N,) (ScaledBlas.cpp: no bias with a float32 output).
- 'triton': fp8/triton_gemm.py's kernel (which checks its operands itself): out float32 or
  bfloat16, no bias.
Padding: zero codes are exact zeros: extra rows of a are sliced off the result, extra
contraction columns (inside the last scale group; the scales keep their shape) add zero products
to every sum. Only the token dimension is padded, the one the caller names (`tokens`): the rows of a
in forward and dgrad, the contraction of the wgrad; padding a weight would copy it at every call.
CPU tensors (`linear.device_kernels_on_cpu()`, the tests): the blockwise kernels have no CPU
implementation and CPU `_scaled_mm` takes ~100x an fp32 matmul's time, so once the rules pass, the
same call runs on meta tensors of the same shapes and strides (torch applies its CUDA layout checks
there) and the result is an fp32 matmul of the codes, scaled as the kernel scales them.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch; triton through
fp8/triton_gemm.py when the Triton kernel first runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fp8rl.fp8.quantize import Fp8Tensor

BLOCKWISE_KERNELS = ("cublas_1x128_128x128", "cublas_1x128_1x128")
CUBLAS_KERNELS = ("cublas_tensor", "cublas_row", *BLOCKWISE_KERNELS)
KERNELS = (*CUBLAS_KERNELS, "triton")
"""The kernels a device GEMM call runs (module docstring)."""
TOKENS = ("rows", "contraction")
"""Which dimension of a @ b^T holds the tokens (and may be padded): a's rows, or the contraction."""
CUBLAS_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRITON_OUT_DTYPES = (torch.float32, torch.bfloat16)
MULTIPLE = 16
"""K and N of every cuBLAS FP8 GEMM, and M of the blockwise ones, are multiples of this."""
BLOCK = 128
"""K and N of the blockwise cuBLAS GEMMs are multiples of this (their scale groups)."""


@dataclass
class DeviceGemm:
    """One GEMM call of the device path, operands in the layouts its kernel takes (module docstring)."""

    kernel: str
    """One of KERNELS."""
    mat_a: torch.Tensor
    """a's FP8 codes [M, K] (rows padded where planned), row-major."""
    mat_b: torch.Tensor
    """b's FP8 codes as [K, N] (b [N, K] transposed: column-major)."""
    scale_a: torch.Tensor
    """a's dequant multipliers in the kernel's layout."""
    scale_b: torch.Tensor
    """b's dequant multipliers in the kernel's layout."""
    out_dtype: torch.dtype
    """The dtype the kernel writes."""
    rows: int
    """Rows of the result the caller keeps (a's rows before padding)."""
    bias: torch.Tensor | None = None
    """[N], added by the kernel's epilogue (cuBLAS kernels with a 16-bit output only)."""
    group: int | None = None
    """'triton': the K group width of block scales (None per tensor)."""
    b_rows: bool = False
    """'triton': b has 1xG group scales (else GxG blocks)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_tokens(kernel: str, m: int, k: int, tokens: str) -> tuple[int, int]:
    """(M, K) after padding the token dimension to what `kernel` takes (module docstring)."""
    if tokens not in TOKENS:
        raise ValueError(f"device FP8 GEMM: tokens {tokens!r}; valid: {TOKENS}")
    blockwise = kernel in BLOCKWISE_KERNELS
    if tokens == "rows":
        return (_round_up(m, MULTIPLE) if blockwise else m), k
    if kernel == "triton":
        return m, k
    return m, _round_up(k, BLOCK if blockwise else MULTIPLE)


def cublas_takes(kernel: str, a: Fp8Tensor, b: Fp8Tensor, tokens: str) -> bool:
    """Whether `kernel`'s rules on what cannot be padded (the weight's dimensions, the dtypes)
    hold for a [M, K] @ b [N, K]^T (module docstring)."""
    (m, k), n = a.data.shape, b.data.shape[0]
    k = padded_tokens(kernel, m, k, tokens)[1]
    if kernel in BLOCKWISE_KERNELS:
        e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn
        return e4m3 and k % BLOCK == 0 and n % BLOCK == 0
    both_e5m2 = a.data.dtype == b.data.dtype == torch.float8_e5m2
    return not both_e5m2 and k % MULTIPLE == 0 and n % MULTIPLE == 0


def _padded(codes: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 codes [r, c] with zero codes appended up to [rows, cols] (no copy when nothing is added)."""
    r, c = codes.shape
    if (r, c) == (rows, cols):
        return codes
    return torch.nn.functional.pad(codes.view(torch.uint8), (0, cols - c, 0, rows - r)).view(codes.dtype)


def _column_major(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """scales [r, g] (fp32) with zero rows appended up to `rows`, stored column-major (strides (1, rows))."""
    scales = scales.float()
    if scales.shape[0] != rows:
        scales = torch.nn.functional.pad(scales, (0, 0, 0, rows - scales.shape[0]))
    return scales.t().contiguous().t()


def _row_scales(t: Fp8Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """t's multipliers as row-wise `_scaled_mm` takes them: fp32, contiguous, `shape` ([M, 1] for
    a, [1, N] for b); a per-tensor scale broadcast to every row (a device copy, no host sync)."""
    scales = t.scale_inv.float()
    if t.granularity == "tensor":
        return scales.reshape(1, 1).expand(shape).contiguous()
    return scales.reshape(shape).contiguous()


def _kernel_scales(kernel: str, a: Fp8Tensor, b: Fp8Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_a, scale_b) in `kernel`'s layout for a padded to m rows and k columns."""
    n = b.data.shape[0]
    if kernel == "cublas_tensor":
        return a.scale_inv.float(), b.scale_inv.float()
    if kernel == "cublas_row":
        return _row_scales(a, (m, 1)), _row_scales(b, (1, n))
    if kernel == "triton":
        return a.scale_inv, b.scale_inv
    scale_a = _column_major(a.scale_inv, m)
    if kernel == "cublas_1x128_1x128":
        return scale_a, _column_major(b.scale_inv, n)
    groups = k // BLOCK
    padded = torch.nn.functional.pad(b.scale_inv.float(), (0, _round_up(groups, 4) - groups))
    return scale_a, padded.t()  # [L4, N/128], strides (1, L4)


def plan_device_gemm(kernel: str, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, tokens: str,
                     bias: torch.Tensor | None = None) -> DeviceGemm:
    """a [M, K] @ b [N, K]^T as a call of `kernel` (module docstring), the token dimension padded."""
    if kernel not in KERNELS:
        raise ValueError(f"device FP8 GEMM: kernel {kernel!r}; valid: {KERNELS}")
    (m, k), n = a.data.shape, b.data.shape[0]
    m_padded, k_padded = padded_tokens(kernel, m, k, tokens)
    mat_a = _padded(a.data, m_padded, k_padded)
    mat_b = _padded(b.data, n, k_padded).t()
    scale_a, scale_b = _kernel_scales(kernel, a, b, m_padded, k_padded)
    triton = {"group": a.block[1], "b_rows": b.block[0] == 1} if kernel == "triton" and a.block else {}
    return DeviceGemm(kernel, mat_a, mat_b, scale_a, scale_b, out_dtype, m, bias, **triton)


class _Rules:
    """Collects the rule a call breaks into one ValueError naming the call."""

    def __init__(self, call: DeviceGemm):
        (m, k), n = call.mat_a.shape, call.mat_b.shape[1]
        self.call, self.m, self.k, self.n = call, m, k, n

    def require(self, holds: bool, rule: str) -> None:
        if not holds:
            call = self.call
            raise ValueError(f"device FP8 GEMM {call.kernel} (a [M={self.m}, K={self.k}] {call.mat_a.dtype} x "
                             f"b [K, N={self.n}] {call.mat_b.dtype}, out {call.out_dtype}): {rule}")


def _strides_are(t: torch.Tensor, strides: tuple[int, int]) -> bool:
    """t's strides are `strides`, a size-1 dimension's stride aside."""
    return all(size == 1 or stride == want for size, stride, want in zip(t.shape, t.stride(), strides))


def _check_layouts(rules: _Rules) -> None:
    call, m, k, n = rules.call, rules.m, rules.k, rules.n
    rules.require(call.mat_a.dim() == call.mat_b.dim() == 2 and call.mat_b.shape[0] == k,
                  f"mat_a [M, K] and mat_b [K, N] must share K; found {tuple(call.mat_b.shape)}")
    rules.require(call.mat_a.stride(1) == 1 and call.mat_a.stride(0) > 1,
                  f"mat_a must be row-major; strides {call.mat_a.stride()}")
    rules.require(call.mat_b.stride(0) == 1 and call.mat_b.stride(1) > 1,
                  f"mat_b must be column-major; strides {call.mat_b.stride()}")
    rules.require(k % MULTIPLE == 0, f"the contraction dimension K = {k} must be a multiple of {MULTIPLE} "
                                     "(pad the tokens of a wgrad with zero codes)")
    rules.require(n % MULTIPLE == 0, f"the output dimension N = {n} (mat_b's columns) must be a multiple of {MULTIPLE}")
    rules.require(call.out_dtype in CUBLAS_OUT_DTYPES, f"out dtype must be one of {CUBLAS_OUT_DTYPES}")
    bias = call.bias
    rules.require(bias is None or (call.out_dtype != torch.float32 and bias.dtype == call.out_dtype
                                   and tuple(bias.shape) == (n,)),
                  f"a bias needs a 16-bit output of its own dtype and shape ({n},); found "
                  f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")


def _check_scales(rules: _Rules) -> None:
    call, m, k, n = rules.call, rules.m, rules.k, rules.n
    sa, sb = call.scale_a, call.scale_b
    rules.require(sa.dtype == sb.dtype == torch.float32, f"scales must be float32; found {sa.dtype}, {sb.dtype}")
    if call.kernel == "cublas_tensor":
        rules.require(sa.numel() == sb.numel() == 1, f"per-tensor scales hold one element each; found "
                                                     f"{tuple(sa.shape)}, {tuple(sb.shape)}")
        return
    if call.kernel == "cublas_row":
        rules.require(tuple(sa.shape) == (m, 1) and tuple(sb.shape) == (1, n) and sa.is_contiguous()
                      and sb.is_contiguous(), f"row-wise scales are contiguous ({m}, 1) and (1, {n}); found "
                                              f"{tuple(sa.shape)}, {tuple(sb.shape)}")
        return
    rules.require(call.mat_a.dtype == call.mat_b.dtype == torch.float8_e4m3fn, "blockwise operands must be E4M3")
    rules.require(m % MULTIPLE == 0, f"the rows M = {m} must be a multiple of {MULTIPLE} (cuBLAS blockwise refused "
                                     "M = 1, 2, 3, 7, 17, 333, 4095: pad the tokens)")
    rules.require(k % BLOCK == 0, f"the contraction dimension K = {k} must be a multiple of {BLOCK}")
    rules.require(n % BLOCK == 0, f"the output dimension N = {n} must be a multiple of {BLOCK}")
    rules.require(tuple(sa.shape) == (m, k // BLOCK) and _strides_are(sa, (1, m)),
                  f"scale_a must be ({m}, {k // BLOCK}) column-major; found {tuple(sa.shape)} strides {sa.stride()}")
    if call.kernel == "cublas_1x128_1x128":
        want, strides = (n, k // BLOCK), (1, n)
    else:
        l4 = _round_up(k // BLOCK, 4)
        want, strides = (l4, n // BLOCK), (1, l4)
    rules.require(tuple(sb.shape) == want and _strides_are(sb, strides),
                  f"scale_b must be {want} with strides {strides}; found {tuple(sb.shape)} strides {sb.stride()}")


def check_cuda_gemm(call: DeviceGemm) -> None:
    """ValueError naming the dimension or tensor and the rule when `call` breaks a rule of its
    kernel (module docstring): host-side shape, stride and dtype checks, run before every launch."""
    rules = _Rules(call)
    if call.kernel == "triton":
        rules.require(call.out_dtype in TRITON_OUT_DTYPES, f"out dtype must be one of {TRITON_OUT_DTYPES}")
        rules.require(call.bias is None, "the Triton kernel has no bias epilogue")
        return
    rules.require(call.kernel in CUBLAS_KERNELS, f"unknown kernel; valid: {KERNELS}")
    _check_layouts(rules)
    rules.require(not call.mat_a.dtype == call.mat_b.dtype == torch.float8_e5m2, "both operands E5M2")
    _check_scales(rules)


def _blockwise(call: DeviceGemm, mat_a, mat_b, scale_a, scale_b, bias) -> torch.Tensor:
    """`call`'s blockwise cuBLAS GEMM on the given tensors (the call's own, or meta stand-ins)."""
    from torch.nn.functional import ScalingType, scaled_mm

    recipe_b = ScalingType.BlockWise1x128 if call.kernel == "cublas_1x128_1x128" else ScalingType.BlockWise128x128
    return scaled_mm(mat_a, mat_b, scale_a, ScalingType.BlockWise1x128, scale_b, recipe_b, bias=bias,
                     output_dtype=call.out_dtype)


def _scaled_mm(call: DeviceGemm, mat_a, mat_b, scale_a, scale_b, bias) -> torch.Tensor:
    """`call`'s per-tensor / row-wise cuBLAS GEMM on the given tensors (the call's own, or meta stand-ins)."""
    return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=call.out_dtype)


def _cublas(call: DeviceGemm, *tensors) -> torch.Tensor:
    return (_scaled_mm if call.kernel in ("cublas_tensor", "cublas_row") else _blockwise)(call, *tensors)


def _operands(call: DeviceGemm) -> tuple:
    return call.mat_a, call.mat_b, call.scale_a, call.scale_b, call.bias


def _dequantized_blocks(call: DeviceGemm) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [M, K], b [K, N]) of a blockwise `call` in fp32, each code times its group's multiplier."""
    a = call.mat_a.float() * call.scale_a.repeat_interleave(BLOCK, 1)
    b = call.mat_b.float()
    if call.kernel == "cublas_1x128_1x128":
        return a, b * call.scale_b.t().repeat_interleave(BLOCK, 0)
    groups = b.shape[0] // BLOCK
    return a, b * call.scale_b[:groups].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


def _cublas_on_cpu(call: DeviceGemm) -> torch.Tensor:
    """A cuBLAS call on CPU tensors (module docstring): torch's own checks of the same call on meta
    tensors (torch applies its CUDA layout rules there), then the fp32 matmul of the codes with
    their multipliers applied as the kernel's epilogue does: per tensor and per row after the sum
    ('fp32_accumulate' of fp8/gemm.py, bit for bit), per group before it."""
    _cublas(call, *(None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                    for t in _operands(call)))
    if call.kernel in ("cublas_tensor", "cublas_row"):
        y = (call.mat_a.float() @ call.mat_b.float()) * call.scale_a * call.scale_b
    else:
        a, b = _dequantized_blocks(call)
        y = a @ b
    return (y if call.bias is None else y + call.bias.float()).to(call.out_dtype)


def run_device_gemm(call: DeviceGemm) -> torch.Tensor:
    """`check_cuda_gemm(call)`, then the kernel; the result's first `call.rows` rows, [rows, N]. An
    empty product (no tokens) runs no kernel (torch exempts zero dimensions from its rules too):
    zeros, plus the bias."""
    if 0 in (call.rows, *call.mat_b.shape):
        zeros = torch.zeros(call.rows, call.mat_b.shape[1], device=call.mat_a.device)
        return (zeros if call.bias is None else zeros + call.bias.float()).to(call.out_dtype)
    check_cuda_gemm(call)
    if call.kernel == "triton":
        from megatron_fp8rl.fp8.triton_gemm import triton_fp8_matmul_nt

        y = triton_fp8_matmul_nt(call.mat_a, call.mat_b.t(), call.scale_a, call.scale_b, group=call.group,
                                 b_rows=call.b_rows, out_dtype=call.out_dtype)
    elif call.mat_a.device.type == "cpu":
        y = _cublas_on_cpu(call)
    else:
        y = _cublas(call, *_operands(call))
    return y if y.shape[0] == call.rows else y[:call.rows]
