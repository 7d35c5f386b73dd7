"""The high-precision shadow of a bf16 Megatron model (models/shadow.py): its forward is the
float32 twin's bit for bit, and nothing of the model changes."""
import pytest
import torch

VOCAB, SEQ, BATCH = 96, 12, 3


def _model(dtype, spec=None):
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
    from megatron_fp8rl.models.hf import layer_spec

    torch.manual_seed(0)
    return build_gpt_model(tiny_transformer_config(params_dtype=dtype), VOCAB, SEQ,
                           layer_spec=spec or layer_spec(qk_layernorm=False))


def _logits(model, tokens):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        return model(tokens, positions, None)


def test_bf16_shadow_is_the_float32_twin_and_restores_the_weights(megatron_tp1):
    from megatron_fp8rl.models.shadow import high_precision_shadow
    from megatron_fp8rl.trainer.megatron_step import wrap_ddp

    trained = wrap_ddp(_model(torch.bfloat16), distributed_optimizer=True)  # Float16Module + DDP, as the trainer
    twin = _model(torch.float32)
    bf16_weights = trained.module.module.state_dict()
    twin.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in bf16_weights.items()})
    before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in trained.parameters()]
    assert all(dtype == torch.bfloat16 for _, dtype, _ in before)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with high_precision_shadow(trained):
        shadow = _logits(trained, tokens)
    assert torch.equal(shadow, _logits(twin, tokens))
    plain = _logits(trained, tokens)
    assert (plain.float() - shadow).abs().max() > 1e-3  # the shadow is not the bf16 forward
    for param, (pointer, dtype, bits) in zip(trained.parameters(), before):
        assert param.data_ptr() == pointer and param.dtype == dtype and torch.equal(param.detach(), bits)


def test_a_bf16_model_still_trains_after_its_shadow_ran(megatron_tp1):
    """After the shadow, a backward still reaches Megatron DDP's fp32 grad buffers (main_grad).
    Before the fix the shadow set each parameter's .data to float32 and back, which resets its
    gradient accumulator: DDP's hooks never fired again, every main_grad stayed 0 and a bf16
    trainer with calibration.mode=monitor/shadow logged grad_norm 0 and never moved."""
    from megatron_fp8rl.models.shadow import high_precision_shadow
    from megatron_fp8rl.trainer.megatron_step import wrap_ddp

    trained = wrap_ddp(_model(torch.bfloat16), distributed_optimizer=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with high_precision_shadow(trained):
        _logits(trained, tokens)
    trained.zero_grad_buffer()
    trained(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None).float().square().mean().backward()
    reached = [p.main_grad.abs().sum().item() > 0 for p in trained.parameters()]
    assert all(reached), f"{reached.count(False)} of {len(reached)} parameters' main_grad stayed 0"
    assert all(p.grad is None for p in trained.parameters())  # DDP's hook moved every grad into main_grad


def test_shadow_refuses_a_model_with_nothing_higher_to_compare(megatron_tp1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_fp8rl.models.shadow import high_precision_shadow

    with pytest.raises(ValueError, match="neither FP8 linears nor bf16/fp16 weights"):
        with high_precision_shadow(_model(torch.float32)):
            pass
    megatron_attention = _model(torch.bfloat16, get_gpt_layer_local_spec(normalization="RMSNorm"))
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.core_attention is Megatron.s DotProductAttention"):
        with high_precision_shadow(megatron_attention):
            pass
