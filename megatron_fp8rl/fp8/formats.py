"""FP8 formats: the two element types and the recipe-level format names built from them.

Owns: `Fp8Format` (torch dtype, largest finite value, smallest subnormal) for E4M3 and E5M2, and
the recipe format names 'e4m3' / 'hybrid' (which element type the forward and the backward use).
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 element type."""

    name: str
    """Short name: 'e4m3' or 'e5m2'."""
    dtype: torch.dtype
    """The torch dtype that stores it."""
    max: float
    """Largest finite magnitude (448 for E4M3, 57344 for E5M2); quantization saturates here."""
    min_subnormal: float
    """Smallest positive magnitude (2**-9 for E4M3, 2**-16 for E5M2); below half of it, zero."""
    rounding_limit: float
    """max + half its ulp (464, 61440): a magnitude above it is genuinely clipped by
    saturation; smaller ones would round to at most `max` anyway."""


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-9, 464.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-16, 61440.0)

ELEMENT_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
"""Element types by name."""

RECIPE_FORMATS = {"e4m3": (E4M3, E4M3), "hybrid": (E4M3, E5M2)}
"""Recipe format name -> (forward element type, backward element type). 'hybrid' is E4M3 for
activations and weights, E5M2 for gradients. Pure E5M2 training is not offered (TE rejects it too)."""


def get_format(name: str) -> Fp8Format:
    """The element type called `name` ('e4m3' or 'e5m2'); ValueError listing the valid names."""
    try:
        return ELEMENT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown FP8 element format {name!r}; valid: {', '.join(sorted(ELEMENT_FORMATS))}"
        ) from None


def recipe_formats(name: str) -> tuple[Fp8Format, Fp8Format]:
    """(forward, backward) element types of recipe format `name`; ValueError listing the valid."""
    try:
        return RECIPE_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown FP8 recipe format {name!r}; valid: {', '.join(sorted(RECIPE_FORMATS))}"
        ) from None
