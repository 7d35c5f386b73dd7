"""The GPT warm-up: `megatron-fp8rl demo` under torchrun learns the built-in task and writes
tensorboard logs."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_fp8rl.cli import build_parser
from tests.helpers.processes import REPO, run_torchrun

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


def test_help_imports_neither_torch_nor_megatron():
    """Before: 7-26 s, the parser imported megatron.core."""
    script = ("import sys\nfrom megatron_fp8rl.cli import main\n"
              "for argv in (['--help'], ['train', '--help'], ['export-fp8', '--help'], ['convert', 'megatron-to-hf', '--help']):\n"
              "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
              "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_parser_constants_match_the_converters():
    from megatron_fp8rl.convert import cli_commands, fp8_export, megatron_to_hf

    assert cli_commands.EXPORT_SCHEMES == fp8_export.SCHEMES
    assert cli_commands.DEFAULT_SHARD_GB * 2**30 == megatron_to_hf.DEFAULT_SHARD_BYTES


def test_expected_library_warnings_are_quiet_here_and_in_started_processes():
    """Before: Megatron's TE/Apex and SGLang's CUDA-only warnings printed from SGLang's spawned
    scheduler, which does not inherit this process's filters. Other warnings still show."""
    import warnings

    from megatron_fp8rl.cli import _quiet_known_library_warnings

    env = {"PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore::ResourceWarning"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quiet_known_library_warnings(env)
        _quiet_known_library_warnings(env)  # idempotent
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("an unexpected library warning")
    assert [str(w.message) for w in caught] == ["an unexpected library warning"]
    assert env["PYTHONWARNINGS"].startswith("ignore::ResourceWarning,")
    assert len(env["PYTHONWARNINGS"].split(",")) == 10
    child = ("import warnings; warnings.warn('Only CUDA, HIP and XPU support AWQ currently.'); "
             "warnings.warn('`torch.distributed.all_gather_into_tensor` is deprecated.', FutureWarning); "
             "warnings.warn('an unexpected library warning')")
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True)
    assert "an unexpected library warning" in result.stderr
    assert "Only CUDA" not in result.stderr and "torch.distributed" not in result.stderr


def test_sglang_sigquit_notice_is_dropped_and_its_errors_still_show(caplog):
    """Before: every SGLang start logged 'Using custom SIGQUIT handler: ...' at ERROR level."""
    import logging

    from megatron_fp8rl.cli import _quiet_known_library_logs

    _quiet_known_library_logs()
    logger = logging.getLogger("sglang.srt.entrypoints.engine")
    with caplog.at_level(logging.ERROR, logger="sglang.srt.entrypoints.engine"):
        logger.error("Using custom SIGQUIT handler: <bound method SGLangEngine._on_signal>")
        logger.error("Scheduler hit an exception: Traceback ...")
    assert [record.getMessage() for record in caplog.records] == ["Scheduler hit an exception: Traceback ..."]


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter (one process)."""
    return subprocess.run([sys.executable, "-m", "megatron_fp8rl.cli", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv, error", [
    (["algorithm.clip_low=0.2"], "error: override: 'algorithm.clip_low' was renamed: use 'algorithm.clip.low'"),
    (["model.hf_path=/nonexistent/model"], "error: model.hf_path=/nonexistent/model: no config.json (not an HF "
                                           "checkpoint folder)"),
    (["model.hf_path=/nonexistent/model", "model.tensor_parallel=2"],
     "error: tensor_parallel (2) x pipeline_parallel (1) = 2 does not divide the world size 3"),
])
def test_launch_prints_a_bad_config_as_its_error_line_alone(argv, error, tmp_path):
    """What scripts/demo.sh execs, with a bad override: checked before torchrun starts any worker
    (before: the error line, then torchrun's 30-line ChildFailedError traceback). 1 process."""
    done = _cli("launch", "--nproc-per-node=3", "--config", "examples/cpu_demo.yaml", f"run_dir={tmp_path}", *argv)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", error + "\n")


@pytest.mark.multiprocess
def test_a_user_error_under_torchrun_prints_from_rank_0_only():
    """Every torchrun worker meets the same config error; one line is enough. 2 processes."""
    bad = ("train", "algorithm.clip_low=0.2")
    quiet = _cli(*bad, env={"RANK": "1"})
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (2, "", "")
    assert _cli(*bad, env={"RANK": "0"}).stderr.splitlines() == [
        "error: override: 'algorithm.clip_low' was renamed: use 'algorithm.clip.low'"]
