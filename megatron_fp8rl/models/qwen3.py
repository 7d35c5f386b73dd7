"""The Qwen3 (dense) family: the Llama layout plus a per-head RMSNorm on queries and keys.

Owns: the Qwen3 `ModelFamily`. Must not import: convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

from typing import Any, Mapping

from megatron_fp8rl.models.family import ModelFamily, reject


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
)
