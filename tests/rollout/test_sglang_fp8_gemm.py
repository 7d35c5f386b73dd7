"""SGLang's `fp8rl` linear method and the trainer's FP8 linear share one GEMM function: with the
'triton_invariant' GEMM (Triton's interpreter on CPU), the plugin's `apply` on a fused layer loaded
as SGLang loads it gives the same bits as the trainer's frozen-scale `fp8_linear` on the same
inputs, whether the plugin sees the whole sequence, a prefill chunk or one decode row at a time,
and with the trainer's fused rows in another order (Megatron interleaves q/k/v by query group).

In process, no engine: SGLang's modules are imported (after the CPU stand-ins) and the method's
own create_weights / weight loaders / process_weights_after_loading build the layer.
"""
import pytest
import torch

from megatron_fp8rl.compat import sglang_cpu
from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.linear import fp8_linear
from megatron_fp8rl.fp8.quantize import WEIGHT_BLOCK, quantize_blockwise, quantize_with_scale_inv
from megatron_fp8rl.fp8.quantizer import frozen_quantizers, make_quantizers
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CalibratedDelayedScaling, groupwise, groupwise32
from megatron_fp8rl.models.families.llama import FAMILY as LLAMA
from tests.helpers.rollout import needs_sglang

pytestmark = [needs_sglang, pytest.mark.triton]

SHARDS = {"q": 128, "k": 64, "v": 64}
K, TOKENS, PROMPT = 192, 9, 5
PREFIX = "model.layers.0.self_attn.qkv_proj"
GATE_UP = "model.layers.0.mlp.gate_up_proj"


@pytest.fixture(scope="module")
def plugin():
    """rollout/sglang_fp8.py, imported with SGLang's CPU stand-ins (module scope: before the
    `triton` marker's TRITON_INTERPRET, so SGLang's own kernels are not wrapped for it)."""
    sglang_cpu.install()
    from megatron_fp8rl.rollout import sglang_fp8

    return sglang_fp8


def _inputs(seed=0, k=K, n=sum(SHARDS.values())):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, TOKENS, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05,
            torch.randn(n, generator=gen))


def _served(plugin, config, shard_weights: dict, shard_scales: dict, input_scale=None, prefix=PREFIX):
    """A fused layer built and loaded through the method's own parameters and loaders."""
    method = plugin.Fp8RLLinearMethod(config, prefix)
    layer = torch.nn.Module()
    widths = [w.shape[0] for w in shard_weights.values()]
    k = next(iter(shard_weights.values())).shape[1]
    method.create_weights(layer, k, widths, k, sum(widths), torch.float32)
    layer.weight.data.copy_(torch.cat(list(shard_weights.values())))
    scale = layer.weight_scale_inv if config.block else layer.weight_scale
    for shard, value in shard_scales.items():
        scale.weight_loader(scale, value, shard)
        if input_scale is not None:
            layer.input_scale.weight_loader(layer.input_scale, input_scale, shard)
    method.process_weights_after_loading(layer)
    return method, layer


def _plugin_calls(method, layer, x, bias) -> torch.Tensor:
    """The rows of x as SGLang's forward passes see them: a prefill chunk, then one decode row
    per step (each its own call)."""
    rows = [method.apply(layer, x[0, :PROMPT], bias)]
    rows += [method.apply(layer, x[0, t:t + 1], bias) for t in range(PROMPT, TOKENS)]
    return torch.cat(rows)


def test_aligned_per_tensor_plugin_equals_trainer_bit_for_bit(plugin):
    x, weight, bias = _inputs()
    weight_scale_inv, input_scale_inv = weight.abs().max() / 448, x.abs().max() / 400
    # the trainer holds the fused weight in another row order (Megatron's q/k/v interleaving)
    order = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(3))
    quantizers = frozen_quantizers(make_quantizers(CalibratedDelayedScaling()), weight_scale_inv, input_scale_inv)
    trainer = fp8_linear(x, weight[order], bias[order], quantizers, "triton_invariant")[0]
    trainer = trainer[:, torch.argsort(order)]
    served = quantize_with_scale_inv(weight, weight_scale_inv, E4M3).data
    shards = dict(zip(SHARDS, torch.split(served, list(SHARDS.values()))))
    config = plugin.Fp8RLConfig(LLAMA, None, "static", [], gemm="triton_invariant")
    method, layer = _served(plugin, config, shards, {s: weight_scale_inv for s in SHARDS}, input_scale_inv)
    assert torch.equal(method.apply(layer, x, bias)[0], trainer)  # the whole sequence at once
    assert torch.equal(_plugin_calls(method, layer, x, bias), trainer)


