"""The one registry of model families: HF architecture -> `ModelFamily`.

Owns: `FAMILIES`, `family_for`, `supported_architectures`. The checkpoint name tables of the same
families live in megatron_fp8rl/convert/tables.py, keyed by the same HF architecture names
(modules of one layer do not import each other, so convert/ cannot read this registry).
Must not import: convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

from typing import Any, Mapping

from megatron_fp8rl.models import llama, qwen2, qwen3
from megatron_fp8rl.models.family import ModelFamily, UnsupportedModelError

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}


def supported_architectures() -> list[str]:
    """Every HF architecture name some family accepts."""
    return sorted(a for f in FAMILIES.values() for a in f.architectures)


def family_for(hf_config: Mapping[str, Any]) -> ModelFamily:
    """The family of an HF config dict, from `architectures` (else `model_type`)."""
    architectures = list(hf_config.get("architectures") or [])
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if any(a in family.architectures for a in architectures):
            return family
        if not architectures and model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"unsupported architecture {architectures or model_type!r}; supported: "
        f"{', '.join(supported_architectures())}"
    )
