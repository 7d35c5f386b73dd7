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
