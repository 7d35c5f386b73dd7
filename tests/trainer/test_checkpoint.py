"""Checkpoints: a run SIGKILLed mid-step resumes from the last complete checkpoint and reproduces
the uninterrupted run's losses; interrupted saves are invisible; pruning keeps the last K.

Starts torchrun workers (tests/workers/checkpoint_resume.py), 2 processes each (DP=2, distributed
optimizer): one uninterrupted run, one killed run, one resumed run.
"""
import json
from pathlib import Path

import pytest

from tests.torchrun import run_torchrun

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


def test_latest_ignores_incomplete_saves(tmp_path):
    from megatron_fp8rl.trainer.checkpoint import TRAINER_STATE, latest_checkpoint

    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / TRAINER_STATE).write_text("{}")
    (tmp_path / "step_00000005").mkdir()  # a directory without trainer state: not complete
    (tmp_path / ".tmp-step_00000007").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    (tmp_path / "latest").write_text("step_00000005\n")  # a pointer to an incomplete one
    assert latest_checkpoint(tmp_path).name == "step_00000003"


def test_config_rejects_bad_values():
    from megatron_fp8rl.trainer.checkpoint import CheckpointConfig

    with pytest.raises(ValueError, match="only 'dp_reshardable'"):
        CheckpointConfig(dir="x", optimizer_sharding="fully_reshardable")
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        CheckpointConfig(dir="x", keep_last=0)
