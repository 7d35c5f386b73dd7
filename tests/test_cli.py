"""The README's main job: `megatron-fp8rl demo` under torchrun learns the built-in task and writes
tensorboard logs."""
import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_fp8rl.cli import build_parser
from tests.torchrun import run_torchrun

CLI = Path(__file__).resolve().parents[1] / "megatron_fp8rl" / "cli.py"


@pytest.mark.multiprocess
def test_demo_tp2_learns_and_logs(tmp_path):
    """2 processes (TP=2): 40 steps bring the loss well below uniform guessing."""
    output = run_torchrun(CLI, 2, "demo", "--tensor-parallel", "2", "--steps", "40",
                          "--run-dir", str(tmp_path / "tb"))
    summary = json.loads(re.search(r"^\{.*?^\}", output, re.S | re.M).group(0))
    assert summary["tensor_parallel"] == 2
    assert summary["initial_loss"] > 0.9 * summary["uniform_loss"]
    assert summary["final_loss"] < 0.8 * summary["initial_loss"]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 40
    assert {"train/grad_norm", "time/step_s"} <= set(events.Tags()["scalars"])


def test_parser_rejects_unknown_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["no-such-command"])
    assert "invalid choice" in capsys.readouterr().err
