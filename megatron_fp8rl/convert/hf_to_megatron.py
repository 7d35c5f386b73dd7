"""HF safetensors -> Megatron-Core torch_dist checkpoint, streamed one tensor chunk at a time.

Owns: planning (which HF row ranges make each Megatron checkpoint chunk; missing, unexpected and
mis-shaped tensors are reported before anything is written) and writing through
torch.distributed.checkpoint (DCP) with a storage writer of our own (`_CopyingWriter`, a
FileSystemWriter whose write_data we replace): a chunk kept in its HF dtype is never in memory;
its torch.save record is written with a hole for the storage bytes, which copy_file_range fills
from the HF row ranges (QKV interleave and gate/up fuse are just offsets), the kernel path `cp`
takes. A chunk cast to another dtype is materialized alone, cast and torch.saved. Peak memory is
one cast chunk, not the model (measured on bench/convert.py's 2.2 GB checkpoint, largest tensor
128 MiB: 0.53 GiB peak RSS for the whole process, imports included; DCP's own FileSystemWriter
kept the last tensor of every key until its file closed: 0.94 GiB).
Where the time goes (bench/convert.py's checkpoint, 2 loaded CPUs, cProfile and phase timers):
copy_file_range is ~75% of the conversion; the rest is building the meta model (0.05-0.15 s),
planning (0.03-0.07 s), 183 torch.save framings and DCP's plan and metadata (~0.1 s). With DCP's
own FileSystemWriter the write phase was reading each chunk into fresh memory (25%), torch.save's
CRC32 over it (30%) and copying it into the file (45%): ~4.4x the time of `cp` on a quiet box.

The target layout comes from the caller: the `sharded_state_dict()` of the Megatron GPTModel built
on the meta device (megatron_fp8rl.models.build_model_from_hf(..., device="meta")), at TP=1/PP=1,
or at any TP/PP with the other shards' chunks gathered to the converting process
(`main_replica_shards`; trainer/actor.convert_initial_checkpoint).
The checkpoint stores global tensors, so Megatron loads it at any TP/PP (torch_dist reshards on
load). The HF config and tokenizer are kept in the `hf/` folder inside the checkpoint, for the way
back and for the rollout engine.
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    apply_factories,
    is_main_replica,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from tqdm import tqdm

from megatron_fp8rl.convert.integrity import write_manifest
from megatron_fp8rl.convert.outputs import atomic_output, check_output, copy_hf_side_files
from megatron_fp8rl.convert.safetensors_io import CheckpointError, HFCheckpoint, copy_bytes
from megatron_fp8rl.convert.tables import AttentionShape, hf_row_counts, row_pieces
from megatron_fp8rl.models.family import LAYER_PREFIX, ModelFamily, Rule
from megatron_fp8rl.models.registry import family_for

HF_SIDE_FOLDER = "hf"
"""Folder inside a converted Megatron checkpoint holding the HF config and tokenizer files."""
COMMON_FILE = "common.pt"


@dataclass(frozen=True)
class ChunkTask:
    """One chunk of one Megatron checkpoint tensor and the HF rows it is made of."""

    key: str
    """Megatron checkpoint key."""
    global_shape: tuple[int, ...]
    """Shape of the whole (layer-stacked) tensor."""
    offsets: tuple[int, ...]
    """Where this chunk starts in the whole tensor."""
    shape: tuple[int, ...]
    """Chunk shape."""
    dtype: torch.dtype
    """Stored element type."""
    sources: tuple[tuple[str, int, int, int], ...]
    """(HF name, first HF row, row count, first chunk row) copies that fill the chunk."""
    rows: int
    """Rows of the chunk (dim 0 of one layer's slice)."""

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ConversionPlan:
    """Everything the writer needs; built and validated before any output exists."""

    tasks: dict[tuple[str, tuple[int, ...]], ChunkTask]
    """(key, offsets) -> chunk."""
    objects: dict[str, bytes]
    """ShardedObject unique key -> serialized object (extra states)."""
    common: dict
    """The non-sharded rest of the state dict (common.pt)."""


def _split_layer(t: ShardedTensor) -> tuple[int | None, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(layer, per-layer global shape, per-layer offsets, chunk shape) of a sharded tensor."""
    if t.flattened_range is not None:
        raise CheckpointError(f"{t.key}: flattened (distributed-optimizer) tensors are not weights")
    local = tuple(t.data.shape)
    if t.key.startswith(LAYER_PREFIX):
        if t.prepend_axis_num != 1:
            raise CheckpointError(f"{t.key}: expected one stacked layer axis, found "
                                  f"{t.prepend_axis_num}")
        return t.global_offset[0], tuple(t.global_shape[1:]), tuple(t.global_offset[1:]), local
    return None, tuple(t.global_shape), tuple(t.global_offset), local


def _check_hf_shapes(rule: Rule, layer, layer_shape, pieces, checkpoint: HFCheckpoint) -> None:
    for name, rows in zip(rule.hf_names(layer), hf_row_counts(rule, pieces)):
        expected = (rows, *layer_shape[1:])
        if name not in checkpoint.entries:
            raise CheckpointError(f"missing HF tensor {name} (expected shape {expected}, for "
                                  f"Megatron {rule.megatron})")
        found = checkpoint.entries[name].shape
        if found != expected:
            raise CheckpointError(f"HF tensor {name}: expected shape {expected} (from Megatron "
                                  f"{rule.megatron} {layer_shape}), found {found}")


def _chunk_sources(rule, layer, pieces, row_start, rows) -> tuple[tuple[str, int, int, int], ...]:
    """Intersect the rule's row pieces with chunk rows [row_start, row_start + rows)."""
    names, sources, position = rule.hf_names(layer), [], 0
    for index, start, end in pieces:
        lo, hi = max(position, row_start), min(position + end - start, row_start + rows)
        if lo < hi:
            sources.append((names[index], start + lo - position, hi - lo, lo - row_start))
        position += end - start
    return tuple(sources)


def _plan_tensor(t: ShardedTensor, rule: Rule, attention, checkpoint, dtype, checked) -> ChunkTask | None:
    """The chunk of `t` with its HF sources. A chunk that splits columns (a row-parallel weight at
    TP > 1) is written whole-width, since the copy moves whole HF rows: the chunk at column 0
    stands for its rows, the others (None) are covered by it."""
    layer, layer_shape, offsets, local = _split_layer(t)
    if any(offsets[1:]):
        return None
    local = (*local[:1], *layer_shape[1:])
    pieces = row_pieces(rule, attention, layer_shape[0])
    if (rule.megatron, layer) not in checked:
        _check_hf_shapes(rule, layer, layer_shape, pieces, checkpoint)
        checked.add((rule.megatron, layer))
    chunk_rows = local[0] if local else 1
    sources = _chunk_sources(rule, layer, pieces, offsets[0] if offsets else 0, chunk_rows)
    source_dtypes = {checkpoint.entries[name].dtype for name, *_ in sources}
    if len(source_dtypes) != 1:
        raise CheckpointError(f"{t.key}: HF sources mix dtypes {sorted(map(str, source_dtypes))}")
    return ChunkTask(t.key, tuple(t.global_shape), tuple(t.global_offset),
                     local if layer is None else (1, *local), dtype or source_dtypes.pop(), sources,
                     chunk_rows)


def main_replica_shards(sharded_state_dict: dict) -> list[ShardedBase]:
    """The chunks a model's `sharded_state_dict()` owns in the checkpoint (factories applied, main
    replicas only): what one rank of a TP/PP-parallel model adds to a conversion planned by
    another (`other_shards`). Plain dataclasses over meta tensors: they pickle."""
    apply_factories(sharded_state_dict)
    sharded, _ = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))
    return [item for item in nested_values(sharded) if is_main_replica(item.replica_id)]


