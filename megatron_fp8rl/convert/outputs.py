"""Output folders that appear whole or not at all, and the HF files that travel beside weights.

Owns: `atomic_output` (write into a hidden temporary sibling, rename at the end; an existing
output is refused unless overwrite; an output that is, contains or lies inside an input is refused
always, since replacing it would destroy the input; an output where this process cannot write is
refused before any work, and a write that fails names the output, not the hidden temporary;
temporaries left by a killed writer are removed at the next write of the same output),
`writable_problem` (why a path cannot be written), `copy_hf_side_files` (config, generation
config, tokenizer).
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
"""Non-weight files of an HF checkpoint that a converted checkpoint keeps."""


class OutputExistsError(FileExistsError):
    """The output path exists and overwriting was not requested."""


class OutputOverlapsInputError(ValueError):
    """The output path is an input, or one contains the other."""


class OutputNotWritableError(OSError):
    """The output cannot be written (permission, read-only file system, ...)."""


def writable_problem(path: Path) -> str | None:
    """Why `path` (a folder or file to be created or replaced) cannot be written by this process,
    e.g. "permission denied: cannot create entries in /data"; None when it can. Judged on the
    nearest existing folder at or above its parent, as creating or renaming `path` needs it."""
    folder = Path(path).absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return f"read-only file system: cannot create entries in {folder}"
    return f"permission denied: cannot create entries in {folder}"


def check_output(path: Path, overwrite: bool, inputs: tuple[Path | None, ...] = ()) -> None:
    """Refuse an existing output path unless `overwrite`, and an output that is, contains or lies
    inside one of `inputs` (call before any long work)."""
    output = Path(path).resolve()
    for source in (Path(i).resolve() for i in inputs if i is not None):
        if output == source or output in source.parents or source in output.parents:
            raise OutputOverlapsInputError(
                f"output {path} overlaps the input {source}: writing it would destroy the input; "
                "choose an output outside the input folder")
    if Path(path).exists() and not overwrite:
        raise OutputExistsError(f"output {path} already exists; pass --overwrite to replace it")
    problem = writable_problem(path)
    if problem:
        raise OutputNotWritableError(f"cannot write output {path}: {problem}")


@contextlib.contextmanager
def atomic_output(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder that becomes `path` only if the block completes.

    On any exception (including KeyboardInterrupt) the temporary folder is removed and `path` is
    left as it was. The swap of an existing output is two renames, so `path` is never partial.
    """
    path = Path(path)
    check_output(path, overwrite)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    with _naming_output(path, tmp):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        with _naming_output(path, tmp):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _naming_output(path, tmp):
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(path)


@contextlib.contextmanager
def _naming_output(path: Path, tmp: Path) -> Iterator[None]:
    """Re-raise an OSError about the hidden temporary `tmp` (or a file in it) as one naming the
    user's output `path` and the problem (the temporary's name means nothing to the user)."""
    try:
        yield
    except OSError as err:
        if err.filename is None or not str(err.filename).startswith(str(tmp)):
            raise
        inside = os.path.relpath(err.filename, tmp)
        where = "" if inside == "." else f" (writing {inside})"
        raise OutputNotWritableError(f"cannot write output {path}{where}: {err.strerror}") from err


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale_partials(path: Path) -> list[Path]:
    """Remove the temporary siblings of `path` (`.<name>.partial-<pid>`, `.<name>.old-<pid>`) that
    a killed writer left behind: those whose process no longer exists. Returns what was removed."""
    path, removed = Path(path), []
    for stale in path.parent.glob(f".{path.name}.*-*"):
        kind, _, pid = stale.name[len(path.name) + 2:].rpartition("-")
        if kind in ("partial", "old") and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            removed.append(stale)
    return removed


def copy_hf_side_files(source: Path, destination: Path) -> list[str]:
    """Copy the config/tokenizer files that exist in `source` into `destination`."""
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, destination / name)
            copied.append(name)
    return copied
