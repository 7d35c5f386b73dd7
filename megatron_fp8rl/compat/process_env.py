"""Environments for processes started from inside a torchrun worker.

Owns: `without_torchrun_env` / `torchrun_free_env`. Must not import anything of ours above L1.

A child process that inherits torchrun's variables calls `init_process_group` as if it were a
member of the parent's job: with TORCHELASTIC_USE_AGENT_STORE=True it waits forever on the
elastic agent's store (seen: SGLang's scheduler, and a checkpoint-conversion subprocess the trainer
once started, hung in `_create_c10d_store` when started from a torchrun worker).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_")
_NAMES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _is_torchrun_var(name: str) -> bool:
    return name.startswith(_PREFIXES) or name in _NAMES


def torchrun_free_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) without torchrun's rendezvous variables."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not _is_torchrun_var(k)}


@contextlib.contextmanager
def without_torchrun_env() -> Iterator[None]:
    """Hide torchrun's variables from os.environ while children are spawned; restore after."""
    hidden = {k: v for k, v in os.environ.items() if _is_torchrun_var(k)}
    for name in hidden:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(hidden)