def plan_hf_to_megatron(
    sharded_state_dict: dict,
    hf_config: Mapping[str, Any],
    checkpoint: HFCheckpoint,
    dtype: torch.dtype | None = None,
    other_shards: Sequence[ShardedBase] = (),
) -> ConversionPlan:
    """Match every Megatron checkpoint chunk (of `sharded_state_dict` and `other_shards`) with its
    HF rows; raise naming any bad tensor."""
    family = family_for(hf_config)
    _check_unexpected(hf_config, family, checkpoint)
    rules = {rule.megatron: rule for rule in family.rules}
    attention = AttentionShape.from_hf(hf_config)
    apply_factories(sharded_state_dict)
    sharded, common = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))
    tasks, objects, checked = {}, {}, set()
    for item in [*nested_values(sharded), *other_shards]:
        if not is_main_replica(item.replica_id):
            continue
        if isinstance(item, ShardedObject):
            buffer = io.BytesIO()
            torch.save([item.data], buffer)  # what Megatron's torch_dist strategy writes
            objects[item.unique_key] = buffer.getvalue()
            continue
        if item.key not in rules:
            raise CheckpointError(f"Megatron tensor {item.key} has no HF counterpart in the "
                                  f"{family.name} table (models/families/{family.name}.py)")
        task = _plan_tensor(item, rules[item.key], attention, checkpoint, dtype, checked)
        if task is not None:
            tasks[(task.key, task.offsets)] = task
    _check_complete(tasks.values())
    return ConversionPlan(tasks, objects, common)


