"""Is a checkpoint folder what was written? Per-file SHA-256 manifests, and safe metadata reads.

Owns: `write_manifest(folder)` (every file under the folder, `sha256sum` format, so
`sha256sum -c checksums.sha256` checks it by hand) and `verify_manifest(folder)` (raises
CheckpointError naming each file that is missing, truncated or altered). A folder without a
manifest (written by older versions or by Megatron-LM) loads with a warning naming it.
A manifest guards against damage, not against an attacker, who can rewrite it too: pickles in a
checkpoint are loaded restricted for that (compat/safe_dcp.py). `verify_torch_dist(folder)` runs
both checks before a torch_dist folder is handed to Megatron-Core, whose own errors would bury ours.
`hf_fingerprint(folder)`: a cheap content fingerprint of an HF checkpoint (what a run was made from).
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import hashlib
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from megatron_fp8rl.compat import safe_dcp
from megatron_fp8rl.convert.outputs import HF_SIDE_FILES
from megatron_fp8rl.convert.safetensors_io import CheckpointError

MANIFEST = "checksums.sha256"
_BLOCK = 1 << 22
_THREADS = 4  # hashlib releases the GIL: a few files hash at once


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _digests(folder: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(_THREADS) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(folder / name), names)))


def write_manifest(folder: Path) -> Path:
    """Write `folder`/checksums.sha256 covering every other file under `folder`."""
    folder = Path(folder)
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p.name != MANIFEST)
    lines = [f"{digest}  {name}\n" for name, digest in _digests(folder, names).items()]
    path = folder / MANIFEST
    path.write_text("".join(lines))
    return path


def _read_manifest(path: Path) -> dict[str, str]:
    entries = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CheckpointError(f"{path}:{number}: not a '<sha256>  <file>' line: {line[:80]!r}")
        entries[name] = digest
    return entries


def verify_manifest(folder: Path) -> bool:
    """Check every file `folder`'s manifest lists; False (and a warning) when it has none."""
    folder, path = Path(folder), Path(folder) / MANIFEST
    if not path.is_file():
        warnings.warn(f"{folder} has no {MANIFEST}: its files' integrity is not verified")
        return False
    expected = _read_manifest(path)
    missing = sorted(name for name in expected if not (folder / name).is_file())
    present = [name for name in expected if name not in missing]
    altered = sorted(name for name, digest in _digests(folder, present).items()
                     if digest != expected[name])
    if missing or altered:
        problems = [f"{folder / name}: missing" for name in missing]
        problems += [f"{folder / name}: contents differ from {MANIFEST} (damaged or altered)"
                     for name in altered]
        raise CheckpointError("checkpoint integrity check failed:\n  " + "\n  ".join(problems))
    return True


def verify_torch_dist(folder: Path) -> None:
    """Raise naming the file when `folder` is not an intact, safely loadable torch_dist checkpoint:
    a file its manifest lists is damaged, or its `.metadata` is missing, corrupt or crafted."""
    verify_manifest(folder)
    if not (Path(folder) / ".metadata").is_file():
        raise CheckpointError(f"{folder} is not a torch_dist checkpoint (no .metadata file)")
    safe_dcp.install()
    FileSystemReader(str(folder)).read_metadata()


def _sampled_sha256(path: Path, blocks: int = 16, block: int = 1 << 16) -> str:
    """SHA-256 of a safetensors header (names, dtypes, shapes, offsets) and of `blocks` evenly
    spaced `block`-byte samples of the file: any fine-tune changes the sampled weights."""
    digest, size = hashlib.sha256(), path.stat().st_size
    with open(path, "rb") as stream:
        if path.suffix == ".safetensors":
            (length,) = struct.unpack("<Q", stream.read(8))
            digest.update(stream.read(min(length, 100 * 2**20)))
        for index in range(blocks):
            stream.seek(index * max(size - block, 0) // max(blocks - 1, 1))
            digest.update(stream.read(block))
    return f"{size}:{digest.hexdigest()}"


def hf_fingerprint(folder: Path) -> dict[str, str]:
    """file name -> digest for an HF checkpoint folder, reading about a megabyte per weight file:
    the config and tokenizer files hashed whole, each weight file (.safetensors, .bin, .gguf, ...)
    by size, header and sampled contents (_sampled_sha256)."""
    folder, prints = Path(folder), {}
    for name in HF_SIDE_FILES:
        if (folder / name).is_file():
            prints[name] = _sha256(folder / name)
    for path in sorted(folder.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth"):
            prints[path.name] = _sampled_sha256(path)
    return prints
