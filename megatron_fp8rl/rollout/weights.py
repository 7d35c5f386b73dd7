"""Checking a weight update against the checkpoint the rollout engine serves, before sending it.

Owns: reading a Hugging Face checkpoint's parameter names and shapes from its safetensors headers,
and validating (name, tensor) pairs against them. SGLang 0.5.23 answers an unknown name with a
KeyError in its scheduler that kills the whole engine (DESIGN.md hazard 4), so nothing unchecked
is ever sent.
Must not import: models, convert, data, trainer, cli.
"""
from __future__ import annotations

import difflib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from megatron_fp8rl.rollout.engine import WeightUpdateError

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ExpectedWeights:
    """The parameters a served checkpoint has: HF name -> shape."""

    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "ExpectedWeights":
        """Read every `*.safetensors` header in `model_dir` (no tensor data is loaded)."""
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"no *.safetensors files in {model_dir}: cannot know the served parameter names")
        shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            shapes.update(_safetensors_shapes(path))
        return cls(shapes)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def validate_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], expected: ExpectedWeights
) -> list[tuple[str, torch.Tensor]]:
    """Return the pairs as a list after checking each against `expected`.

    Raises `WeightUpdateError` naming the first offending tensor: an unknown name (with the closest
    expected names), a shape mismatch (expected vs found), a non-float dtype, a repeated name, or
    non-finite values. Partial updates (a subset of names) are allowed.
    """
    checked, seen = [], set()
    for name, tensor in named_tensors:
        if name not in expected.shapes:
            raise WeightUpdateError(
                f"weight update: tensor {name!r} is not a parameter of the served checkpoint "
                f"(expected one of {len(expected.shapes)} HF names, e.g. {_closest(name, expected)})"
            )
        if name in seen:
            raise WeightUpdateError(f"weight update: tensor {name!r} is given twice")
        want = expected.shapes[name]
        if tuple(tensor.shape) != want:
            raise WeightUpdateError(
                f"weight update: tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}"
            )
        if tensor.dtype not in _FLOAT_DTYPES:
            raise WeightUpdateError(
                f"weight update: tensor {name!r} has dtype {tensor.dtype}, expected one of {_FLOAT_DTYPES}"
            )
        if not torch.isfinite(tensor).all():
            raise WeightUpdateError(f"weight update: tensor {name!r} has non-finite values")
        seen.add(name)
        checked.append((name, tensor))
    if not checked:
        raise WeightUpdateError("weight update: no tensors given")
    return checked


def _closest(name: str, expected: ExpectedWeights, k: int = 3) -> list[str]:
    """Expected names most like `name` (a fused `qkv_proj` points at its q/k/v shards)."""
    return difflib.get_close_matches(name, list(expected.shapes), n=k, cutoff=0.0)
