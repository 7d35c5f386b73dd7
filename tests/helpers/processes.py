"""Processes the tests start: a worker script under `torchrun --nproc-per-node N` on gloo (its
output surfaced, every process it left killed), and children that meet file permission bits."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil

from megatron_fp8rl.compat.tcp_store import free_port

REPO = Path(__file__).resolve().parents[2]
_PR_CAPBSET_DROP = 24
_PERMISSION_BYPASSES = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def meet_permission_bits() -> None:
    """Popen preexec_fn: the child meets file permission bits even when the tests run as root
    (CI containers do), by dropping the capabilities that bypass them from its bounding set
    before exec; for any other user a no-op. Raises when the drop is refused."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for capability in _PERMISSION_BYPASSES:
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"cannot drop capability {capability}")


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
    """Every live process whose environment carries this run's marker (MEGATRON_FP8RL_TEST_RUN);
    exited ones not yet reaped (zombies) are left out."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.environ().get("MEGATRON_FP8RL_TEST_RUN") == marker
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def cmdline(proc: psutil.Process) -> list[str]:
    """proc's command line, or [] when it exited after it was listed (a short-lived child: a
    test that read `proc.cmdline()` directly failed with ZombieProcess)."""
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries this run's marker."""
    for proc in marked_processes(marker):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
