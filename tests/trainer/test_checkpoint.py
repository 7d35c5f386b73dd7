"""Checkpoints: a run SIGKILLed mid-step resumes from the last complete checkpoint and reproduces
the uninterrupted run's losses; interrupted saves are invisible; pruning keeps the last K.

Starts torchrun workers (tests/workers/checkpoint_resume.py), 2 processes each (DP=2, distributed
optimizer): one uninterrupted run, one killed run, one resumed run.
"""
import json
from pathlib import Path

import pytest

from tests.helpers.processes import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "checkpoint_resume.py"


def _losses(workdir: Path, tag: str) -> dict[str, float]:
    return json.loads((workdir / f"{tag}.json").read_text())


@pytest.mark.multiprocess
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    run_torchrun(WORKER, 2, str(tmp_path), "full", "--steps", "6")
    run_torchrun(WORKER, 2, str(tmp_path), "killed", "--steps", "6", "--ckpt-every", "2",
                 "--kill-at", "5", expect_failure=True)
    ckpt = tmp_path / "ckpt_killed"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert (ckpt / "latest").read_text().strip() == "step_00000004"
    assert sorted(_losses(tmp_path, "killed")) == ["1", "2", "3", "4"]
    run_torchrun(WORKER, 2, str(tmp_path), "resumed", "--steps", "6", "--ckpt-every", "2",
                 "--resume", str(ckpt))
    full, resumed = _losses(tmp_path, "full"), _losses(tmp_path, "resumed")
    assert sorted(resumed) == ["5", "6"]
    # same arithmetic in the same order: equal to the last bit
    assert resumed == {step: full[step] for step in ("5", "6")}
    # keep_last=2: the resumed run's saves at 6 pruned step 2
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]


def test_resume_ignores_interrupted_saves(tmp_path):
    from megatron_fp8rl.trainer.checkpoint import newest_intact_checkpoint

    assert newest_intact_checkpoint(tmp_path) == (None, [])
    (tmp_path / ".tmp-step_00000007").mkdir()  # an interrupted save is not a candidate
    (tmp_path / "latest").write_text("step_00000007\n")
    assert newest_intact_checkpoint(tmp_path) == (None, [])
