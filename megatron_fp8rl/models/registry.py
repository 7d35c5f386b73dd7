"""The one registry of model families: an HF config (or an HF tensor name) -> its `ModelFamily`.

Owns: `FAMILIES` (the `FAMILY` of every models/families/*.py, found by `discover`), `family_for`
(the one lookup: `architectures`, else `model_type`), `supported_architectures` and
`weight_linear` (for callers that hold HF names but no config).
Every consumer (models/hf.py, convert/, the weight sync, the SGLang plugin) looks families up
here. Pure data like the family files: it imports only the standard library and them.
Must not import: torch, megatron, compat, convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Mapping

from megatron_fp8rl.models import families
from megatron_fp8rl.models.family import DecoderLinear, ModelFamily, UnsupportedModelError


def discover(package) -> dict[str, ModelFamily]:
    """name -> the `FAMILY` of every module of `package` (models/families), in file-name order;
    raises naming a module without one, or whose family name another module took."""
    found: dict[str, ModelFamily] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, ModelFamily):
            raise TypeError(f"{module.__name__}: a family file must define FAMILY = ModelFamily(...)")
        if family.name in found:
            raise ValueError(f"{module.__name__}: family name {family.name!r} is taken")
        found[family.name] = family
    return found


FAMILIES: dict[str, ModelFamily] = discover(families)


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


def weight_linear(hf_tensor: str) -> tuple[int, DecoderLinear] | None:
    """`ModelFamily.weight_linear` for a caller without the HF config (the weight sync): the
    answer of the families whose tables hold `hf_tensor`; raises naming the tensor when none
    does, or when two families disagree about it."""
    answers = {}
    for family in FAMILIES.values():
        try:
            answers[family.name] = family.weight_linear(hf_tensor)
        except UnsupportedModelError:
            continue
    if not answers:
        raise UnsupportedModelError(f"HF tensor {hf_tensor} is in no model family's name table "
                                    f"({', '.join(FAMILIES)}; models/families/<family>.py)")
    if len({repr(answer) for answer in answers.values()}) > 1:
        raise UnsupportedModelError(f"HF tensor {hf_tensor}: model families disagree about it "
                                    f"({answers})")
    return next(iter(answers.values()))
