"""Rotary position embedding settings from an HF config: rope theta and Llama 3.x frequency scaling.

Owns: `RopeSettings`, `rope_settings` (parse and validate the HF rope fields, old and new
spellings) and `llama3_inv_freq` / `apply_rope_scaling`. Megatron-Core 0.16.1's RotaryEmbedding
has `rope_scaling` with low/high frequency factors and the original context hard-coded to
1/4/8192 (Llama 3.1's values); Llama 3.2 and others use other values, so we compute the scaled
inverse frequencies ourselves with transformers' formula and install them on the model.
Must not import: convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatron_fp8rl.models.family import UnsupportedModelError


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.x rope scaling (transformers' `rope_type: llama3`)."""

    factor: float
    """Wavelengths above the low-frequency cut-off are stretched by this factor."""
    low_freq_factor: float
    """original_max_position_embeddings / low_freq_factor is the low-frequency wavelength cut-off."""
    high_freq_factor: float
    """original_max_position_embeddings / high_freq_factor is the high-frequency cut-off."""
    original_max_position_embeddings: int
    """Context length the model was pretrained with before scaling."""


@dataclass(frozen=True)
class RopeSettings:
    """Everything Megatron needs to reproduce the HF rotary embedding."""

    theta: float
    """Rotary base."""
    llama3: Llama3Scaling | None
    """Llama 3.x frequency scaling, or None for plain RoPE."""


def rope_settings(hf_config: Mapping[str, Any]) -> RopeSettings:
    """Read `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older configs)."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeSettings(theta=float(theta), llama3=None)
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported (supported: default, llama3)"
        )
    try:
        scaling = Llama3Scaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"llama3 rope scaling lacks the field {missing}") from None
    return RopeSettings(theta=float(theta), llama3=scaling)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    """Llama 3.x scaled inverse frequencies (transformers' `_compute_llama3_parameters`).

    Wavelengths 2*pi/f shorter than orig/high_freq_factor are kept, longer than
    orig/low_freq_factor are divided by `factor`, and those between are interpolated.
    """
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope_scaling(model: torch.nn.Module, settings: RopeSettings) -> None:
    """Replace a freshly built GPTModel's rotary inverse frequencies by the scaled ones.

    Must run before the first forward: Megatron's RotaryEmbedding caches its output per length.
    """
    if settings.llama3 is None:
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, settings.llama3)