def _check_complete(tasks) -> None:
    """Every tensor's chunks must cover it: a parallel model's shard left out of `other_shards`
    would otherwise leave rows unwritten."""
    covered, whole = {}, {}
    for task in tasks:
        covered[task.key] = covered.get(task.key, 0) + torch.Size(task.shape).numel()
        whole[task.key] = torch.Size(task.global_shape).numel()
    for key, elements in covered.items():
        if elements != whole[key]:
            raise CheckpointError(f"{key}: the chunks given cover {elements} of its {whole[key]} elements; "
                                  "a TP/PP-parallel target needs every rank's main_replica_shards")


def _check_unexpected(hf_config, family: ModelFamily, checkpoint: HFCheckpoint) -> None:
    """Before planning: every HF tensor must be in the family's table (a tied checkpoint's stored
    lm_head included: HF ignores it too)."""
    known = family.hf_names(int(hf_config["num_hidden_layers"]))
    unexpected = sorted(name for name in checkpoint.entries
                        if name not in known and not name.endswith(family.derived_hf_suffixes))
    if unexpected:
        shown = ", ".join(f"{n} {checkpoint.entries[n].shape}" for n in unexpected[:8])
        raise CheckpointError(f"{len(unexpected)} unexpected HF tensors (no Megatron counterpart in "
                              f"the {family.name} table, models/families/{family.name}.py): {shown}")


class _LazySavePlanner(DefaultSavePlanner):
    """A DCP save planner whose tensors are read from the HF checkpoint only when written."""

    def __init__(self, plan: ConversionPlan, checkpoint: HFCheckpoint, progress: tqdm):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.conversion, self.checkpoint, self.progress = plan, checkpoint, progress

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(task.key, torch.Size(task.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(task.offsets), torch.Size(task.shape)),
                    properties=TensorProperties(dtype=task.dtype),
                    size=torch.Size(task.global_shape),
                ),
            )
            for task in self.conversion.tasks.values()
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                  for key in self.conversion.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.conversion.objects[write_item.index.fqn])
        task = self.conversion.tasks[(write_item.index.fqn, tuple(write_item.index.offset))]
        chunk = read_chunk(task, self.checkpoint)
        self.progress.update(task.nbytes)
        return chunk


def read_chunk(task: ChunkTask, checkpoint: HFCheckpoint) -> torch.Tensor:
    """Assemble one chunk from its HF row ranges (read straight into place when dtypes agree)."""
    source_dtype = checkpoint.entries[task.sources[0][0]].dtype
    chunk = torch.empty(task.shape, dtype=source_dtype)
    rows = chunk.view(task.rows, -1)
    for name, hf_row, count, chunk_row in task.sources:
        checkpoint.read_rows(name, hf_row, hf_row + count, rows[chunk_row:chunk_row + count])
    return chunk if task.dtype == source_dtype else chunk.to(task.dtype)


