"""The Qwen3 (dense) family: the Llama layout plus a per-head RMSNorm on queries and keys.

Owns: the Qwen3 `ModelFamily`. Must not import: anything but the standard library and the
family files (models/family.py, families/llama.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from megatron_fp8rl.models.families import llama
from megatron_fp8rl.models.family import HF_LAYER, ModelFamily, Rule, reject


def _check(hf_config: Mapping[str, Any]) -> None:
    reject(hf_config, "use_sliding_window", False, "qwen3")
    reject(hf_config, "attention_bias", False, "qwen3")


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    qkv_bias=lambda hf_config: False,
    qk_layernorm=True,
    check=_check,
    linears=llama.LINEARS,
    tensors=llama.TENSORS + (
        Rule("decoder.layers.self_attention.q_layernorm.weight", (HF_LAYER + "self_attn.q_norm.weight",)),
        Rule("decoder.layers.self_attention.k_layernorm.weight", (HF_LAYER + "self_attn.k_norm.weight",)),
    ),
)
