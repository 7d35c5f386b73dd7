"""Megatron-Core torch_dist checkpoint (saved at any TP/PP) -> HF safetensors, one layer slice at a time.

Owns: planning the HF tensors from the checkpoint's metadata and the family table (missing and
unexpected tensors and shape mismatches are reported before anything is written), reading one
layer slice of one Megatron tensor at a time through torch.distributed.checkpoint (whatever TP/PP
chunks it was saved in), splitting it into its HF tensors, and streaming them into safetensors
shards whose headers are written first. Needs no process group and no model.
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from tqdm import tqdm

from megatron_fp8rl.compat import safe_dcp

from megatron_fp8rl.convert.hf_to_megatron import HF_SIDE_FOLDER, unwrap_dcp_errors
from megatron_fp8rl.convert.integrity import verify_manifest
from megatron_fp8rl.convert.outputs import atomic_output, check_output, copy_hf_side_files
from megatron_fp8rl.convert.safetensors_io import INDEX_FILE, CheckpointError, SafetensorsWriter
from megatron_fp8rl.convert.tables import AttentionShape, row_pieces
from megatron_fp8rl.models.family import LAYER_PREFIX, Rule
from megatron_fp8rl.models.registry import family_for

DEFAULT_SHARD_BYTES = 5 * 2**30


@dataclass(frozen=True)
class Unit:
    """One layer slice of one Megatron tensor and the HF tensors it splits into."""

    rule: Rule
    """The table rule."""
    layer: int | None
    """Layer number, None for tensors outside the decoder layers."""
    shape: tuple[int, ...]
    """Shape of the slice (without the layer axis)."""
    dtype: torch.dtype
    """Stored element type."""
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    """(HF name, HF shape) it splits into."""
    pieces: tuple[tuple[int, int, int], ...]
    """Row pieces (see tables.row_pieces)."""

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def dcp_reader(directory: Path) -> dcp.FileSystemReader:
    """A DCP reader of `directory` whose pickled parts load restricted (compat/safe_dcp.py)."""
    safe_dcp.install()
    return dcp.FileSystemReader(str(directory))


def read_tensor_metadata(directory: Path, key_prefix: str = "") -> dict[str, TensorStorageMetadata]:
    """Tensor key (prefix removed) -> metadata, for keys under `key_prefix`; extra states skipped."""
    if not (Path(directory) / ".metadata").is_file():
        raise CheckpointError(f"{directory} is not a torch_dist checkpoint (no .metadata file)")
    metadata = dcp_reader(directory).read_metadata()
    return {
        key[len(key_prefix):]: md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(key_prefix) and isinstance(md, TensorStorageMetadata)
    }


def plan_megatron_to_hf(hf: Mapping[str, Any], tensors: Mapping[str, TensorStorageMetadata]) -> list[Unit]:
    """Every layer slice to read and the HF tensors it becomes; raises naming any bad tensor."""
    family = family_for(hf)
    rules = {rule.megatron: rule for rule in family.rules}
    unexpected = sorted(set(tensors) - set(rules))
    if unexpected:
        raise CheckpointError(f"unexpected Megatron tensors (not in the {family.name} table, "
                              f"models/families/{family.name}.py): {', '.join(unexpected)}")
    attention, num_layers = AttentionShape.from_hf(hf), int(hf["num_hidden_layers"])
    units = []
    for rule in rules.values():
        if rule.megatron not in tensors:
            if rule.megatron == "output_layer.weight" and hf.get("tie_word_embeddings"):
                continue
            raise CheckpointError(f"missing Megatron tensor {rule.megatron} (expected by the "
                                  f"{family.name} table and config)")
        md = tensors[rule.megatron]
        shape, layers = tuple(md.size), [None]
        if rule.megatron.startswith(LAYER_PREFIX):
            if shape[0] != num_layers:
                raise CheckpointError(f"Megatron tensor {rule.megatron}: {shape[0]} layers, config "
                                      f"num_hidden_layers={num_layers}")
            shape, layers = shape[1:], list(range(num_layers))
        pieces = tuple(row_pieces(rule, attention, shape[0]))
        for layer in layers:
            names = rule.hf_names(layer)
            hf_shapes = [(sum(e - s for i, s, e in pieces if i == index), *shape[1:])
                         for index in range(len(names))]
            units.append(Unit(rule, layer, shape, md.properties.dtype,
                              tuple(zip(names, hf_shapes)), pieces))
    units.sort(key=lambda u: (-1 if u.rule.megatron.startswith("embedding") else
                              u.layer if u.layer is not None else num_layers))
    return units


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Reads one region of one checkpoint tensor into a preallocated tensor."""

    def __init__(self, key: str, offsets: tuple[int, ...], target: torch.Tensor):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.key, self.offsets, self.target = key, offsets, target

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata[self.key]
        chunk = ChunkStorageMetadata(torch.Size(self.offsets), self.target.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, md, [chunk]))

    def lookup_tensor(self, index):
        return self.target


