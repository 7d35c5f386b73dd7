"""What a model family is: the few facts that make Llama, Qwen2 and Qwen3 different Megatron models.

Owns: `ModelFamily`, `UnsupportedModelError` and the `reject` helper the family files share. Each
family lives in its own file (llama.py, qwen2.py, qwen3.py) and contributes one `ModelFamily`;
registry.py lists them.
Must not import: convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


class UnsupportedModelError(ValueError):
    """The Hugging Face config describes a model this package cannot build."""


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family: how its HF config differs from the shared Llama-style mapping."""

    name: str
    """Short name ("llama", "qwen2", "qwen3")."""
    architectures: tuple[str, ...]
    """HF `architectures` entries that select this family."""
    model_types: tuple[str, ...]
    """HF `model_type` values that select this family when `architectures` is absent."""
    qkv_bias: Callable[[Mapping[str, Any]], bool]
    """Whether q/k/v projections carry a bias, from the HF config dict."""
    qk_layernorm: bool
    """Whether queries and keys pass through a per-head RMSNorm (Qwen3)."""
    check: Callable[[Mapping[str, Any]], None]
    """Raises UnsupportedModelError for settings of this family that we cannot map."""


def reject(hf_config: Mapping[str, Any], field: str, allowed: Any, family: str) -> None:
    """Raise when `hf_config[field]` is set to something other than `allowed`."""
    value = hf_config.get(field, allowed)
    if value != allowed and value is not None:
        raise UnsupportedModelError(
            f"{family}: config field {field}={value!r} is not supported (expected {allowed!r})"
        )
