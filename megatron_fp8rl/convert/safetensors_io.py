"""Streaming safetensors reading and writing, one tensor (or row range) at a time.

Owns: parsing and validating safetensors headers, an index of an HF checkpoint folder
(`HFCheckpoint`), reading row ranges straight into a caller's buffer with plain file reads (no
mmap, so resident memory stays bounded by the tensors in flight), copying byte ranges file to file
inside the kernel (`copy_bytes`), and `SafetensorsWriter`, which writes the header first and then
tensors in any order.
Format: 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets
are relative to the data start and tile it without gaps.
Must not import: anything of ours above L0.
"""
from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match what the conversion expects."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in a safetensors file."""

    name: str
    """Tensor name."""
    path: Path
    """The .safetensors file."""
    dtype: torch.dtype
    """Element type."""
    shape: tuple[int, ...]
    """Tensor shape."""
    offset: int
    """Absolute byte offset of the first element in the file."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"corrupt safetensors file {path}: {why}")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of one .safetensors file; raises CheckpointError on a damaged header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise _corrupt(path, f"file is {size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER, size - 8):
            raise _corrupt(path, f"header length {header_len} exceeds the file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _corrupt(path, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + header_len, size - 8 - header_len
    return {name: _entry(path, name, info, data_start, data_len) for name, info in header.items()}


def _entry(path: Path, name: str, info: dict, data_start: int, data_len: int) -> TensorEntry:
    try:
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(path, f"tensor {name}: bad header entry {info!r} ({exc!r})") from None
    entry = TensorEntry(name, path, dtype, shape, data_start + begin)
    if end - begin != entry.nbytes or not 0 <= begin <= end <= data_len:
        raise _corrupt(
            path,
            f"tensor {name}: bytes [{begin}, {end}) do not hold {shape} {info['dtype']} "
            f"({entry.nbytes} bytes) inside the {data_len}-byte data section (truncated file?)",
        )
    return entry


class HFCheckpoint:
    """The tensors of an HF checkpoint folder (sharded with an index, or a single file)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.entries: dict[str, TensorEntry] = {}
        for path in self._files():
            for name, entry in read_header(path).items():
                if name in self.entries:
                    raise CheckpointError(
                        f"tensor {name} appears in both {self.entries[name].path.name} and "
                        f"{path.name}"
                    )
                self.entries[name] = entry
        if not self.entries:
            raise CheckpointError(f"{self.directory}: no tensors in its safetensors files")

    def _files(self) -> list[Path]:
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is not a directory")
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"corrupt {index}: {exc!r}") from None
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"{index} names missing files: {', '.join(missing)}")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        return files

    def row_bytes(self, name: str, start: int, stop: int) -> tuple[Path, int, int]:
        """(file, absolute byte offset, byte count) of rows [start, stop) of tensor `name`."""
        entry = self.entries[name]
        if not entry.shape:
            return entry.path, entry.offset, entry.nbytes
        row = entry.nbytes // max(entry.shape[0], 1)
        return entry.path, entry.offset + start * row, (stop - start) * row

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy rows [start, stop) of tensor `name` (dim 0) into the contiguous tensor `out`."""
        entry = self.entries[name]
        path, offset, nbytes = self.row_bytes(name, start, stop)
        if out.dtype != entry.dtype or out.nbytes != nbytes or not out.is_contiguous():
            raise CheckpointError(
                f"tensor {name}: cannot read rows [{start}, {stop}) of {entry.shape} "
                f"{entry.dtype} into {tuple(out.shape)} {out.dtype}"
            )
        read_exact(path, offset, out)


def read_exact(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous tensor `out` with the bytes of `path` at `offset`."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise _corrupt(Path(path), f"unexpected end of file at byte {offset + done}")
            done += got


_COPY_FALLBACK_ERRNOS = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}
_COPY_BLOCK = 16 * 2**20


def copy_bytes(path: Path, offset: int, nbytes: int, out_fd: int, out_offset: int) -> None:
    """Copy `nbytes` of `path` at `offset` to the file `out_fd` at `out_offset`, inside the kernel.

    Uses copy_file_range (what `cp` does: page cache to page cache, no user-space copy); where the
    kernel or file system refuses it, falls back to pread/pwrite in 16 MiB blocks. The position of
    `out_fd` is left unchanged.
    """
    with open(path, "rb", buffering=0) as f:
        done, fast = 0, hasattr(os, "copy_file_range")
        while done < nbytes:
            want = nbytes - done
            if fast:
                try:
                    got = os.copy_file_range(f.fileno(), out_fd, want, offset + done, out_offset + done)
                except OSError as exc:
                    if exc.errno not in _COPY_FALLBACK_ERRNOS:
                        raise
                    fast = False
                    continue
            else:
                block = os.pread(f.fileno(), min(want, _COPY_BLOCK), offset + done)
                got = len(block) and os.pwrite(out_fd, block, out_offset + done)
            if not got:
                raise _corrupt(Path(path), f"unexpected end of file at byte {offset + done}")
            done += got


class SafetensorsWriter:
    """Writes a .safetensors file whose tensors are declared up front and written in any order."""

    def __init__(self, path: Path, tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        position = 0
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [position, position + nbytes]}
            self._layout[name] = (dtype, tuple(shape), position)
            position += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._data_start = 8 + len(encoded)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._file.truncate(self._data_start + position)
        self._pending = set(self._layout)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one declared tensor (dtype and shape must match the declaration)."""
        if name not in self._layout:
            raise CheckpointError(f"tensor {name} was not declared for {self.path.name}")
        dtype, shape, position = self._layout[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name}: declared {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        self._file.seek(self._data_start + position)
        self._file.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._pending.discard(name)

    def close(self) -> None:
        """Close the file; raise if a declared tensor was never written."""
        self._file.close()
        if self._pending:
            raise CheckpointError(f"{self.path.name}: tensors never written: {sorted(self._pending)}")
