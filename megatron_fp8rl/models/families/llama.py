"""The Llama 2/3.x family (also SmolLM2): RMSNorm, SwiGLU, RoPE (llama3 scaling), GQA, no biases.

Owns: the Llama `ModelFamily`, and the decoder linears and checkpoint tensors Qwen2 and Qwen3
share with it. Must not import: anything but the standard library and models/family.py.
"""
from __future__ import annotations

from typing import Any, Mapping

from megatron_fp8rl.models.family import (
    HF_LAYER,
    DecoderLinear,
    ModelFamily,
    Rule,
    UnsupportedModelError,
    reject,
)

QKV = DecoderLinear("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "qkv", "self_attn.qkv_proj", ("q", "k", "v"))
LINEARS = (
    QKV,
    DecoderLinear("self_attention.linear_proj", ("self_attn.o_proj",), "copy", "self_attn.o_proj"),
    DecoderLinear("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"), "gate_up", "mlp.gate_up_proj", (0, 1)),
    DecoderLinear("mlp.linear_fc2", ("mlp.down_proj",), "copy", "mlp.down_proj"),
)
"""Megatron fuses q/k/v and gate/up as SGLang does; the local spec's separate norms are stored
under TE's fused names below, so one table serves both specs."""
TENSORS = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (HF_LAYER + "input_layernorm.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", (HF_LAYER + "post_attention_layernorm.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",)),
)


def _check(hf_config: Mapping[str, Any]) -> None:
    # Megatron has a q/k/v-only bias (add_qkv_bias) but no way to bias o_proj alone; Llama's
    # attention_bias biases all four projections, so it cannot be represented.
    if hf_config.get("attention_bias"):
        raise UnsupportedModelError(
            "llama: attention_bias=True (q/k/v/o biases) is not supported; Megatron can bias "
            "q/k/v only"
        )
    reject(hf_config, "mlp_bias", False, "llama")


FAMILY = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    qkv_bias=lambda hf_config: False,
    qk_layernorm=False,
    check=_check,
    linears=LINEARS,
    tensors=TENSORS,
)
