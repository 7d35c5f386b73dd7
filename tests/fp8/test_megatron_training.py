"""A tiny Megatron-Core GPTModel whose local-spec linears are our FP8 linear trains on CPU like
its FP32 twin, logs per-layer FP8 statistics, and keeps its FP8 scales through checkpoints.
Single process (a one-rank gloo group from launch.init_distributed)."""
import copy

import pytest
import torch

from megatron_fp8rl.compat import megatron_cpu
from megatron_fp8rl.launch import init_distributed, shutdown_distributed

VOCAB, SEQ, BATCH = 128, 32, 8
LOSS_TOLERANCE = 0.05
"""Max |loss_fp8 - loss_fp32| per step, in nats (measured: <= 0.005 for every recipe)."""
GRAD_TOLERANCE = 0.15
"""Max relative L2 error of any parameter's first-step gradient against FP32 (measured: 0.10,
the E5M2 rounding of the output gradients; a gradient off by 2x gives >= 0.5)."""


@pytest.fixture
def megatron_tp1():
    """Megatron's global parallel state for one process; torn down after the test."""
    layout = init_distributed(tensor_parallel=1, seed=5)
    yield layout
    shutdown_distributed()
    megatron_cpu.disable()


def build_gpt(spec, dtype=torch.float32):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
                               bf16=dtype == torch.bfloat16)
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def twin_models(recipe=None):
    """An FP32 GPT on the local spec and an FP8 one with the same initial weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_fp8rl.models.megatron_fp8_linear import fp8_local_layer_spec

    reference = build_gpt(get_gpt_layer_local_spec())
    fp8_model = build_gpt(fp8_local_layer_spec(recipe))
    fp8_model.load_state_dict(reference.state_dict())  # FP32 extra state is None: kept fresh
    return reference, fp8_model


def next_token_batch(step: int):
    """Sequences that follow a fixed random permutation of the vocabulary: a learnable task."""
    permutation = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    for t in range(SEQ):
        tokens[:, t + 1] = permutation[tokens[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def train(model, steps: int, lr: float = 3e-3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    losses = []
    for step in range(steps):
        tokens, labels = next_token_batch(step)
        loss = model(tokens, positions, None, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fp8_scales(model) -> dict[str, torch.Tensor]:
    from megatron_fp8rl.models.megatron_fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    return {f"{name}.{role}": getattr(module.fp8_quantizers, role).state.scale.clone()
            for name, module in model.named_modules()
            if isinstance(module, (Fp8ColumnParallelLinear, Fp8RowParallelLinear))
            for role in ("input", "weight", "grad_output")}


def test_fp8_spec_swaps_every_local_linear_but_the_output_layer(megatron_tp1):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_fp8rl.models.megatron_fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    _, model = twin_models()
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, Fp8ColumnParallelLinear)
    assert isinstance(layer.self_attention.linear_proj, Fp8RowParallelLinear)
    assert isinstance(layer.mlp.linear_fc1, Fp8ColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, Fp8RowParallelLinear)
    assert type(model.output_layer) is ColumnParallelLinear
    assert len(fp8_scales(model)) == 2 * 4 * 3


def test_tiny_gpt_trains_in_fp8_like_fp32(megatron_tp1):
    from megatron_fp8rl.models.megatron_fp8_linear import fp8_layer_stats

    reference, fp8_model = twin_models()
    fp32_losses = train(reference, steps=30)
    fp8_losses = train(fp8_model, steps=30)
    assert fp32_losses[-1] < 0.4 * fp32_losses[0]
    assert fp8_losses[-1] < 0.4 * fp8_losses[0]
    gaps = [abs(a - b) for a, b in zip(fp8_losses, fp32_losses)]
    assert max(gaps) <= LOSS_TOLERANCE, gaps
    assert max(gaps) > 0, "identical losses: the FP8 path did not run"
    stats = fp8_layer_stats(fp8_model)
    assert len(stats) == 2 * 4 * 3
    qkv_grad = stats["decoder.layers.0.self_attention.linear_qkv.grad_output"]
    assert qkv_grad["bound"] > 0 and qkv_grad["nonfinite_count"] == 0
    assert all(0 <= s["saturated_fraction"] <= 1 and 0 <= s["underflow_fraction"] <= 1
               for s in stats.values())


def test_fp8_gradients_match_fp32_gradients(megatron_tp1):
    """Adam hides a gradient's scale from the loss curve, so compare first-step gradients."""
    reference, fp8_model = twin_models()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    tokens, labels = next_token_batch(0)
    for model in (reference, fp8_model):
        model(tokens, positions, None, labels=labels).mean().backward()
    fp8_params = dict(fp8_model.named_parameters())
    errors = {name: ((fp8_params[name].grad - p.grad).norm() / p.grad.norm()).item()
              for name, p in reference.named_parameters()}
    assert max(errors.values()) <= GRAD_TOLERANCE, errors


