"""Fault injection: the SGLang server of a disaggregated run is SIGKILLed mid-run; the trainer
stops with an error naming the rollout server (non-zero exit), and the same command run again
resumes from the last checkpoint and finishes every step.

Starts torchrun with 1 process twice; each run's rank 0 starts one SGLang server (1 process + 2
SGLang children).
"""
import os
import signal
import subprocess
import time
import uuid

import pytest

from tests.helpers.processes import REPO, cmdline, kill_marked, marked_processes
from tests.helpers.train import train_command

SETTINGS = ("train.steps=4", "checkpoint.every=1", "train.eval_every=0", "rollout.mode=disaggregated",
            "rollout.weight_transfer=distributed")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(2400)
def test_killed_rollout_server_is_reported_and_the_rerun_resumes(tiny_run_inputs, tmp_path):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGATRON_FP8RL_TEST_RUN=marker)
    latest = run_dir / "checkpoints" / "latest"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(train_command(tiny_run_inputs, run_dir, *SETTINGS), stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while not (latest.is_file() and latest.read_text().strip() == "step_00000001"):
            assert proc.poll() is None, f"run ended (code {proc.returncode}) before checkpoint 1"
            assert time.monotonic() < deadline, "no checkpoint within 1200 s"
            time.sleep(0.2)
        servers = [p for p in marked_processes(marker) if "megatron_fp8rl.rollout.sglang_launch" in cmdline(p)]
        assert len(servers) == 1
        servers[0].send_signal(signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        kill_marked(marker)
    output = (tmp_path / "killed.log").read_text()
    assert code != 0
    assert "SGLang server" in output and "RolloutEngineError" in output, output[-4000:]
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    result = subprocess.run(train_command(tiny_run_inputs, run_dir, *SETTINGS), capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))[-1] == "step_00000004"
    assert done and " 0/4 " not in result.stderr  # continued from a checkpoint, not from step 0
    print(f"checkpoints when the server was killed: {done}; the error: "
          f"{[line for line in output.splitlines() if 'RolloutEngineError:' in line][-1:]}")