def test_block_scaled_plugin_equals_trainer_bit_for_bit(plugin):
    x, weight, bias = _inputs(1, k=256, n=256)
    trainer = fp8_linear(x, weight, bias, make_quantizers(BlockwiseScaling()), "triton_invariant")[0]
    halves = torch.split(weight, 128)
    shards = {i: quantize_blockwise(h, E4M3, WEIGHT_BLOCK) for i, h in enumerate(halves)}
    config = plugin.Fp8RLConfig(LLAMA, list(WEIGHT_BLOCK), "dynamic", [], gemm="triton_invariant")
    method, layer = _served(plugin, config, {i: q.data for i, q in shards.items()},
                            {i: q.scale_inv for i, q in shards.items()}, prefix=GATE_UP)
    assert torch.equal(_plugin_calls(method, layer, x, bias), trainer)


@pytest.mark.parametrize("gemm", ["batch_invariant", "triton_invariant", "exact"])
def test_block_shards_off_the_fused_grid_run_one_fp8_gemm_each(plugin, gemm):
    """128x128 blocks over q/k/v shards of 192/64/64 rows (SmolLM2's 576/192/192: the fused
    weight's 128-row grid is not the shards'): each shard's columns are the trainer's `fp8_linear`
    on that shard, bit for bit, in the whole-sequence call and in every decode call. (Before, such
    a layer ran one fp32 matmul of dequantized values, whatever GEMM was configured.)"""
    widths = {"q": 192, "k": 64, "v": 64}
    x, weight, bias = _inputs(8, k=256, n=sum(widths.values()))
    shard_weights, shard_bias = torch.split(weight, list(widths.values())), torch.split(bias, list(widths.values()))
    trainer = torch.cat([fp8_linear(x, w, b, make_quantizers(BlockwiseScaling()), gemm)[0]
                         for w, b in zip(shard_weights, shard_bias)], dim=-1)
    served = {name: quantize_blockwise(w, E4M3, WEIGHT_BLOCK) for name, w in zip(widths, shard_weights)}
    config = plugin.Fp8RLConfig(LLAMA, list(WEIGHT_BLOCK), "dynamic", [], gemm=gemm)
    method, layer = _served(plugin, config, {n: q.data for n, q in served.items()},
                            {n: q.scale_inv for n, q in served.items()})
    assert len(layer.fp8rl_pieces) == 3
    assert torch.equal(method.apply(layer, x, bias)[0], trainer)
    assert torch.equal(_plugin_calls(method, layer, x, bias), trainer)


@pytest.mark.parametrize("gemm,k,group", [("batch_invariant", 320, 128), ("triton_invariant", 256, 128),
                                          ("batch_invariant", 336, 32)])
def test_groupwise_plugin_equals_trainer_bit_for_bit(plugin, gemm, k, group):
    """The groupwise recipes' aligned layout: 1x128 (groupwise) or 1x32 (groupwise32) weight
    groups served per HF shard (q/k/v of widths that do not tile 128 rows), the trainer's fused
    weight in Megatron's interleaved row order; 'batch_invariant' is 'exact' here (K = 320, 336: a
    partial last group). The served checkpoint's [1, group] weight blocks alone tell the plugin
    the activation groups."""
    x, weight, bias = _inputs(2, k=k)
    order = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(4))
    recipe = groupwise() if group == 128 else groupwise32()
    trainer = fp8_linear(x, weight[order], bias[order], make_quantizers(recipe), gemm)[0]
    trainer = trainer[:, torch.argsort(order)]
    shards = {name: quantize_blockwise(w, E4M3, (1, group))
              for name, w in zip(SHARDS, torch.split(weight, list(SHARDS.values())))}
    config = plugin.Fp8RLConfig(LLAMA, [1, group], "dynamic", [], gemm=gemm)
    assert config.weight_block_size is None  # SGLang's CPU padding asserts square blocks
    method, layer = _served(plugin, config, {n: q.data for n, q in shards.items()},
                            {n: q.scale_inv for n, q in shards.items()})
    assert torch.equal(method.apply(layer, x, bias)[0], trainer)
    assert torch.equal(_plugin_calls(method, layer, x, bias), trainer)


def _load(method, layer, shard_weights: dict, shard_scales: dict) -> None:
    """A weight update as SGLang runs one: new FP8 data and scales through the loaders, then
    process_weights_after_loading again (end_weight_update)."""
    layer.weight.data.copy_(torch.cat(list(shard_weights.values())))
    scale = layer.weight_scale_inv if method.block else layer.weight_scale
    for shard, value in shard_scales.items():
        scale.weight_loader(scale, value, shard)
    method.process_weights_after_loading(layer)