def test_fp8_scales_survive_state_dict_and_dist_checkpoint(megatron_tp1, tmp_path):
    from megatron.core import dist_checkpointing

    _, model = twin_models()
    train(model, steps=3)
    scales = fp8_scales(model)
    assert all(torch.isfinite(s) for s in scales.values())
    assert any(s.item() != 1.0 for s in scales.values())

    _, plain = twin_models()
    plain.load_state_dict(model.state_dict())
    assert all(torch.equal(scales[k], v) for k, v in fp8_scales(plain).items())

    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    _, restored = twin_models()
    restored.load_state_dict(dist_checkpointing.load(restored.sharded_state_dict(), str(tmp_path)))
    restored_scales = fp8_scales(restored)
    assert restored_scales.keys() == scales.keys()
    assert all(torch.equal(scales[k], v) for k, v in restored_scales.items())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_high_precision_shadow_is_the_fp32_twin_and_touches_no_fp8_state(megatron_tp1):
    """Calibrated Clipping's shadow: under high_precision_fp8_linears the FP8 model computes its
    FP32 twin's logits bit for bit, and no quantizer's amax history, scale or statistics move."""
    from megatron_fp8rl.models.megatron_fp8_linear import high_precision_fp8_linears

    fp32, fp8 = twin_models()
    tokens, _ = next_token_batch(0)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        fp8(tokens, positions, None)  # the FP8 state now holds a bound
        state = copy.deepcopy(fp8.state_dict())
        stats = {n: m.fp8_quantizers.stats() for n, m in fp8.named_modules() if hasattr(m, "fp8_quantizers")}
        with high_precision_fp8_linears(fp8):
            shadow = fp8(tokens, positions, None)
        after = fp8.state_dict()
        assert any(key.endswith("_extra_state") for key in after)
        for key, value in state.items():  # weights and _extra_state (amax histories, scales)
            assert _same(value, after[key]), key
        assert torch.equal(shadow, fp32(tokens, positions, None))
        assert not torch.equal(fp8(tokens, positions, None), shadow)  # outside it: FP8 again
    with pytest.raises(ValueError, match="has no FP8 linear layers"):
        with high_precision_fp8_linears(fp32):
            pass
    assert all(stats[n] is not None for n in stats)


def test_fp8_linears_train_under_bf16_mixed_precision(megatron_tp1):
    """Megatron bf16 (Float16Module, fp32 master weights; trainer.megatron_step) with our FP8
    linears: the FP8 GEMMs see bf16 inputs, return bf16, keep fp32 scales, and the FP8 model
    trains like its bf16 twin."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_fp8rl.models.megatron_fp8_linear import fp8_local_layer_spec
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    losses, models = {}, {}
    for name, spec in (("bf16", get_gpt_layer_local_spec()), ("fp8", fp8_local_layer_spec())):
        model = wrap_ddp(build_gpt(spec, torch.bfloat16), distributed_optimizer=True)
        optimizer = build_optimizer(model, OptimConfig(lr=3e-3, distributed_optimizer=True))
        losses[name], models[name] = [], model
        for step in range(30):
            tokens, labels = next_token_batch(step)
            batch = {"tokens": tokens, "labels": labels, "position_ids": positions}
            result = train_step(model, optimizer, [batch],
                                lambda chunk, b: chunk(b["tokens"], b["position_ids"], None, labels=b["labels"]),
                                lambda b, out: (out.mean(), {"loss": out.mean()}), SEQ, BATCH)
            losses[name].append(result.metrics["loss"])
    from megatron.core.transformer.module import Float16Module

    assert isinstance(models["fp8"].module, Float16Module)
    layer = models["fp8"].module.module.decoder.layers[0]
    assert layer.mlp.linear_fc1.weight.dtype == torch.bfloat16
    assert layer.mlp.linear_fc1.fp8_quantizers.input.state.scale.dtype == torch.float32
    hidden = torch.randn(SEQ, BATCH, 64, dtype=torch.bfloat16)
    assert layer.mlp.linear_fc1(hidden)[0].dtype == torch.bfloat16
    assert losses["fp8"][-1] < 0.4 * losses["fp8"][0]
    gaps = [abs(a - b) for a, b in zip(losses["fp8"], losses["bf16"])]
    assert 0 < max(gaps) <= LOSS_TOLERANCE, gaps
