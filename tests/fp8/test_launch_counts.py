"""Kernel launches of the FP8 linear's device path (fp8/device_linear.py), counted on CPU tensors
under Triton's interpreter with the GEMMs routed as on CUDA: at most 3 launches per quantized
operand and 12 per linear forward + backward for every recipe (warm weight cache, the second
call counted), and no-grad passes that quantize once (no transposed or column-wise copy).

What counts as a launch (`LaunchCounter`): every Triton kernel launch (`kernel[grid](...)`, hooked
at triton's `KernelInterface.__getitem__`, which compiled and interpreted kernels share; the
interpreter's own torch work inside a launch is not counted), and every aten op that would run a
kernel on a CUDA device: all ops except views (`OpOverload.is_view`: view, t, as_strided, expand,
slices, ...), allocations without a fill (empty, empty_strided, empty_like, new_empty), the
metadata-only detach / alias / lift_fresh, and ops whose outputs hold no element (a copy of 0
elements). A fill (zeros, ones, full) counts. GEMMs as on CUDA: the device path routes every GEMM
as for CUDA tensors (fp8/gemm.py `device_matmul_nt`, gemm='scaled_mm', what 'auto' resolves to on
CUDA): a cuBLAS call (fp8/cuda_gemm.py; on CPU its stand-in `_cublas_on_cpu`) counts as one launch,
whatever its stand-in computes; the Triton GEMM counts as its launch; the operand padding and scale
layouts a call plans run as counted aten ops, as they would on CUDA.
"""
import collections

import pytest
import torch
import triton.runtime.jit as triton_jit
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fp8rl.fp8 import cuda_gemm
from megatron_fp8rl.fp8.device_quantize import device_quantize, device_quantize_weight
from megatron_fp8rl.fp8.linear import device_kernels_on_cpu, fp8_linear
from megatron_fp8rl.fp8.quantizer import make_quantizers, weights_updated
from megatron_fp8rl.fp8.recipe import RECIPE_NAMES, recipe_by_name

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]
RECIPES = list(RECIPE_NAMES)
PER_OPERAND, PER_LINEAR = 3, 12
FREE_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "detach", "alias", "lift_fresh"}
"""aten ops that launch no device kernel besides views (module docstring)."""


class LaunchCounter(TorchDispatchMode):
    """Counts launches by name while active (module docstring); `triton_flags` keeps each Triton
    launch's TRANSPOSED / COLWISE arguments (which copies a quantize pass wrote)."""

    def __init__(self):
        super().__init__()
        self.launches, self.triton_flags, self._in_triton = collections.Counter(), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._in_triton and not func.is_view and func.overloadpacket.__name__ not in FREE_OPS:
            outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            if not outputs or any(t.numel() for t in outputs):
                self.launches[func.overloadpacket.__name__] += 1
        return out

    def triton_launch(self, name: str, kwargs: dict):
        self.launches[f"triton:{name}"] += 1
        self.triton_flags.append((name, kwargs.get("TRANSPOSED", False), kwargs.get("COLWISE", False)))

    @property
    def total(self) -> int:
        return sum(self.launches.values())


_ACTIVE: list = []


@pytest.fixture(autouse=True)
def _count_triton_launches(monkeypatch):
    """Every `kernel[grid](...)` reports to the active LaunchCounter; the interpreter's torch work
    inside the launch is not counted."""
    original = triton_jit.KernelInterface.__getitem__

    def getitem(kernel, grid):
        launch = original(kernel, grid)

        def counted(*args, **kwargs):
            counter = _ACTIVE[-1] if _ACTIVE else None
            if counter is None:
                return launch(*args, **kwargs)
            counter.triton_launch(kernel.__name__, kwargs)
            counter._in_triton += 1
            try:
                return launch(*args, **kwargs)
            finally:
                counter._in_triton -= 1

        return counted

    monkeypatch.setattr(triton_jit.KernelInterface, "__getitem__", getitem)
    original_cublas = cuda_gemm._cublas_on_cpu

    def cublas_launch(call):
        """One cuBLAS call is one launch; its CPU stand-in's torch work is not counted."""
        counter = _ACTIVE[-1] if _ACTIVE else None
        if counter is None:
            return original_cublas(call)
        counter.launches[f"cublas:{call.kernel}"] += 1
        counter._in_triton += 1
        try:
            return original_cublas(call)
        finally:
            counter._in_triton -= 1

    monkeypatch.setattr(cuda_gemm, "_cublas_on_cpu", cublas_launch)


class counting:
    """`with counting() as counter:` counts the launches inside."""

    def __enter__(self) -> LaunchCounter:
        self.counter = LaunchCounter()
        _ACTIVE.append(self.counter)
        self.counter.__enter__()
        return self.counter

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)
        _ACTIVE.pop()


