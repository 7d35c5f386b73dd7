"""The FP8 linear's device path (fp8/device_linear.py) run on CPU tensors under Triton's
interpreter (`linear.device_kernels_on_cpu()`, GEMMs routed as on CUDA: fp8/gemm.py): forward,
dgrad and wgrad against an fp64 oracle within a bound derived from FP8 rounding, also at the token
counts RL micro-batches have (1, 50, 333; 4095 in the slow tier) with every cuBLAS call passing
our CUDA rules and torch's own checks, against the CPU path (bit for bit where both multiply
the same operands), the weight cache's hits and misses, no host synchronization for any recipe,
combinations without a device kernel refused by name, and the CPU path never importing triton.

The bound, for y = a @ b^T with FP8 operands a^ = a + da, b^ = b + db: an FP8 rounding errs by at
most r |v| + d, r = 2**-(mantissa bits + 1) (half an ulp, normal range) and d = half the subnormal
step times the largest dequant multiplier of that operand (saturation aside; these inputs do not
saturate). So |a^ b^ - a b| summed over K is at most (r_a + r_b + r_a r_b) (|a| @ |b|^T)
+ d_a (1 + r_b) sum_k |b| + d_b (1 + r_a) sum_k |a| + K d_a d_b, plus the GEMM's fp32 accumulation
(K + 4) 2**-24 (|a^| @ |b^|^T) and the fp32 result's own rounding; 1 % covers second-order terms.
"""
import contextlib
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fp8rl.fp8.device_quantize import check_device_recipe, device_quantize_weight
from megatron_fp8rl.fp8.formats import recipe_formats
from megatron_fp8rl.fp8.gemm import check_recipe_gemm
from megatron_fp8rl.fp8.linear import device_kernels_on_cpu, fp8_linear
from megatron_fp8rl.fp8.quantizer import make_quantizers, weights_updated
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CalibratedDelayedScaling, recipe_by_name

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]
RECIPES = ["calibrated", "tensorwise", "te_delayed", "megatron_delayed", "blockwise", "groupwise", "groupwise32"]
PER_TENSOR = ["calibrated", "tensorwise", "te_delayed", "megatron_delayed"]
M0, M1, K, N = 2, 24, 160, 96  # x [2, 24, 160]: K and N ragged against 128 (and 160 = 5 x 32)
U = 2.0**-24


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M0, M1, K, generator=gen) * torch.logspace(-1, 1, K)
    w = torch.randn(N, K, generator=gen) * 0.05
    b = torch.randn(N, generator=gen) * 0.1
    dy = torch.randn(M0, M1, N, generator=gen) * 1e-2
    return x, w, b, dy


def _run(name, device_path, seed=0, gemm="auto", fmt="hybrid"):
    """(y, dx, dW, db, quantizers) of one fp8_linear forward + backward."""
    x, w, b, dy = _inputs(seed)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    quantizers = make_quantizers(recipe_by_name(name, fp8_format=fmt))
    with device_kernels_on_cpu() if device_path else contextlib.nullcontext():
        y = fp8_linear(x, w, b, quantizers, gemm)
        y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad, quantizers


def _rounding(fmt, stats):
    """(r, d) of one FP8 operand (module docstring) from its quantizer's statistics."""
    r = 2.0 ** -(4 if fmt.name == "e4m3" else 3)
    return r, fmt.min_subnormal / 2 / float(stats.scale)


def _bound(a, b, rounding_a, rounding_b):
    """The module docstring's bound on |fp8 a @ b^T - a @ b^T| elementwise, a [m, k], b [n, k]."""
    (ra, da), (rb, db) = rounding_a, rounding_b
    a, b = a.double().abs(), b.double().abs()
    k = a.shape[1]
    quantized = (ra + rb + ra * rb) * (a @ b.t()) + da * (1 + rb) * b.sum(1)[None, :] \
        + db * (1 + ra) * a.sum(1)[:, None] + k * da * db
    magnitudes = (a * (1 + ra) + da) @ (b * (1 + rb) + db).t()
    return 1.01 * (quantized + (k + 4) * U * magnitudes) + U * (a @ b.t())


def _assert_within_bound(name, fmt, inputs, outputs, quantizers):
    """y, dx and dW of one device-path forward + backward within the module docstring's bound of
    the fp64 oracle; db the plain fp32 sum of dy."""
    (x, w, b, dy), (y, dx, dw, db) = (t.double() for t in inputs), outputs
    n, k = w.shape
    forward, backward = recipe_formats(recipe_by_name(name, fp8_format=fmt).fp8_format)
    stats = quantizers.stats()
    rx, rw, rg = (_rounding(operand_fmt, stats[role]) for operand_fmt, role in
                  ((forward, "input"), (forward, "weight"), (backward, "grad_output")))
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    checks = {"y": (y.reshape(-1, n), x2 @ w.t() + b, _bound(x2, w, rx, rw)),
              "dx": (dx.reshape(-1, k), dy2 @ w, _bound(dy2, w.t(), rg, rw)),
              "dW": (dw, dy2.t() @ x2, _bound(dy2.t(), x2.t(), rg, rx))}
    for label, (got, exact, bound) in checks.items():
        ratio = ((got.double() - exact).abs() / bound).max()
        print(f"{name} {fmt} {label}: max |error| / bound {float(ratio):.3f}")
        assert ratio <= 1, label
    assert torch.equal(db, inputs[3].reshape(-1, n).sum(0))  # bias: plain fp32 sum of dy