@contextlib.contextmanager
def unwrap_dcp_errors() -> Iterator[None]:
    """Re-raise the error a DCP save/load hit (DCP wraps even KeyboardInterrupt) as itself."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
            yield
    except CheckpointException as exc:
        causes = [failure[0] for failure in exc.failures.values()]
        if causes:
            raise causes[0] from None
        raise


class _HoleRecorder:
    """A file wrapper for torch.save under skip_data: records where each skipped storage lies."""

    def __init__(self, file):
        self.file, self.holes = file, []

    def write(self, data) -> int:
        return self.file.write(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:  # how torch.save skips a storage's bytes (skip_data)
            self.holes.append((self.file.tell(), offset))
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()


class _CopyingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter, but a chunk stored in its HF dtype is copied file to file.

    Each chunk is still one torch.save record in a .distcp file (what DCP and Megatron's
    torch_dist loader read), written the way DCP writes it (files split over `thread_count` by
    DCP's own size balancing, one thread per file). For a chunk whose dtype is the HF one, the
    record is written by torch.save under skip_data, which leaves a hole for the storage bytes,
    and the hole is filled from the HF row ranges with copy_file_range, so the bytes never pass
    through user space (the same kernel path as `cp`). The only differences from a plain
    torch.save are the zip CRC32 of that storage record (zero, as torch.save writes with
    set_crc32_options(False); torch.load does not check it) and the serialization id torch.save
    hashes from the CRCs. Chunks cast to another dtype are read, cast and torch.saved as DCP
    would. tests/convert/test_copy_writer.py compares each record with torch.save's.
    """

    def __init__(self, directory: Path, plan: ConversionPlan, checkpoint: HFCheckpoint,
                 progress: tqdm, threads: int):
        super().__init__(directory, thread_count=threads, sync_files=False)
        self.conversion, self.checkpoint, self.progress = plan, checkpoint, progress

    def write_data(self, plan: SavePlan, planner: _LazySavePlanner) -> Future:
        jobs = [(f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}", bucket, planner)
                for i, bucket in enumerate(_split_by_size_and_type(self.thread_count, plan.items))]
        stop = threading.Event()  # set when one file fails (or Ctrl-C): the others stop early
        with ThreadPoolExecutor(max(len(jobs) - 1, 1)) as pool:
            others = [pool.submit(self._write_file, *job, stop) for job in jobs[1:]]
            try:
                results = [self._write_file(*jobs[0], stop)] + [f.result() for f in others]
            except BaseException:
                stop.set()
                raise
        future: Future = Future()
        future.set_result([result for file_results in results for result in file_results])
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner,
                    stop: threading.Event) -> list[WriteResult]:
        results = []
        with open(Path(self.path) / name, "wb") as stream:
            for item in items:
                if stop.is_set():
                    raise RuntimeError(f"{name}: stopped, the conversion failed elsewhere")
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(planner.resolve_data(item).getbuffer())
                else:
                    task = self.conversion.tasks[(item.index.fqn, tuple(item.index.offset))]
                    if task.dtype == self.checkpoint.entries[task.sources[0][0]].dtype:
                        self._copy_chunk(task, stream)
                    else:
                        torch.save(planner.resolve_data(item), stream)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        return results

    def _copy_chunk(self, task: ChunkTask, stream) -> None:
        recorder = _HoleRecorder(stream)
        with torch.serialization.skip_data():
            torch.save(torch.empty(task.shape, dtype=task.dtype), recorder)  # never touched
        if len(recorder.holes) != 1 or recorder.holes[0][1] != task.nbytes:
            raise RuntimeError(f"{task.key}: torch.save under skip_data left holes "
                               f"{recorder.holes}, expected one of {task.nbytes} bytes")
        start, row_bytes = recorder.holes[0][0], task.nbytes // task.rows
        stream.flush()
        for name, hf_row, count, chunk_row in task.sources:
            path, offset, nbytes = self.checkpoint.row_bytes(name, hf_row, hf_row + count)
            copy_bytes(path, offset, nbytes, stream.fileno(), start + chunk_row * row_bytes)
        self.progress.update(task.nbytes)


def write_megatron_checkpoint(plan: ConversionPlan, checkpoint: HFCheckpoint, directory: Path,
                              progress: bool = True, threads: int = 1) -> None:
    """Write `plan` as a torch_dist checkpoint into the existing folder `directory`."""
    total = sum(task.nbytes for task in plan.tasks.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="hf->megatron",
              disable=not progress) as bar, unwrap_dcp_errors():
        dcp.save({}, storage_writer=_CopyingWriter(directory, plan, checkpoint, bar, threads),
                 planner=_LazySavePlanner(plan, checkpoint, bar), no_dist=True)
    torch.save(plan.common, directory / COMMON_FILE)
    save_config(CheckpointingConfig("torch_dist", 1), str(directory))


def convert_hf_to_megatron(
    hf_dir: Path,
    output_dir: Path,
    sharded_state_dict: dict,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    threads: int = 1,
    other_shards: Sequence[ShardedBase] = (),
) -> ConversionPlan:
    """Convert an HF checkpoint folder into a torch_dist checkpoint at `output_dir`.

    `sharded_state_dict`: of the target GPTModel built on the meta device from the same HF config,
    at TP=1/PP=1, or at this process's TP/PP shard with `other_shards` holding the
    `main_replica_shards` of every other shard (a parallel job's rank 0 converting for all).
    `dtype`: stored element type (default: the HF tensors' own). Writes from this one process (no
    collective); the output appears atomically (nothing at `output_dir` if interrupted).
    """
    hf_dir, output_dir = Path(hf_dir), Path(output_dir)
    check_output(output_dir, overwrite, inputs=(hf_dir,))
    hf_config = json.loads((hf_dir / "config.json").read_text())
    checkpoint = HFCheckpoint(hf_dir)
    plan = plan_hf_to_megatron(sharded_state_dict, hf_config, checkpoint, dtype, other_shards)
    with atomic_output(output_dir, overwrite) as tmp:
        write_megatron_checkpoint(plan, checkpoint, tmp, progress, threads)
        copy_hf_side_files(hf_dir, tmp / HF_SIDE_FOLDER)
        write_manifest(tmp)
    return plan
