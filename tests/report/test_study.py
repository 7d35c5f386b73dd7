"""The stability study's settings and commands (no training): every setting's overrides are valid
keys and values of the real run config, names select settings, bad specs fail clearly."""
import argparse

import pytest

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.report.study import (
    COMMON, FULL, OPTIONAL, QUICK, Setting, parse_added_setting, select_settings, study_settings,
    train_command,
)
from megatron_fp8rl.trainer.config import RunConfig


def _config(overrides):
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in COMMON.items()] + list(overrides))


def test_the_issue_settings():
    names = [s.name for s in study_settings()]
    assert names == [f"{p}_{c}" for p in ("bf16_bf16", "bf16_fp8block", "tedelayed_fp8block",
                                          "calibrated_aligned") for c in ("none", "tis")]
    by_name = {s.name: _config(["model.hf_path=m", *s.overrides]) for s in study_settings()}
    te = by_name["tedelayed_fp8block_tis"]
    assert (te.model.fp8, te.rollout.fp8, te.algorithm.correction) == ("te_delayed", "blockwise", "tis")
    aligned = by_name["calibrated_aligned_none"]
    assert (aligned.model.fp8, aligned.rollout.fp8, aligned.algorithm.correction) == ("calibrated", "aligned", "none")
    assert not aligned.algorithm.dynamic_sampling  # same prompt stream in every setting


@pytest.mark.parametrize("sizes", [FULL, QUICK], ids=["full", "quick"])
def test_sizes_and_all_settings_are_valid_config(sizes):
    for overrides in [s.overrides for s in study_settings()] + [o for _, o in OPTIONAL]:
        cfg = _config([f"{k}={v}" for k, v in sizes.items()] + ["model.hf_path=m", *overrides])
        # a batch that splits into whole micro-batches: no all-padding micro-batch, whose NaN
        # ratio quantiles would drop the step from the logs
        assert cfg.data.prompts_per_step * cfg.rollout.n_samples % cfg.train.micro_batch_size == 0


def test_selection_and_added_settings():
    added = parse_added_setting("mine:model.fp8=calibrated,algorithm.correction=mis")
    assert added == Setting("mine", ("model.fp8=calibrated", "algorithm.correction=mis"))
    assert [s.name for s in select_settings("mine,bf16_bf16_tis", [added])] == ["mine", "bf16_bf16_tis"]
    assert len(select_settings(None, [added])) == 9
    assert select_settings(OPTIONAL[0][0], [])[0].name == OPTIONAL[0][0]
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        select_settings("nope", [])
    for bad in ("no-colon", ":model.fp8=none", "x:model.fp8"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME:key=value"):
            parse_added_setting(bad)


def test_train_command_puts_user_overrides_last(tmp_path):
    setting = Setting("s", ("algorithm.correction=tis",))
    command = train_command(setting, tmp_path / "s", tmp_path / "m", QUICK, ["algorithm.correction=mis"], 1)
    assert command[command.index("--module") + 1:command.index("--module") + 3] == ["megatron_fp8rl.cli", "train"]
    assert command.index("algorithm.correction=tis") < command.index("algorithm.correction=mis")
    assert _config(command[command.index("train") + 1:]).algorithm.correction == "mis"


@pytest.mark.multiprocess
def test_run_setting_kills_what_the_run_left_behind(tmp_path):
    """A grandchild that drops the environment marker and outlives its parent (as SGLang's
    renamed scheduler can) is killed once the run ends."""
    import sys
    import time

    import psutil

    from megatron_fp8rl.report.study import run_setting

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
