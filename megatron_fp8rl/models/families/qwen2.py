"""The Qwen2 / Qwen2.5 family: the Llama layout plus a bias on the q/k/v projections.

Owns: the Qwen2 `ModelFamily`. Must not import: anything but the standard library and the
family files (models/family.py, families/llama.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from megatron_fp8rl.models.families import llama
from megatron_fp8rl.models.family import ModelFamily, reject


def _check(hf_config: Mapping[str, Any]) -> None:
    # Megatron-Core's GPT attention has no per-layer sliding window for dense models.
    reject(hf_config, "use_sliding_window", False, "qwen2")


FAMILY = ModelFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    qkv_bias=lambda hf_config: True,
    qk_layernorm=False,
    check=_check,
    linears=llama.LINEARS,
    tensors=llama.TENSORS + (llama.QKV.rule("bias"),),
)
