"""The stability study's runner (study/runner.py), no training but the process test: the train command,
killing what a run left behind, reusing a finished run only with its arm's settings, the --hours
budget, and what --report-only reports. (The arms themselves: test_study_arms.py.)"""
import json
import time

import pytest

from megatron_fp8rl.study.runner import train_command
from megatron_fp8rl.study.arms import FULL, QUICK, Setting, study_settings
from tests.helpers.processes import REPO
from tests.helpers.study_runs import arm_config


def test_train_command_puts_user_overrides_last(tmp_path):
    setting = Setting("s", ("algorithm.correction=tis",))
    command = train_command(setting, tmp_path / "s", tmp_path / "m", QUICK, ["algorithm.correction=mis"], 1, seed=7)
    assert command[command.index("--module") + 1:command.index("--module") + 3] == ["megatron_fp8rl.cli", "train"]
    assert command.index("algorithm.correction=tis") < command.index("algorithm.correction=mis")
    cfg = arm_config(command[command.index("train") + 1:])
    assert cfg.algorithm.correction == "mis" and cfg.train.seed == 7


@pytest.mark.multiprocess
def test_run_setting_kills_what_the_run_left_behind(tmp_path):
    """A grandchild that drops the environment marker and outlives its parent (as SGLang's
    renamed scheduler can) is killed once the run ends."""
    import sys
    import time

    import psutil

    from megatron_fp8rl.study.runner import run_setting

    pid_file = tmp_path / "grandchild.pid"
    parent = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], env={},"
              " start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(5)\n")
    assert run_setting([sys.executable, "-c", parent], tmp_path / "log", timeout_s=60) == 0
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "grandchild still running"
        time.sleep(0.2)


def test_a_finished_run_is_reused_only_with_the_same_settings(tmp_path):
    from megatron_fp8rl.config.loader import save_config
    from megatron_fp8rl.study.runner import config_differences

    setting = next(s for s in study_settings() if s.name == "tensorwise")
    command = train_command(setting, tmp_path, tmp_path / "m", FULL, [], 1, seed=2)
    overrides = command[command.index("train") + 1:]
    save_config(arm_config(overrides), tmp_path / "config.yaml")  # what `train` writes
    assert config_differences(tmp_path, overrides) == []
    other = train_command(setting, tmp_path, tmp_path / "m", {**FULL, "train.lr": "5e-5"}, ["rollout.fp8=blockwise"],
                          1, seed=3)
    differs = config_differences(tmp_path, other[other.index("train") + 1:])
    assert len(differs) == 3 and differs[0].startswith("train.lr: run has 3e-05") and "train.seed" in differs[1]
    assert differs[2] == "rollout.fp8: run has 'per_tensor', the study sets blockwise"  # a string value


@pytest.mark.parametrize("arm", ["tensorwise_cc", "tensorwise_noise"])
def test_a_committed_run_with_the_old_flat_keys_matches_its_arm(arm):
    """results/stability/<arm>/seed1/config.yaml was written before the algorithm groups were
    nested (algorithm.clip_calibration, ...): the arm's renamed overrides find their values there
    under the old keys, so the study reuses the run rather than calling it another setting."""
    from megatron_fp8rl.study.runner import config_differences

    run_dir = REPO / "results" / "stability" / arm / "seed1"
    assert "clip_calibration: " in (run_dir / "config.yaml").read_text()  # the old layout
    setting = next(s for s in study_settings() if s.name == arm)
    overrides = [o for o in setting.overrides if o.startswith("algorithm.")]
    assert any(o.startswith("algorithm.calibration.") for o in overrides)
    assert config_differences(run_dir, overrides) == []
    assert config_differences(run_dir, ["algorithm.calibration.every=2"]) == [
        "algorithm.calibration.every: run has 1, the study sets 2"]
    # the run predates calibration.record (what a run writes, not how it trains): still the arm's run
    assert "record" not in (run_dir / "config.yaml").read_text()
    assert "algorithm.calibration.record=true" in setting.overrides


def test_hours_budget_counts_the_longest_finished_run():
    from megatron_fp8rl.study.runner import hours_left

    now = time.monotonic()
    assert hours_left(None, now - 10_000, {"a": 9e9})  # no budget
    assert hours_left(1.0, now - 10_000, {})  # nothing timed yet: the first run measures
    assert hours_left(1.0, now - 600, {"a": 1200.0, "b": 2400.0})  # 10 + 40 min <= 60
    assert not hours_left(1.0, now - 1500, {"a": 1200.0, "b": 2400.0})  # 25 + 40 min > 60


def _finished_run(run_dir):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tb"))
    for step in (1, 2):
        writer.add_scalar("reward/mean", 0.25 * step, step)
        writer.add_scalar("train/entropy", 1.0, step)
    writer.close()
    (run_dir / "eval_correct.json").write_text(json.dumps({"0": [0, 1], "2": [1, 1]}))
    (run_dir / "summary.json").write_text("{}")


def test_report_only_reports_what_finished_and_names_the_missing_runs(tmp_path, capsys):
    from megatron_fp8rl.study.runner import main

    _finished_run(_mkdir(tmp_path / "bf16" / "seed1"))
    assert main(["--study-dir", str(tmp_path), "--settings", "bf16,tensorwise", "--seeds", "1",
                 "--report-only", "--model", str(tmp_path / "no-model")]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 runs finished; missing: tensorwise/seed1" in out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| bf16 | 1 |" in report and "| tensorwise |" not in report
    assert not (tmp_path / "tensorwise").exists()  # nothing trained


def test_a_report_after_a_selected_arm_still_covers_every_finished_run(tmp_path, capsys):
    """`--settings tensorwise --seeds 2` trains (here: reports) one arm and seed; the regime's
    report it rewrites must keep the other arms' and seeds' finished runs, not shrink to that arm."""
    from megatron_fp8rl.study.runner import main

    _finished_run(_mkdir(tmp_path / "bf16" / "seed1"))
    _finished_run(_mkdir(tmp_path / "bf16" / "seed3"))
    _finished_run(_mkdir(tmp_path / "tensorwise" / "seed2"))
    assert main(["--study-dir", str(tmp_path), "--settings", "tensorwise", "--seeds", "2",
                 "--report-only", "--model", str(tmp_path / "no-model")]) == 0
    assert "1 of 1 runs finished" in capsys.readouterr().out  # the selection's own count
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| bf16 | 2 |" in report and "| tensorwise | 1 |" in report


def test_hours_starts_no_run_that_would_end_past_the_budget(tmp_path, capsys):
    """A run that does not fit is not started (a started one would fail here at once: the model
    folder is no model) and the command says how to go on."""
    from megatron_fp8rl.study.runner import main

    model = _mkdir(tmp_path / "model")
    (model / "config.json").write_text("{}")
    (tmp_path / "timings.json").write_text(json.dumps({"bf16/seed1": 7200.0}))
    assert main(["--study-dir", str(tmp_path), "--settings", "tensorwise", "--seeds", "1", "--hours", "1",
                 "--model", str(model), "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert "tensorwise/seed1: not started, it would end past --hours 1 (a run takes up to 120 min)" in out
    assert "0 of 1 runs finished; missing: tensorwise/seed1" in out and not (tmp_path / "tensorwise").exists()


def _mkdir(path):
    path.mkdir(parents=True)
    return path


