"""train.norm_lr_mult: the normalization gains step at lr x mult through Megatron's param-group
overrides, every other parameter at lr, in float32 and in bf16 mixed precision (where the fp32
master gains step and the bf16 copy follows). One process (gloo)."""
import pytest
import torch

from megatron_fp8rl.trainer.megatron_step import OptimConfig, _is_norm, build_optimizer, wrap_ddp

LR = 1e-2


def _step_once(mult: float, dtype: torch.dtype, distributed: bool):
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config

    torch.manual_seed(0)
    config = tiny_transformer_config(params_dtype=dtype)
    model = wrap_ddp(build_gpt_model(config, vocab_size=32, max_sequence_length=8), distributed)
    optimizer = build_optimizer(model, OptimConfig(lr=LR, clip_grad=0.0, norm_lr_mult=mult,
                                                   distributed_optimizer=distributed))
    named = dict(model.named_parameters())
    start = {name: param.detach().float().clone() for name, param in named.items()}
    model.zero_grad_buffer()
    optimizer.zero_grad()
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        # |g| >> Adam's eps: the first Adam step moves every element by lr (x mult) exactly.
        param.main_grad.copy_(torch.randn(param.shape, generator=generator).sign())
    optimizer.step()
    return {name: (named[name].detach().float() - start[name]).abs() for name in named}


@pytest.mark.parametrize("distributed", [True, False])
@pytest.mark.parametrize("mult", [0.0, 0.5])
def test_norm_gains_step_at_lr_times_mult_in_float32(megatron_tp1, mult, distributed):
    moved = _step_once(mult, torch.float32, distributed)
    norms = [name for name in moved if _is_norm(name)]
    # Local spec names: input_layernorm, pre_mlp_layernorm per layer, and the final norm.
    assert any("final_layernorm" in name for name in norms) and len(norms) == 2 * 2 + 1
    for name, delta in moved.items():
        expected = LR * mult if name in norms else LR
        torch.testing.assert_close(delta, torch.full_like(delta, expected), rtol=1e-3, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bf16_master_gains_frozen_and_linears_move(megatron_tp1):
    moved = _step_once(0.0, torch.bfloat16, True)
    for name, delta in moved.items():
        if _is_norm(name):
            assert torch.count_nonzero(delta) == 0, name
        else:
            # lr 1e-2 on weights of size ~0.02-1: the bf16 copy moves for most elements.
            assert (delta > 0).float().mean() > 0.5, name


def test_default_steps_every_group_at_lr(megatron_tp1):
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config

    model = wrap_ddp(build_gpt_model(tiny_transformer_config(), vocab_size=32, max_sequence_length=8), True)
    optimizer = build_optimizer(model, OptimConfig(lr=LR))
    groups = [group for part in optimizer.chained_optimizers for group in part.optimizer.param_groups]
    assert groups and all(group["lr"] == LR for group in groups)


def test_a_model_without_norms_is_refused(megatron_tp1):
    from megatron.core.transformer.module import MegatronModule
    from megatron_fp8rl.models.gpt import tiny_transformer_config

    class NoNorms(MegatronModule):
        def __init__(self):
            super().__init__(tiny_transformer_config())
            self.linear = torch.nn.Linear(4, 4)

    model = wrap_ddp(NoNorms(), True)
    with pytest.raises(ValueError, match="norm_lr_mult: 0.0 set, but no parameter of the model is a normalization gain"):
        build_optimizer(model, OptimConfig(norm_lr_mult=0.0))
    build_optimizer(model, OptimConfig())  # the default needs no norms


def test_negative_mult_is_refused():
    with pytest.raises(ValueError, match="norm_lr_mult: must be a finite number >= 0, got -1"):
        OptimConfig(norm_lr_mult=-1.0)