def _trainer_and_served(layout: str, x, weight, bias):
    """(the trainer's 'batch_invariant' output, the FP8 shards, their scales, the input scale)."""
    widths = list(SHARDS.values())
    if layout == "groupwise":
        trainer = fp8_linear(x, weight, bias, make_quantizers(groupwise()), "batch_invariant")[0]
        served = dict(zip(SHARDS, (quantize_blockwise(w, E4M3, (1, 128)) for w in torch.split(weight, widths))))
        return trainer, {n: q.data for n, q in served.items()}, {n: q.scale_inv for n, q in served.items()}, None
    weight_scale_inv, input_scale_inv = weight.abs().max() / 448, x.abs().max() / 400
    quantizers = frozen_quantizers(make_quantizers(CalibratedDelayedScaling()), weight_scale_inv, input_scale_inv)
    trainer = fp8_linear(x, weight, bias, quantizers, "batch_invariant")[0]
    data = torch.split(quantize_with_scale_inv(weight, weight_scale_inv, E4M3).data, widths)
    return trainer, dict(zip(SHARDS, data)), dict.fromkeys(SHARDS, weight_scale_inv), input_scale_inv


@pytest.mark.parametrize("layout", ["groupwise", "per_tensor"])
def test_exact_plugin_follows_weight_updates_bit_for_bit(plugin, layout):
    """'exact' reads an fp32 copy of the weight codes the method derives after each load: after a
    weight update the plugin still equals the trainer on the new weights, decode rows included."""
    x, _, bias = _inputs(5, k=320)
    block, activations = ([1, 128], "dynamic") if layout == "groupwise" else (None, "static")
    config = plugin.Fp8RLConfig(LLAMA, block, activations, [], gemm="batch_invariant")
    trainer, shards, scales, input_scale = _trainer_and_served(layout, x, _inputs(6, k=320)[1], bias)
    method, layer = _served(plugin, config, shards, scales, input_scale)
    assert torch.equal(_plugin_calls(method, layer, x, bias), trainer)
    trainer, shards, scales, _ = _trainer_and_served(layout, x, _inputs(7, k=320)[1], bias)
    _load(method, layer, shards, scales)
    assert torch.equal(_plugin_calls(method, layer, x, bias), trainer)


def test_explicit_triton_gemm_refuses_per_token_activations(plugin):
    x, weight, bias = _inputs()
    scale = weight.abs().max() / 448
    shards = dict(zip(SHARDS, torch.split(quantize_with_scale_inv(weight, scale, E4M3).data, list(SHARDS.values()))))
    config = plugin.Fp8RLConfig(LLAMA, None, "dynamic", [], gemm="triton_invariant")
    method, layer = _served(plugin, config, shards, {s: scale for s in SHARDS})
    with pytest.raises(ValueError, match=r"triton_invariant FP8 GEMM: operands row None x tensor None"):
        method.apply(layer, x, bias)


def test_unknown_gemm_is_refused_at_config_time(plugin):
    with pytest.raises(ValueError, match="unknown FP8 gemm 'cublas'"):
        plugin.Fp8RLConfig(LLAMA, None, "static", [], gemm="cublas")


def test_shards_and_shard_ids_must_be_the_familys(plugin):
    """SGLang's fused layer must have as many shards as the family's linear has HF parts, and load
    scales only under the family's shard ids."""
    config = plugin.Fp8RLConfig(LLAMA, None, "static", [])
    with pytest.raises(ValueError, match=r"qkv_proj: SGLang fuses 2 shards, the llama family's "
                                         r"self_attention.linear_qkv has 3: self_attn.q_proj"):
        _served(plugin, config, {0: torch.zeros(8, 4), 1: torch.zeros(8, 4)}, {})
    weights = {s: torch.zeros(w, 4, dtype=E4M3.dtype) for s, w in SHARDS.items()}
    with pytest.raises(ValueError, match=r"qkv_proj: unknown shard 0 of a layer with shards \('q', 'k', 'v'\)"):
        _served(plugin, config, weights, {0: torch.tensor(1.0)})


def test_the_plugin_refuses_an_untested_version_before_patching(plugin, monkeypatch):
    """register() runs in every SGLang process, where no entry point ran the version gate: it runs
    it (compat/versions.py) and stops with one line, nothing patched, unless the override names
    that exact version."""
    from sglang.srt.layers import quantization

    from megatron_fp8rl.compat import versions

    real = versions.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "9.9.9" if name == "sglang" else real(name))
    monkeypatch.setattr(versions, "_allowed", versions._allowed)  # restored after the test
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    before = dict(quantization.QUANTIZATION_METHODS)
    with pytest.raises(SystemExit, match="megatron_fp8rl SGLang plugin: sglang 9.9.9 is installed"):
        plugin.register()
    monkeypatch.setenv(versions.ALLOW_ENV, "sglang==9.9.8")  # another exact version: still refused
    with pytest.raises(SystemExit, match="sglang 9.9.9 is installed"):
        plugin.register()
    assert quantization.QUANTIZATION_METHODS == before
    assert versions.gate({versions.ALLOW_ENV: "sglang==9.9.9"})["sglang"] == "9.9.9"
