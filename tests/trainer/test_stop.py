"""Told to stop, a run stops: SIGTERM to the trainer during a 30-step run ends it after the
current step with a checkpoint, SGLang's processes shut down, and a non-zero exit (before: SGLang's
handler swallowed SIGTERM and the run went on to step 30, exit 0).

Starts torchrun with 1 process; its rank 0 starts the in-process SGLang engine (2 children).
"""
import os
import signal
import subprocess
import time
import uuid

import pytest

from megatron_fp8rl.trainer.checkpoint import checkpoint_problem
from tests.helpers.processes import REPO, cmdline, kill_marked, marked_processes
from tests.helpers.train import train_command


def _wait_for(condition, proc, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.5)


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_sigterm_stops_after_the_step_with_a_checkpoint(tiny_run_inputs, tmp_path):
    marker, log_path, run_dir = uuid.uuid4().hex, tmp_path / "run.log", tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGATRON_FP8RL_TEST_RUN=marker)
    cmd = train_command(tiny_run_inputs, run_dir, "train.steps=30", "train.eval_every=0", "checkpoint.every=100")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    try:
        _wait_for(lambda: " 1/30 " in log_path.read_text(), proc, 900, "step 1")
        trainer = [p for p in marked_processes(marker) if "train" in cmdline(p) and p.pid != proc.pid
                   and p.ppid() == proc.pid]
        assert len(trainer) == 1, [cmdline(p) for p in marked_processes(marker)]
        trainer[0].send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        time.sleep(2)  # let the shutdown finish before looking for leftovers
        leftovers = [line[:3] for line in map(cmdline, marked_processes(marker)) if line]
        kill_marked(marker)
    output = log_path.read_text()
    assert code != 0, output[-3000:]
    stopped = [line for line in output.splitlines() if "stopped by SIGTERM after step" in line]
    assert stopped, output[-3000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 1 <= step < 30
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    assert checkpoint_problem(checkpoint) is None
    assert leftovers == []  # the SGLang scheduler and detokenizer went down with the run
