"""Tiny random HF checkpoints of each supported architecture, for conversion and logits tests.

Each config exercises what makes its family different: Llama has tied embeddings and llama3 rope
scaling with a short original context (so test positions reach the scaled band), Qwen2 has q/k/v
biases and tied embeddings, Qwen3 has q/k norms, an explicit head_dim != hidden/heads and an
untied output layer. All use GQA (4 query heads, 2 key/value heads). Every parameter, norms
included, is drawn from N(0, 0.2): with unit norm weights a swapped norm would go unnoticed.
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3")
VOCAB = 128
MAX_POSITIONS = 256


def tiny_hf_config(arch: str):
    """A transformers config of `arch` with 2 layers, hidden 64, 4 heads / 2 kv heads."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                  rms_norm_eps=1e-5)
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    elif arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    else:
        raise ValueError(arch)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def tiny_hf_model(arch: str, seed: int = 0):
    """The fp32 transformers model of `tiny_hf_config(arch)` with N(0, 0.2) weights."""
    import warnings

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(tiny_hf_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def save_tiny_hf(arch: str, directory: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Save a tiny random HF checkpoint (safetensors) of `arch`; returns `directory`."""
    tiny_hf_model(arch, seed).to(dtype).save_pretrained(directory)
    return Path(directory)
