"""Exact resume of the RL loop: a run SIGKILLed after its step-2 checkpoint and resumed produces
the same per-step metrics as an uninterrupted run (tiny random Llama, sampled rollouts at
temperature 1 from an SGLang server with deterministic inference and per-step seeds).

Starts torchrun with 1 process three times (uninterrupted, killed, resumed); each run's rank 0
starts one SGLang server (1 process + 2 SGLang children).
"""
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.processes import REPO, kill_marked
from tests.helpers.train import run_train, train_command

STEPS = 4
SETTINGS = ("train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=1", "train.eval_every=2",
            "rollout.mode=disaggregated", "rollout.weight_transfer=distributed", "rollout.deterministic=true",
            "rollout.temperature=1.0")
# Everything a step computes; timings and throughput are the only metrics allowed to differ.
VARYING = ("time/", "perf/")


def _per_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {tag: value}; a step logged twice (before a crash, then after resume) keeps the
    later file's value."""
    steps: dict[int, dict[str, float]] = {}
    for events_file in sorted((run_dir / "tb").glob("events.out.tfevents.*"), key=os.path.getmtime):
        events = EventAccumulator(str(events_file))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                steps.setdefault(event.step, {})[tag] = event.value
    return steps


def _start_and_kill_after_checkpoint(inputs, run_dir: Path, checkpoint_step: int) -> None:
    """Start the same run in the background; SIGKILL every one of its processes (trainer, server,
    SGLang children) once checkpoint `checkpoint_step` is the latest."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGATRON_FP8RL_TEST_RUN=marker)
    cmd = train_command(inputs, run_dir, *SETTINGS)
    latest = run_dir / "checkpoints" / "latest"
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 1200
            while not (latest.is_file() and latest.read_text().strip() == f"step_{checkpoint_step:08d}"):
                assert proc.poll() is None, f"run ended (code {proc.returncode}) before checkpoint {checkpoint_step}"
                assert time.monotonic() < deadline, "no checkpoint within 1200 s"
                time.sleep(0.2)
            time.sleep(1.0)  # into step checkpoint_step + 1
        finally:
            kill_marked(marker)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL or proc.returncode != 0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(3600)  # three runs of ~1-5 minutes each, ~15 on a loaded 2-core box
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tiny_run_inputs, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_train(tiny_run_inputs, straight, 1, *SETTINGS)
    crashed.mkdir()
    _start_and_kill_after_checkpoint(tiny_run_inputs, crashed, checkpoint_step=2)
    summary = run_train(tiny_run_inputs, crashed, 1, *SETTINGS)
    want, got = _per_step(straight), _per_step(crashed)
    assert sorted(want) == sorted(got) == list(range(STEPS + 1))
    for step in range(3, STEPS + 1):
        expected = {k: v for k, v in want[step].items() if not k.startswith(VARYING)}
        found = {k: v for k, v in got[step].items() if not k.startswith(VARYING)}
        assert {"reward/mean", "train/pg_loss", "train/grad_norm", "train/mismatch_abs_logprob_diff_mean"} <= set(expected)
        assert ("eval/accuracy" in expected) == (step % 2 == 0)  # train.eval_every=2
        # bit-identical: same rollouts (seeded), same weights, optimizer and data position restored
        assert found == expected, {k: (expected[k], found.get(k)) for k in expected if found.get(k) != expected[k]}
    assert summary["reward/mean"] == want[STEPS]["reward/mean"]
