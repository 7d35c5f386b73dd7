"""The megatron-core CPU compatibility layer: explicit activation, version guard, real GPT on CPU."""
import pytest
import torch

from megatron_fp8rl.compat import megatron_cpu, versions
from megatron_fp8rl.compat.versions import UntestedVersionError


def test_not_enabled_by_import():
    import importlib

    importlib.reload(megatron_cpu)
    assert torch.cuda.current_device is not None and not megatron_cpu._saved


def test_untested_version_is_refused(monkeypatch):
    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.99.0")
    with pytest.raises(UntestedVersionError, match="megatron-core 0.99.0 is installed.*tested with megatron-core 0.16.1"):
        megatron_cpu.enable()
    assert not megatron_cpu._saved


def test_disable_restores_torch_cuda():
    original = torch.cuda.current_device
    assert megatron_cpu.enable()
    assert torch.cuda.current_device is not original
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    megatron_cpu.disable()
    assert torch.cuda.current_device is original
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


def test_gpt_forward_backward_tp1(megatron_tp1):
    """A real GPTModel (local spec) runs forward and backward on CPU; the loss is a real CE."""
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config

    model = build_gpt_model(tiny_transformer_config(), vocab_size=128, max_sequence_length=16)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    logits = model(tokens, positions, None)
    assert logits.shape == (2, 16, 128) and logits.device.type == "cpu"
    per_token = model(tokens, positions, None, labels=tokens)
    oracle = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tokens.reshape(-1), reduction="none")
    torch.testing.assert_close(per_token.reshape(-1), oracle, rtol=1e-5, atol=1e-5)
    per_token.mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_rng_tracker_forks_differ_from_default(megatron_tp1):
    """Megatron's model-parallel RNG state is tracked separately from the default generator."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    default = torch.rand(4)
    assert not torch.equal(forked, default)


@pytest.mark.parametrize("call", ["matmul", "linear", "mm_t", "baddbmm"])
def test_bf16_gemms_run_as_fp32_gemms_rounded_once(call):
    """Under the shims a bf16 GEMM is the fp32 GEMM of the same bf16 values rounded to bf16 once
    (bit for bit: the oracle computes exactly that outside the mode), with autograd intact; the
    CPU's native bf16 kernel agrees to a bf16 rounding (at these shapes it differs from the oracle
    in a few elements: the check can fail). Other dtypes are left alone."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 64, 1536, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(1536, 576, generator=gen).bfloat16()
    bias = torch.randn(2, 64, 576, generator=gen).bfloat16()
    ops = {"matmul": lambda x, y, b: torch.matmul(x, y),
           "linear": lambda x, y, b: torch.nn.functional.linear(x, y.t()),
           "mm_t": lambda x, y, b: x[0].mm(y),
           "baddbmm": lambda x, y, b: torch.baddbmm(b, x, y.expand(2, 1536, 576), beta=0.5, alpha=0.25)}
    op = ops[call]
    native = op(a, w, bias)
    oracle = op(a.detach().float(), w.float(), bias.float()).bfloat16()
    enabled_before = megatron_cpu._mode is not None  # (a module fixture's shims stay on)
    assert megatron_cpu.enable()
    try:
        emulated = op(a, w, bias)
        emulated.float().sum().backward()
        same_fp32 = op(a.detach().float(), w.float(), bias.float())
    finally:
        if not enabled_before:
            megatron_cpu.disable()
    assert emulated.dtype == torch.bfloat16 and torch.equal(emulated, oracle)
    torch.testing.assert_close(emulated.float(), native.float(), rtol=2 ** -6, atol=1e-2)
    assert a.grad is not None and a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()
    assert same_fp32.dtype == torch.float32  # fp32 GEMMs untouched


def test_megatron_linear_backward_runs_its_bf16_gemms_in_fp32(megatron_tp1):
    """The shims' mode does not reach inside torch.autograd.backward; Megatron's linear Function
    runs its own dgrad/wgrad under the bf16 GEMM rule: both gradients are bit-identical to fp32
    GEMMs of the bf16 values rounded once (shapes where the native bf16 kernel differs)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, 576, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(1536, 576, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(64, 1, 1536, generator=gen).bfloat16()
    y = linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
        tp_group=parallel_state.get_tensor_model_parallel_group())
    torch.autograd.backward(y, dy)
    dy2, x2 = dy.reshape(64, 1536).float(), x.detach().reshape(64, 576).float()
    assert torch.equal(x.grad.reshape(64, 576), (dy2 @ w.detach().float()).bfloat16())
    assert torch.equal(w.grad, (dy2.t() @ x2).bfloat16())
    with torch._C.DisableTorchFunction():  # the native bf16 kernel, outside the shims' mode
        native = dy.reshape(64, 1536) @ w.detach()
    assert not torch.equal(native, (dy2 @ w.detach().float()).bfloat16())  # the check can fail
