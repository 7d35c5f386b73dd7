"""Megatron's torch Adam on the CPU tier steps with torch's fused kernel: the same update as
torch's default per-tensor loop up to rounding (before: the per-tensor loop, ~5x slower over
SmolLM2-135M). One process (gloo)."""
import torch

from megatron_fp8rl.compat.megatron_optim import fuse_torch_adam


def _model_and_optimizer(fused: bool):
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, wrap_ddp

    torch.manual_seed(0)
    model = wrap_ddp(build_gpt_model(tiny_transformer_config(), vocab_size=32, max_sequence_length=8), True)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, clip_grad=0.0))
    if not fused:
        for part in optimizer.chained_optimizers:
            for group in part.optimizer.param_groups:
                group.update(fused=False, foreach=False)
    return model, optimizer


def _steps(model, optimizer, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for param in model.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        optimizer.step()
    return [param.detach().clone() for param in model.parameters()]


def test_megatron_adam_is_fused_and_updates_as_the_per_tensor_loop(megatron_tp1):
    fused_model, fused = _model_and_optimizer(fused=True)
    assert all(group["fused"] for part in fused.chained_optimizers for group in part.optimizer.param_groups)
    reference_model, reference = _model_and_optimizer(fused=False)
    start = [param.detach().clone() for param in fused_model.parameters()]
    ours, theirs = _steps(fused_model, fused, 3), _steps(reference_model, reference, 3)
    assert any(not torch.equal(a, b) for a, b in zip(ours, start))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fuse_torch_adam(fused) == len(fused.chained_optimizers)
