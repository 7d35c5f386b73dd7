"""Processes started for us by a library die with us, even on kill -9: a parent that armed a
Reaper over a child and over a process group is SIGKILLed; both are gone within seconds. The test
starts 1 parent, 2 children (one in its own process group) and the reaper."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[2]
PARENT = """
import subprocess, sys, time
from megatron_fp8rl.rollout.reaper import Reaper
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
reaper = Reaper([child.pid, -group.pid])
print(child.pid, group.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_children_die_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    pids = [int(p) for p in parent.stdout.readline().split()]
    try:
        assert not any(_gone(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_stop_leaves_the_targets_alone():
    from megatron_fp8rl.rollout.reaper import Reaper

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        Reaper([child.pid]).stop()
        time.sleep(0.5)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
