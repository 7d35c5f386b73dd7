"""What a run directory was made from, so that reusing it can never train the wrong model.

Owns: `<run_dir>/provenance.json` (the starting HF checkpoint's path and content fingerprint, and
the run's config as dotted keys), written when a run first claims the folder, and
`check_run_dir`, which refuses a run whose model differs from the recorded one (its converted
`init_megatron` and checkpoints belong to that model) or whose config differs in anything but
RESUMABLE_KEYS, unless `train.resume_changed_config` (a key the recorded run predates counts
at its default: the behaviour the run had before the key existed; a renamed key, config/renamed.py, counts
under its new name). A folder holding a previous run's outputs
without a provenance record is refused too: what it was made from cannot be told. A run_dir or
checkpoint.dir this process cannot write is refused before anything starts, naming the key.

Also owns `<run_dir>/run.lock`, which gives a run_dir one owner for the run's whole life
(`RunDirLock`, taken by `hold_run_dir` on rank 0; `check_run_dir_free` peeks without taking it): an
exclusive `flock` on the file plus a JSON body naming the holder (host, pid, start time). A second
run on a held run_dir is refused at once naming the holder; the kernel drops a flock when its
process ends, however it ends, so after a crash or kill -9 the next run takes the lock over, with a
warning naming the run that left it. Not the `filelock` package: it opens the lock file with
O_TRUNC, which would erase the holder's record the refusal names. Multi-node runs lock the shared
run_dir from global rank 0 (its host recorded); on NFS, Linux emulates flock with the server's
byte-range locks, so the lock holds across nodes and the server drops it when its client dies.
Must not import: cli.
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

from megatron_fp8rl.config.loader import defaults
from megatron_fp8rl.config.renamed import renamed_key
from megatron_fp8rl.convert.integrity import hf_fingerprint
from megatron_fp8rl.convert.outputs import writable_problem
from megatron_fp8rl.rl.step_cost import dotted

PROVENANCE = "provenance.json"
RESUMABLE_KEYS = ("run_dir", "model.hf_path", "checkpoint.dir", "train.steps")
"""Keys that may differ on reuse: paths (the model's identity is its fingerprint, not its path),
and train.steps (continuing a run to more steps is the ordinary resume, as Megatron's --train-iters)."""
PREVIOUS_OUTPUTS = ("init_megatron", "checkpoints")
LOCK = "run.lock"


class RunDirError(ValueError):
    """The run directory holds another run's outputs."""


class RunDirBusyError(RunDirError):
    """Another run, still alive, holds the run directory's lock."""


def _record(cfg) -> dict[str, Any]:
    config = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples and lists compare alike
    return {"model.hf_path": str(Path(cfg.model.hf_path).resolve()),
            "model_fingerprint": hf_fingerprint(Path(cfg.model.hf_path)),
            "config": dotted(config)}


def _model_mismatch(run_dir: Path, old: dict, new: dict) -> str:
    changed = sorted(name for name in set(old["model_fingerprint"]) | set(new["model_fingerprint"])
                     if old["model_fingerprint"].get(name) != new["model_fingerprint"].get(name))
    return (f"run_dir={run_dir} was made from model.hf_path={old['model.hf_path']}; this run's "
            f"model.hf_path={new['model.hf_path']} is a different checkpoint (differs in: "
            f"{', '.join(changed)}). Its converted weights and checkpoints are the other model's: "
            "use a new run_dir.")


def _config_mismatch(run_dir: Path, old: dict, new: dict, default: dict) -> str | None:
    old = {renamed_key(k): v for k, v in old.items()}  # a run recorded before a rename: its keys' new names
    old = {**{k: v for k, v in default.items() if k in new}, **old}  # keys added since: their defaults
    keys = sorted(k for k in set(old) | set(new)
                  if k not in RESUMABLE_KEYS and k != "train.resume_changed_config"
                  and old.get(k) != new.get(k))
    if not keys:
        return None
    changes = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
    return (f"run_dir={run_dir} was made with a different config ({changes}); use a new run_dir, "
            "or set train.resume_changed_config=true to continue it with these values.")


def check_run_dir(cfg) -> dict[str, Any]:
    """All ranks, before anything is written: raise RunDirError if `cfg.run_dir` holds outputs of
    different inputs; returns the record claim_run_dir writes."""
    run_dir, record = Path(cfg.run_dir), _record(cfg)
    for key, folder in (("run_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        problem = folder and writable_problem(Path(folder) / PROVENANCE)  # the folder, or where it goes
        if problem:
            raise RunDirError(f"{key}={folder}: {problem}")
    path = run_dir / PROVENANCE
    if not path.is_file():
        previous = [name for name in PREVIOUS_OUTPUTS if (run_dir / name).exists()]
        if previous:
            raise RunDirError(f"run_dir={run_dir} holds {', '.join(previous)} but no {PROVENANCE}: "
                              "what it was made from cannot be told; use a new run_dir")
        return record
    old = json.loads(path.read_text())
    if old["model_fingerprint"] != record["model_fingerprint"]:
        raise RunDirError(_model_mismatch(run_dir, old, record))
    default = dotted(json.loads(json.dumps(defaults(type(cfg)))))
    config_error = _config_mismatch(run_dir, old["config"], record["config"], default)
    if config_error and not cfg.train.resume_changed_config:
        raise RunDirError(config_error)
    return old if not config_error else record


def claim_run_dir(run_dir: Path, record: dict[str, Any]) -> None:
    """Rank 0: write the provenance record (atomically) into `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{PROVENANCE}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(run_dir / PROVENANCE)


def _holder_text(body: str) -> str:
    """'host H pid P (started T)' from a lock body, or what can be said of an unreadable one."""
    try:
        holder = json.loads(body)
        return f"host {holder['host']} pid {holder['pid']} (started {holder['started']})"
    except (ValueError, KeyError, TypeError):
        return "a run whose holder record is not written yet" if not body.strip() else f"a run ({body.strip()!r})"


def _pid_gone_here(body: str) -> bool:
    """Whether the holder a lock body names ran on this host and its process is gone."""
    try:
        holder = json.loads(body)
        if holder["host"] != socket.gethostname():
            return False
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, KeyError, TypeError, PermissionError):
        return False
    return False


def _read_body(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace")


def _busy_message(run_dir: Path, body: str) -> str:
    message = (f"run_dir={run_dir} is in use by {_holder_text(body)} (lock {run_dir / LOCK}); wait for that "
               "run to end, or use another run_dir")
    if _pid_gone_here(body):
        message += ("; that pid is gone on this host, so a process it started still holds the lock "
                    f"(find it with `fuser {run_dir / LOCK}`) and must end first")
    return message


class RunDirLock:
    """The exclusive lock of one run directory, held from `acquire` to `release` (module docstring)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write this process's holder record; RunDirBusyError naming the
        holder if a live run has it; a record left by a run that ended without releasing (crash,
        kill -9) is taken over with a warning on stderr."""
        path = self.run_dir / LOCK
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children
        except OSError as exc:
            raise RunDirError(f"run_dir={self.run_dir}: cannot create its lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            body = _read_body(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirBusyError(_busy_message(self.run_dir, body)) from None
            raise RunDirError(f"run_dir={self.run_dir}: cannot lock {path} ({exc.strerror}): its filesystem "
                              "does not support flock; put run_dir on one that does") from None
        left = _read_body(fd)
        if left.strip():
            print(f"warning: run_dir={self.run_dir}: taking over the lock left by {_holder_text(left)}, "
                  "which ended without releasing it (crashed or killed)", file=sys.stderr, flush=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Clear the holder record and drop the lock (the file stays: removing it would let a run
        that opened it before the removal lock a file no one else sees)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_run_dir_free(run_dir: Path) -> None:
    """RunDirBusyError naming the holder when a live run holds `run_dir`'s lock. Takes nothing (a
    shared flock, dropped at once): for checks before a launch."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirBusyError(_busy_message(Path(run_dir), _read_body(fd))) from None
    finally:
        os.close(fd)  # drops the shared lock if it was taken


@contextmanager
def hold_run_dir(run_dir: Path, rank: int) -> Iterator[None]:
    """All ranks, around the whole run: global rank 0 holds `run_dir`'s lock (the other ranks
    write nothing a second run could collide on without rank 0's files); a refusal is broadcast so
    every rank raises the same RunDirError instead of waiting on rank 0 in a collective."""
    lock = RunDirLock(run_dir) if rank == 0 else None
    refusal: list = [None]
    if lock is not None:
        try:
            lock.acquire()
        except RunDirError as exc:
            refusal = [exc]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise refusal[0]
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
