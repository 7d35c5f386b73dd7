"""The Llama 2/3.x family (also SmolLM2): RMSNorm, SwiGLU, RoPE (llama3 scaling), GQA, no biases.

Owns: the Llama `ModelFamily`. Must not import: convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

from typing import Any, Mapping

from megatron_fp8rl.models.family import ModelFamily, UnsupportedModelError, reject


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
)
