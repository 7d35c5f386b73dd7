"""HF config -> Megatron TransformerConfig: the fields each family maps, the settings it refuses,
TP/PP layout checks, and the llama3 rope frequencies against transformers' own function."""
import pytest
import torch

from megatron_fp8rl.models.family import UnsupportedModelError
from megatron_fp8rl.models.hf import check_parallel_layout, transformer_config_from_hf
from megatron_fp8rl.models.registry import family_for, supported_architectures
from megatron_fp8rl.models.rope import llama3_inv_freq, rope_settings
from tests.helpers.tiny_hf import tiny_hf_config


@pytest.mark.parametrize("arch, qkv_bias, qk_norm, kv_channels", [
    ("llama", False, False, 16), ("qwen2", True, False, 16), ("qwen3", False, True, 32)])
def test_family_fields(arch, qkv_bias, qk_norm, kv_channels):
    hf = tiny_hf_config(arch)
    config = transformer_config_from_hf(hf)
    assert (config.add_qkv_bias, config.qk_layernorm, config.kv_channels) == (qkv_bias, qk_norm, kv_channels)
    assert (config.num_attention_heads, config.num_query_groups) == (4, 2)
    assert config.layernorm_epsilon == 1e-5 and config.normalization == "RMSNorm"
    assert config.gated_linear_unit and not config.add_bias_linear
    assert family_for(hf.to_dict()).name == arch


def test_rope_theta_old_and_new_spellings():
    assert rope_settings({"rope_theta": 5e5}).theta == 5e5
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).theta == 1e6
    llama = rope_settings(tiny_hf_config("llama").to_dict())
    assert llama.theta == 500000.0 and llama.llama3.original_max_position_embeddings == 64


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_hf_config("llama")
    hf.head_dim = 64  # 32 frequencies spanning the low, medium and high bands
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    got = llama3_inv_freq(base, rope_settings(hf.to_dict()).llama3)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(got, base)  # the scaling did something


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedModelError) as err:
        family_for({"architectures": ["MistralForCausalLM"]})
    for name in supported_architectures():
        assert name in str(err.value)
    assert "MistralForCausalLM" in str(err.value)


@pytest.mark.parametrize("arch, field, value, match", [
    ("llama", "attention_bias", True, "attention_bias"),
    ("llama", "mlp_bias", True, "mlp_bias"),
    ("qwen2", "use_sliding_window", True, "use_sliding_window"),
    ("qwen3", "hidden_act", "gelu", "hidden_act"),
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
])
def test_unsupported_settings_are_refused(arch, field, value, match):
    hf = tiny_hf_config(arch).to_dict()
    hf[field] = value
    if field == "rope_scaling":
        hf.pop("rope_parameters", None)
    with pytest.raises(UnsupportedModelError, match=match):
        transformer_config_from_hf(hf)


def test_parallel_layout_names_the_field():
    hf = tiny_hf_config("qwen3").to_dict()
    check_parallel_layout(hf, 2, 2)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=2"):
        check_parallel_layout(hf, 4, 1)
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers=2"):
        check_parallel_layout(hf, 1, 3)
