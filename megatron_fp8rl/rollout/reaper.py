"""Processes that must not outlive this one, even when it is killed with SIGKILL.

Owns: `die_with_parent` (a Popen preexec_fn: Linux PR_SET_PDEATHSIG) and `Reaper`, a small
subprocess that SIGKILLs given pids or process groups (negative numbers, as os.kill takes them)
when this process dies: for processes started by a library we do not control, such as SGLang's
scheduler and detokenizer, which would otherwise keep their memory and ports after a kill -9.
The reaper gets SIGTERM from the kernel when its parent thread dies, kills its list and exits;
`stop()` ends it without killing anything.
Must not import: convert, data, trainer, cli.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
_REAPER = """
import os, signal, sys
targets = [int(t) for t in sys.argv[1:]]
def reap(signum, frame):
    for target in targets:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os._exit(0)
signal.signal(signal.SIGTERM, reap)
if os.getppid() == 1:  # the parent died before the death signal was armed
    reap(None, None)
print("armed", flush=True)
while True:
    signal.pause()
"""


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """preexec_fn: deliver `signum` to the child when the thread that started it dies (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signum)


class Reaper:
    """`Reaper(targets)`: SIGKILL `targets` (pids; -pgid for a process group) if this process dies."""

    def __init__(self, targets: list[int]):
        self._proc = subprocess.Popen([sys.executable, "-c", _REAPER, *map(str, targets)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        if self._proc.stdout.readline().strip() != b"armed":
            raise RuntimeError("the reaper process did not start")

    def stop(self) -> None:
        """End the reaper without killing its targets. Idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()