@pytest.mark.parametrize("name", RECIPES)
def test_forward_and_backward_within_the_fp64_oracle_bound(name):
    *outputs, quantizers = _run(name, device_path=True)
    _assert_within_bound(name, "hybrid", _inputs(), outputs, quantizers)


RL_TOKENS = [1, 50, 333]
"""Token counts RL micro-batches have (padded to the longest sample: rarely a multiple of 16)."""
RL_K, RL_N = 256, 128
"""Multiples of 128: the cuBLAS blockwise kernels take the block recipes' E4M3 x E4M3 GEMMs."""
BLOCK_CUBLAS_CALLS = {("groupwise32", "hybrid"): 0, ("groupwise32", "e4m3"): 0, ("blockwise", "hybrid"): 1,
                      ("groupwise", "hybrid"): 1, ("blockwise", "e4m3"): 3, ("groupwise", "e4m3"): 3}
"""cuBLAS GEMMs of a block recipe's forward + backward: 1x32 groups have none (the Triton kernel),
E5M2 gradients ('hybrid') none in the backward; per-tensor recipes run all three on cuBLAS."""


class CublasCalls(TorchDispatchMode):
    """Records the cuBLAS FP8 GEMMs torch checked: on CPU tensors fp8/cuda_gemm.py hands each call
    to torch on meta tensors, where torch applies its CUDA rules (a call they refuse raises)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_scaled_mm", "_scaled_mm_v2"):
            self.calls.append((func.overloadpacket.__name__, tuple(args[0].shape), args[0].device.type))
        return func(*args, **(kwargs or {}))


def _rl_case(name, fmt, tokens):
    """(inputs, outputs, quantizers, cuBLAS calls) of one device-path forward + backward over `tokens` tokens."""
    gen = torch.Generator().manual_seed(tokens)
    inputs = (torch.randn(tokens, RL_K, generator=gen) * torch.logspace(-1, 1, RL_K),
              torch.randn(RL_N, RL_K, generator=gen) * 0.05, torch.randn(RL_N, generator=gen) * 0.1,
              torch.randn(tokens, RL_N, generator=gen) * 1e-2)
    x, w, b = (t.clone().requires_grad_() for t in inputs[:3])
    quantizers = make_quantizers(recipe_by_name(name, fp8_format=fmt))
    with device_kernels_on_cpu(), CublasCalls() as cublas:
        y = fp8_linear(x, w, b, quantizers)
        y.backward(inputs[3])
    return inputs, (y.detach(), x.grad, w.grad, b.grad), quantizers, cublas.calls


def _check_rl_tokens(name, fmt, tokens):
    inputs, outputs, quantizers, calls = _rl_case(name, fmt, tokens)
    _assert_within_bound(name, fmt, inputs, outputs, quantizers)
    assert len(calls) == BLOCK_CUBLAS_CALLS.get((name, fmt), 3), calls
    for op, (rows, _), device in calls:
        assert device == "meta" and (op == "_scaled_mm" or rows % 16 == 0), (op, rows)  # blockwise: M padded


@pytest.mark.parametrize("tokens", RL_TOKENS)
@pytest.mark.parametrize("name, fmt", [(name, "hybrid") for name in RECIPES]
                         + [(name, "e4m3") for name in ("blockwise", "groupwise", "groupwise32")])
def test_rl_token_counts_pass_the_cuda_rules_and_the_oracle_bound(name, fmt, tokens):
    _check_rl_tokens(name, fmt, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name, fmt", [(name, "hybrid") for name in RECIPES] + [("blockwise", "e4m3")])
def test_rl_token_count_4095_passes_the_cuda_rules_and_the_oracle_bound(name, fmt):
    _check_rl_tokens(name, fmt, 4095)


@pytest.mark.parametrize("name", PER_TENSOR)
def test_per_tensor_recipes_equal_the_cpu_path_bit_for_bit(name):
    # the device path's cuBLAS `_scaled_mm` runs on CPU as the fp32 GEMM of the codes scaled after the
    # sum (fp8/cuda_gemm.py), the CPU path's 'fp32_accumulate' (48 tokens: no padding)
    device, cpu = _run(name, device_path=True, gemm="scaled_mm"), _run(name, device_path=False, gemm="fp32_accumulate")
    for got, expected in zip(device[:4], cpu[:4]):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["blockwise", "groupwise32"])
def test_block_recipes_forward_equals_the_cpu_path(name):
    # their backward multiplies column-wise quantized operands, the CPU path dequantized rows
    device, cpu = (_run(name, device_path=on_device, gemm="triton_invariant")[0] for on_device in (True, False))
    assert torch.equal(device, cpu)


@pytest.mark.parametrize("name", ["calibrated", "groupwise", "tensorwise"])
def test_weight_cache_hits_across_micro_batches_and_misses_after_an_update(name):
    quantizer = make_quantizers(recipe_by_name(name)).weight
    w = _inputs()[1]
    first = device_quantize_weight(quantizer, w)
    assert device_quantize_weight(quantizer, w) is first  # the next micro-batch
    with torch.no_grad():
        w.mul_(2.0)  # an in-place step through autograd's view: the version counter moves
    second = device_quantize_weight(quantizer, w)
    assert second is not first and torch.equal(second.data.view(torch.uint8), first.data.view(torch.uint8))
    w.data.mul_(0.5)  # through .data: the version counter does not move, the generation must
    assert device_quantize_weight(quantizer, w) is second
    weights_updated()
    third = device_quantize_weight(quantizer, w)
    assert third is not second and torch.equal(third.scale_inv, first.scale_inv)


def test_calibrated_weight_cache_hits_keep_the_state_the_cpu_path_has():
    device_q, cpu_q = (make_quantizers(CalibratedDelayedScaling(amax_history_len=3)).weight for _ in range(2))
    w = _inputs()[1]
    for _ in range(4):
        device_quantize_weight(device_q, w)
        cpu_q.quantize(w)
    assert torch.equal(device_q.state.amax_history, cpu_q.state.amax_history)
    assert torch.equal(device_q.state.scale, cpu_q.state.scale)


SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "equal", "is_nonzero", "unique_dim",
            "_unique", "_unique2", "unique_consecutive", "argwhere", "masked_scatter", "repeat_interleave"}
"""aten ops that make the host wait for a CUDA stream (their result's size or value is needed on
the host); `repeat_interleave` with tensor repeats, `index` with a bool mask (nonzero) included."""


def _bool_index(args) -> bool:
    """An index list holding a bool mask (its size is a count of True values: a nonzero)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class NoHostSync(TorchDispatchMode):
    """Fails on any op that would synchronize the host with a CUDA stream, and on copies between
    devices (a copy to the host)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name in ("index", "index_put", "index_put_") and _bool_index(args)):
            raise AssertionError(f"host synchronization: aten::{name}")
        if name in ("copy_", "_to_copy"):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
            if len(devices) > 1:
                raise AssertionError(f"host synchronization: aten::{name} between {sorted(map(str, devices))}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", RECIPES)
def test_no_host_synchronization_in_forward_or_backward(name):
    x, w, b, dy = _inputs()
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    quantizers = make_quantizers(recipe_by_name(name, fp8_format="hybrid"))
    with device_kernels_on_cpu():
        for _ in range(2):  # the second call: state from history, weight cache hit
            with NoHostSync():
                y = fp8_linear(x, w, b, quantizers)
                y.backward(dy)


def test_the_guard_catches_the_cpu_path_and_the_usual_syncs():
    x, w, b, _ = _inputs()
    with pytest.raises(AssertionError, match="host synchronization"), NoHostSync():
        fp8_linear(x, w, b, make_quantizers(recipe_by_name("calibrated")))
    t = torch.ones(3)
    for sync in (lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: t.nonzero(), lambda: t[t > 0]):
        with pytest.raises(AssertionError, match="host synchronization"), NoHostSync():
            sync()


WITHOUT_DEVICE_KERNEL = [
    CalibratedDelayedScaling(criterion="mse"),
    CalibratedDelayedScaling(criterion="percentile", saturation_budget=1e-3, overflow_tolerance=1e-3),
    BlockwiseScaling(weight_block=(64, 64), activation_block=(1, 64)),
    BlockwiseScaling(weight_block=(128, 128), activation_block=(1, 32)),
]


@pytest.mark.parametrize("recipe", WITHOUT_DEVICE_KERNEL)
def test_recipes_without_a_device_kernel_are_refused_by_name(recipe):
    with pytest.raises(ValueError, match="no device kernel"):
        check_device_recipe(recipe)
    # the GEMM's own refusal comes first where the blocks have no FP8 GEMM either
    with pytest.raises(ValueError, match="no device kernel|have no FP8 kernel"):
        check_recipe_gemm(recipe, "auto", torch.device("cuda"))
    check_recipe_gemm(recipe, "auto", torch.device("cpu"))  # the CPU tier has code for all of them


def test_cpu_path_does_not_import_triton():
    code = ("import sys, torch\n"
            "from megatron_fp8rl.fp8.linear import fp8_linear\n"
            "from megatron_fp8rl.fp8.quantizer import make_quantizers\n"
            "from megatron_fp8rl.fp8.recipe import recipe_by_name\n"
            "import megatron_fp8rl.fp8.device_quantize\n"
            "for name in ('calibrated', 'groupwise32'):\n"
            "    x = torch.randn(4, 64, requires_grad=True)\n"
            "    quantizers = make_quantizers(recipe_by_name(name))\n"
            "    fp8_linear(x, torch.randn(8, 64), None, quantizers).sum().backward()\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
