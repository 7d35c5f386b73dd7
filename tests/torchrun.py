"""Run a test worker script under `torchrun --nproc-per-node N` on gloo and surface its output."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float = 600) -> str:
    """Start `script` in `nproc` processes on one node; return combined output; fail with it."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(script), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} x{nproc} exited {proc.returncode}:\n{output[-6000:]}")
    return output
