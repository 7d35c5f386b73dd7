"""Run a test worker script under `torchrun --nproc-per-node N` on gloo and surface its output."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil

from megatron_fp8rl.compat.tcp_store import free_port

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float = 600,
                 expect_failure: bool = False) -> str:
    """Start `script` in `nproc` processes on one node; return combined output.

    Raises with the output when the run fails (or, with `expect_failure`, when it succeeds).
    Every process of the run carries a marker in its environment and is killed at the end: a
    worker that dies hard (SIGKILL) leaves helper processes (dist_checkpointing's multiprocessing
    Manager) that would otherwise outlive the test, and torchrun puts each worker in a session of
    its own, so killing the launcher's process group does not reach them.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(script), *args,
    ]
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGATRON_FP8RL_TEST_RUN=marker)
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        finally:
            kill_marked(marker)
        log.seek(0)
        output = log.read()
    if (returncode != 0) != expect_failure:
        expectation = "to fail" if expect_failure else "to succeed"
        raise AssertionError(f"torchrun {script.name} x{nproc} exited {returncode}, expected it "
                             f"{expectation}:\n{output[-6000:]}")
    return output


def marked_processes(marker: str) -> list[psutil.Process]:
    """Every process whose environment carries this run's marker (MEGATRON_FP8RL_TEST_RUN)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MEGATRON_FP8RL_TEST_RUN") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries this run's marker."""
    for proc in marked_processes(marker):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