def read_unit(directory: Path, unit: Unit, key_prefix: str = "") -> torch.Tensor:
    """The Megatron tensor slice of `unit` (all TP chunks of that layer, assembled)."""
    layered = unit.layer is not None
    target = torch.empty(((1,) if layered else ()) + unit.shape, dtype=unit.dtype)
    offsets = (unit.layer,) + (0,) * len(unit.shape) if layered else (0,) * len(unit.shape)
    planner = _SliceLoadPlanner(key_prefix + unit.rule.megatron, offsets, target)
    with unwrap_dcp_errors():
        dcp.load({}, storage_reader=dcp_reader(directory), planner=planner,
                 no_dist=True)
    return target[0] if layered else target


def split_unit(unit: Unit, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF name -> tensor: the rows of `tensor` each HF tensor is made of, in HF row order."""
    parts: dict[int, list[tuple[int, torch.Tensor]]] = {}
    position = 0
    for index, start, end in unit.pieces:
        parts.setdefault(index, []).append((start, tensor[position:position + end - start]))
        position += end - start
    out = {}
    for index, (name, _) in enumerate(unit.hf):
        rows = [t for _, t in sorted(parts[index], key=lambda p: p[0])]
        out[name] = rows[0] if len(rows) == 1 else torch.cat(rows)
    return out


def _shards(units: list[Unit], dtype_of, max_shard_bytes: int) -> list[list[Unit]]:
    """Group units into output files of at most `max_shard_bytes` (a unit never straddles two)."""
    shards, current, size = [], [], 0
    for unit in units:
        nbytes = sum(torch.Size(s).numel() for _, s in unit.hf) * dtype_of(unit).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(unit)
        size += nbytes
    return shards + [current] if current else shards


def _shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_hf_weights(directory: Path, units: list[Unit], output: Path, dtype: torch.dtype | None,
                     key_prefix: str = "", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     progress: bool = True) -> dict[str, str]:
    """Write the HF safetensors shards (and the index when there are several); returns the map."""
    dtype_of = (lambda unit: dtype or unit.dtype)
    shards = _shards(units, dtype_of, max_shard_bytes)
    weight_map, total = {}, 0
    with tqdm(total=sum(u.nbytes for u in units), unit="B", unit_scale=True, desc="megatron->hf",
              disable=not progress) as bar:
        for index, shard in enumerate(shards):
            name = _shard_name(index, len(shards))
            writer = SafetensorsWriter(output / name, [(n, dtype_of(u), s) for u in shard for n, s in u.hf])
            for unit in shard:
                for hf_name, tensor in split_unit(unit, read_unit(directory, unit, key_prefix)).items():
                    writer.write(hf_name, tensor.to(dtype_of(unit)))
                    weight_map[hf_name] = name
                    total += tensor.numel() * dtype_of(unit).itemsize
                bar.update(unit.nbytes)
            writer.close()
    if len(shards) > 1:
        (output / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


def hf_dtype(hf: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype an HF config declares (`dtype`, or the older `torch_dtype`), if any."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


def convert_megatron_to_hf(
    megatron_dir: Path,
    output_dir: Path,
    hf_config_dir: Path | None = None,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    key_prefix: str = "",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> dict[str, str]:
    """Convert a torch_dist checkpoint into an HF folder; returns the HF weight map.

    `hf_config_dir`: folder with config.json (and tokenizer files) of the model; default the `hf/`
    folder that convert_hf_to_megatron stores in the checkpoint. `dtype`: output element type
    (default: the config's dtype, else the stored one). `key_prefix`: prefix of the model's keys
    in the checkpoint (e.g. "model." in a training checkpoint).
    """
    megatron_dir, output_dir = Path(megatron_dir), Path(output_dir)
    side = Path(hf_config_dir) if hf_config_dir is not None else megatron_dir / HF_SIDE_FOLDER
    check_output(output_dir, overwrite, inputs=(megatron_dir, side))
    if not (side / "config.json").is_file():
        raise CheckpointError(f"no HF config.json in {side}; pass the HF config folder")
    hf = json.loads((side / "config.json").read_text())
    verify_manifest(megatron_dir)
    units = plan_megatron_to_hf(hf, read_tensor_metadata(megatron_dir, key_prefix))
    with atomic_output(output_dir, overwrite) as tmp:
        weight_map = write_hf_weights(megatron_dir, units, tmp, dtype or hf_dtype(hf), key_prefix,
                                      max_shard_bytes, progress)
        copy_hf_side_files(side, tmp)
    return weight_map