def _inputs(seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, 160, generator=gen) * torch.logspace(-1, 1, 160)
    w = torch.randn(96, 160, generator=gen) * 0.05
    b = torch.randn(96, generator=gen) * 0.1
    dy = torch.randn(2, 24, 96, generator=gen) * 1e-2
    return (*(t.requires_grad_(requires_grad) for t in (x, w, b)), dy)


def _fwd_bwd(x, w, b, dy, quantizers):
    y = fp8_linear(x, w, b, quantizers, "scaled_mm")
    return (y, *torch.autograd.grad(y, (x, w, b), dy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", RECIPES)
def test_a_linear_forward_and_backward_launches_at_most_12_kernels(name, dtype):
    x, w, b, dy = (t.detach().to(dtype).requires_grad_(t.requires_grad) for t in _inputs())
    quantizers = make_quantizers(recipe_by_name(name))
    with device_kernels_on_cpu():
        first = _fwd_bwd(x, w, b, dy, quantizers)  # fills the weight cache, gives delayed scales a history
        with counting() as counter:
            second = _fwd_bwd(x, w, b, dy, quantizers)
    print(f"{name} {dtype}: {counter.total} launches {dict(counter.launches)}")
    assert counter.total <= PER_LINEAR, dict(counter.launches)
    assert all(torch.isfinite(t).all() for t in (*first, *second))


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_an_activation_quantization_launches_at_most_3_kernels(name, role):
    quantizer = getattr(make_quantizers(recipe_by_name(name)), role)
    x = _inputs(requires_grad=False)[0].reshape(-1, 160)
    device_quantize(quantizer, x, transposed=True)  # the second call: delayed scales from history
    with counting() as counter:
        device_quantize(quantizer, x, transposed=True)
    assert counter.total <= PER_OPERAND, dict(counter.launches)


@pytest.mark.parametrize("name", RECIPES)
def test_a_weight_is_quantized_again_only_after_an_update(name):
    quantizer = make_quantizers(recipe_by_name(name)).weight
    w = _inputs(requires_grad=False)[1]
    with counting() as cold:
        first = device_quantize_weight(quantizer, w)
    with counting() as warm:
        hit = device_quantize_weight(quantizer, w)
    weights_updated()  # an optimizer step
    with counting() as updated:
        again = device_quantize_weight(quantizer, w)
    assert cold.total <= PER_OPERAND and updated.total <= PER_OPERAND, (dict(cold.launches), dict(updated.launches))
    # a calibrated weight's hit still records its bound and rolls its history (one launch)
    assert warm.total <= (1 if name == "calibrated" else 0), dict(warm.launches)
    assert hit is first and again is not first


@pytest.mark.parametrize("name", RECIPES)
def test_no_grad_passes_quantize_once(name):
    x, w, b, dy = _inputs()
    live, reference = (make_quantizers(recipe_by_name(name)) for _ in range(2))
    with device_kernels_on_cpu():
        with counting() as counter, torch.no_grad():
            y = fp8_linear(x, w, b, live, "scaled_mm")
        expected = _fwd_bwd(x, w, b, dy, reference)
        assert y.grad_fn is None and torch.equal(y, expected[0])
        # transposed / column-wise copies: none written by any quantize pass
        quantize_passes = [flags for flags in counter.triton_flags if flags[0] == "_quantize_kernel"]
        assert quantize_passes and not any(transposed or colwise for _, transposed, colwise in quantize_passes)
        assert live.weight._device_weight_cache[1].transposed is None
        # the next pass that needs a gradient adds the weight's copy: the one a grad pass made
        assert all(torch.isfinite(grad).all() for grad in _fwd_bwd(x, w, b, dy, live)[1:])
        added, made = (quantizers.weight._device_weight_cache[1].transposed for quantizers in (live, reference))
        assert torch.equal(added.data.view(torch.uint8), made.data.view(torch.uint8))
        assert torch.equal(added.scale_inv, made.scale_inv)


def test_frozen_weights_get_no_column_wise_copy_of_the_input():
    x, w, b, _ = _inputs(requires_grad=False)
    quantizers = make_quantizers(recipe_by_name("groupwise"))
    with device_kernels_on_cpu(), counting() as counter:
        fp8_linear(x.requires_grad_(), w, b, quantizers, "scaled_mm")
    # x first: no wgrad, no copy; the weight: the copy its dgrad reads
    assert [colwise for name, _, colwise in counter.triton_flags if name == "_quantize_kernel"] == [False, True]


def test_the_counter_counts_kernels_not_views_or_allocations():
    with counting() as counter:
        t = torch.ones(4, 3)  # a fill: 1
        t.view(3, 4).t().expand(2, 4, 3)  # views: 0
        torch.empty(5)  # an allocation: 0
        t.detach().float()  # detach, and a cast to the dtype t has: 0
        (t + 1).sum()  # 2
        torch.zeros(0, 3).clone()  # the fill and the copy of 0 elements: 0
    assert dict(counter.launches) == {"ones": 1, "add": 1, "sum": 1}
