"""Loading torch.distributed.checkpoint (DCP) folders without running code from them.

Owns: `install()`, after which every DCP load in the process (ours in convert/, Megatron-Core's
`dist_checkpointing.load`) reads a checkpoint's pickled parts through restricted loaders:
- `.metadata`: torch 2.13's `FileSystemReader.read_metadata` calls `pickle.load`, so a crafted file
  runs any code it names. Here it is read by `MetadataUnpickler`, which resolves only the classes
  DCP metadata is made of (ALLOWED_GLOBALS plus torch dtypes) and raises `UnsafeCheckpointError`
  naming the file and the refused global before anything is called.
- byte items (Megatron's ShardedObjects: optimizer state, FP8 `_extra_state`): torch's
  `DefaultLoadPlanner.load_bytes` calls `torch.load(weights_only=False)`; here `weights_only=True`
  (tensors, containers and primitives only), which every item our checkpoints hold passes.
Why a shim: both are other libraries' internals. `install()` checks that the two methods it
replaces still do what it replaces (raises otherwise), and is idempotent. Entry points call it
explicitly (launch.init_distributed; convert/megatron_to_hf.dcp_reader), never as an
import side effect.
Must not import: anything of ours above layer L1.
"""
from __future__ import annotations

import inspect
import io
import pickle
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from megatron_fp8rl.compat.versions import patch

ALLOWED_GLOBALS = frozenset({
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a save given a Path
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
})
"""(module, name) pairs a DCP `.metadata` pickle may reference (measured on checkpoints written by
torch 2.13 DCP and Megatron-Core 0.16.1 dist_checkpointing, FP8 extra states included); torch
dtypes (`torch.float32`, ...) are allowed besides."""

_installed: dict[str, Any] = {}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references code a checkpoint has no business referencing."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, resolving only ALLOWED_GLOBALS and torch dtypes."""

    def __init__(self, stream: BinaryIO, path: str):
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to load global {module}.{name} (a torch_dist .metadata file "
            "holds only checkpoint metadata classes; this one was crafted or comes from an "
            "unsupported torch version). Nothing from it was run.")


def load_metadata(stream: BinaryIO, path: str) -> dcp_metadata.Metadata:
    """The DCP Metadata pickled in `stream` (read from `path`), through MetadataUnpickler."""
    try:
        metadata = MetadataUnpickler(stream, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a damaged pickle raises anything from EOFError to ValueError
        raise UnsafeCheckpointError(f"{path}: corrupt torch_dist metadata ({exc!r})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def _read_metadata(self: FileSystemReader, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
    """FileSystemReader.read_metadata of torch 2.13, with the restricted unpickler."""
    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = load_metadata(stream, str(path))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self: DefaultLoadPlanner, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes of torch 2.13, with weights_only=True."""
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's text suggests weights_only=False: keep the cause only
        cause = [line for line in str(exc).splitlines() if "GLOBAL" in line] or [str(exc).splitlines()[-1]]
        raise UnsafeCheckpointError(f"checkpoint item {read_item.dest_index.fqn}: refusing a pickled "
                                    f"object ({cause[0].strip()}). Nothing from it was run.") from None
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def _check_replaced(method, must_contain: str) -> None:
    source = inspect.getsource(method)
    if must_contain not in source:
        raise RuntimeError(f"{method.__qualname__} no longer calls {must_contain!r} (torch "
                           f"{torch.__version__}); compat/safe_dcp.py must be re-checked against it")


def install() -> None:
    """Route DCP metadata and byte-item loads of this process through the restricted loaders."""
    if _installed:
        return
    _check_replaced(FileSystemReader.read_metadata, "pickle.load(metadata_file)")
    _check_replaced(DefaultLoadPlanner.load_bytes, "torch.load(")
    # read_metadata is wrapped by a decorator (self, *args, **kwargs): its source check stands for
    # its signature
    _installed.update(load_bytes=patch(DefaultLoadPlanner, "load_bytes", _load_bytes, dist="torch",
                                       like=_load_bytes),
                      read_metadata=patch(FileSystemReader, "read_metadata", _read_metadata, dist="torch"))

