"""A run directory remembers what it was made from: reusing it with another model (even one with
the same config.json and shapes) or another config is refused naming both; the same inputs under a
moved path continue it. The end-to-end case starts torchrun with 1 process and fails before any
SGLang process starts. A run_dir has one owner: the lock tests start one holder process each (and,
for `launch`, one CLI process) besides the test's own."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.run_dir import (LOCK, PROVENANCE, RunDirBusyError, RunDirError, RunDirLock,
                                            check_run_dir, check_run_dir_free, claim_run_dir, hold_run_dir)
from tests.helpers.processes import REPO, kill_marked, meet_permission_bits
from tests.helpers.train import base_train_args
from tests.helpers.tiny_models import build_tiny_model


def _cfg(model, run_dir, **train):
    overrides = [f"model.hf_path={model}", f"run_dir={run_dir}"]
    return load_config(RunConfig, None, overrides + [f"train.{k}={v}" for k, v in train.items()])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": build_tiny_model("llama", root / "a", seed=0),
            "a_finetuned": build_tiny_model("llama", root / "a_finetuned", seed=1),
            "qwen3": build_tiny_model("qwen3", root / "qwen3")}


def test_other_model_is_refused_naming_both(models, tmp_path):
    claim_run_dir(tmp_path, check_run_dir(_cfg(models["a"], tmp_path)))
    for other in ("a_finetuned", "qwen3"):  # a_finetuned: same config.json, other weights
        with pytest.raises(RunDirError, match=rf"made from model.hf_path={models['a']}; this run's "
                                              rf"model.hf_path={models[other]} is a different checkpoint"):
            check_run_dir(_cfg(models[other], tmp_path))


def test_same_model_moved_and_same_config_continue(models, tmp_path):
    claim_run_dir(tmp_path / "run", check_run_dir(_cfg(models["a"], tmp_path / "run")))
    moved = shutil.copytree(models["a"], tmp_path / "moved")
    check_run_dir(_cfg(moved, tmp_path / "run"))


def test_changed_config_is_refused_unless_asked(models, tmp_path):
    claim_run_dir(tmp_path, check_run_dir(_cfg(models["a"], tmp_path)))
    with pytest.raises(RunDirError, match=r"different config \(train.lr: 1e-05 -> 0.001\)"):
        check_run_dir(_cfg(models["a"], tmp_path, lr=1e-3))
    record = check_run_dir(_cfg(models["a"], tmp_path, lr=1e-3, resume_changed_config=True))
    assert record["config"]["train.lr"] == 1e-3


def test_keys_added_since_the_record_count_at_their_defaults(models, tmp_path):
    """A run recorded before train.adam_beta1 existed ran with its default: resuming it is no change."""
    claim_run_dir(tmp_path, check_run_dir(_cfg(models["a"], tmp_path)))
    record = json.loads((tmp_path / PROVENANCE).read_text())
    del record["config"]["train.adam_beta1"]
    (tmp_path / PROVENANCE).write_text(json.dumps(record))
    check_run_dir(_cfg(models["a"], tmp_path))
    with pytest.raises(RunDirError, match=r"different config \(train.adam_beta1: 0.9 -> 0.8\)"):
        check_run_dir(_cfg(models["a"], tmp_path, adam_beta1=0.8))


def test_a_run_recorded_before_a_key_was_renamed_resumes(models, tmp_path):
    """A record that holds algorithm.clip_high (before config/renamed.py) is read under its new
    name: the same value resumes, another is a change named by the new key."""
    claim_run_dir(tmp_path, check_run_dir(_cfg(models["a"], tmp_path)))
    record = json.loads((tmp_path / PROVENANCE).read_text())
    record["config"]["algorithm.clip_high"] = record["config"].pop("algorithm.clip.high")
    (tmp_path / PROVENANCE).write_text(json.dumps(record))
    check_run_dir(_cfg(models["a"], tmp_path))
    record["config"]["algorithm.clip_high"] = 0.2
    (tmp_path / PROVENANCE).write_text(json.dumps(record))
    with pytest.raises(RunDirError, match=r"different config \(algorithm.clip.high: 0.2 -> 0.28\)"):
        check_run_dir(_cfg(models["a"], tmp_path))


def test_previous_outputs_without_record_are_refused(models, tmp_path):
    (tmp_path / "init_megatron").mkdir()
    with pytest.raises(RunDirError, match="holds init_megatron but no provenance.json"):
        check_run_dir(_cfg(models["a"], tmp_path))


@pytest.mark.multiprocess
def test_unwritable_run_dir_is_refused_naming_it(models, tmp_path):
    """As the trainer calls them, in a process that meets permission bits (as root too): before,
    a PermissionError traceback naming the hidden `.provenance.json.tmp`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o555)
    script = ("import sys\nfrom pathlib import Path\n"
              "from megatron_fp8rl.config.loader import load_config\n"
              "from megatron_fp8rl.trainer.config import RunConfig\n"
              "from megatron_fp8rl.trainer.run_dir import check_run_dir, claim_run_dir\n"
              "cfg = load_config(RunConfig, None, [f'model.hf_path={sys.argv[1]}', f'run_dir={sys.argv[2]}'])\n"
              "claim_run_dir(Path(cfg.run_dir), check_run_dir(cfg))\n")
    done = subprocess.run([sys.executable, "-c", script, str(models["a"]), str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, preexec_fn=meet_permission_bits)
    assert (f"RunDirError: run_dir={run_dir}: permission denied: cannot create entries in {run_dir}"
            in done.stderr), done.stderr[-3000:]


@pytest.mark.multiprocess
def test_train_refuses_a_run_dir_of_another_model(models, tmp_path):
    """`train` into a run_dir claimed by another model exits non-zero naming both models."""
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir, check_run_dir(_cfg(models["qwen3"], run_dir)))
    (run_dir / "init_megatron").mkdir()  # what the first run left: the other model's weights
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
         f"--master-port={free_port()}", str(REPO / "megatron_fp8rl" / "cli.py"), "train",
         f"model.hf_path={models['a']}", f"run_dir={run_dir}", "data.eval_size=4"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode != 0
    assert f"made from model.hf_path={models['qwen3']}" in result.stdout + result.stderr


def test_more_steps_is_an_ordinary_resume(models, tmp_path):
    """Continuing a run to more steps (train.steps 1 -> 2) is not a config change; lr still is."""
    claim_run_dir(tmp_path, check_run_dir(_cfg(models["a"], tmp_path, steps=1)))
    check_run_dir(_cfg(models["a"], tmp_path, steps=2))
    with pytest.raises(RunDirError, match=r"train.lr"):
        check_run_dir(_cfg(models["a"], tmp_path, steps=2, lr=1e-3))


HOLDER = ("import sys, time\nfrom megatron_fp8rl.trainer.run_dir import RunDirLock\n"
          "with RunDirLock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n")
"""A run that holds its run_dir's lock for two minutes (the tests end it sooner)."""


@pytest.fixture
def holder(tmp_path):
    """A real process holding `tmp_path / "run"`'s lock; yields (its Popen, the run_dir)."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert process.stdout.readline() == "held\n"
        yield process, run_dir
    finally:
        process.kill()
        process.wait()


@pytest.mark.multiprocess
def test_a_second_run_on_a_held_run_dir_is_refused_naming_the_holder(holder):
    process, run_dir = holder
    named = rf"run_dir={run_dir} is in use by host {socket.gethostname()} pid {process.pid} \(started 20"
    with pytest.raises(RunDirBusyError, match=named):
        RunDirLock(run_dir).acquire()
    with pytest.raises(RunDirBusyError, match=named):
        check_run_dir_free(run_dir)
    with pytest.raises(RunDirBusyError, match=named), hold_run_dir(run_dir, rank=0):
        pytest.fail("the body of a refused hold ran")
    assert json.loads((run_dir / LOCK).read_text())["pid"] == process.pid  # the refusals left its record


@pytest.mark.multiprocess
def test_a_killed_holders_lock_is_taken_over_with_a_warning(holder, capsys):
    """kill -9 leaves the holder's record; the kernel dropped its flock, so the next run goes on."""
    process, run_dir = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    check_run_dir_free(run_dir)
    with RunDirLock(run_dir):
        assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirBusyError, match=f"pid {os.getpid()} "):
            RunDirLock(run_dir).acquire()  # another open of the file is another owner, even here
    assert (f"warning: run_dir={run_dir}: taking over the lock left by host {socket.gethostname()} pid "
            f"{process.pid} (started 20") in capsys.readouterr().err


FORKING_HOLDER = ("import os, sys, time\nfrom megatron_fp8rl.trainer.run_dir import RunDirLock\n"
                  "RunDirLock(sys.argv[1]).acquire()\nchild = os.fork()\n"
                  "if child == 0:\n    time.sleep(120)\n    os._exit(0)\n"
                  "print(child, flush=True)\ntime.sleep(120)\n")
"""A run that started a forked child (which shares its lock) before it was killed."""


@pytest.mark.multiprocess
def test_a_lock_kept_by_a_killed_runs_forked_child_is_named_as_such(tmp_path):
    """The holder's pid is gone, yet its lock is held (a fork of it lives on): refused, saying so.
    Starts the holder and its forked child."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(process.stdout.readline())
    try:
        process.send_signal(signal.SIGKILL)
        process.wait()
        with pytest.raises(RunDirBusyError, match=rf"pid {process.pid} .*; that pid is gone on this host, so a "
                                                  rf"process it started still holds the lock \(find it with `fuser"):
            RunDirLock(run_dir).acquire()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_released_lock_is_taken_without_a_warning(tmp_path, capsys):
    with hold_run_dir(tmp_path, rank=0):
        pass
    assert (tmp_path / LOCK).read_text() == ""
    with RunDirLock(tmp_path):
        pass
    assert capsys.readouterr().err == ""


def test_only_rank_0_takes_the_lock(tmp_path):
    with hold_run_dir(tmp_path, rank=1):
        assert not (tmp_path / LOCK).exists()


@pytest.mark.multiprocess
def test_launch_refuses_a_held_run_dir_in_one_line(models, holder):
    """The CLI (a third process) refuses before torchrun starts: one error line, exit 2."""
    process, run_dir = holder
    done = subprocess.run([sys.executable, "-m", "megatron_fp8rl.cli", "launch", "--nproc-per-node=1",
                           f"model.hf_path={models['a']}", f"run_dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [f"error: run_dir={run_dir} is in use by host {socket.gethostname()} "
                                        f"pid {process.pid} (started {json.loads((run_dir / LOCK).read_text())['started']}) "
                                        f"(lock {run_dir / LOCK}); wait for that run to end, or use another run_dir"]


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_a_resubmitted_run_is_refused_while_the_first_trains_to_its_end(tiny_run_inputs, tmp_path):
    """The user's case: the same `launch` twice on one run_dir (before: both trained into it to the
    end, exit 0). The second exits 2 at once naming the first's trainer; the first finishes.
    Starts the first run (torchrun, 1 worker, SGLang's 2 children) and the second CLI process."""
    marker, run_dir, log_path = uuid.uuid4().hex, tmp_path / "run", tmp_path / "first.log"
    command = [sys.executable, "-m", "megatron_fp8rl.cli", "launch", "--nproc-per-node=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *base_train_args(*tiny_run_inputs),
               f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGATRON_FP8RL_TEST_RUN=marker)
    with open(log_path, "w") as log:
        first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / LOCK).is_file() or not (run_dir / LOCK).read_text():
            assert first.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        holder = json.loads((run_dir / LOCK).read_text())
        second = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert (second.returncode, second.stdout) == (2, "")
        assert second.stderr.splitlines() == [
            f"error: run_dir={run_dir} is in use by host {holder['host']} pid {holder['pid']} (started "
            f"{holder['started']}) (lock {run_dir / LOCK}); wait for that run to end, or use another run_dir"]
        assert first.wait(timeout=900) == 0, log_path.read_text()[-3000:]
    finally:
        kill_marked(marker)
    assert (run_dir / LOCK).read_text() == ""  # released at the end
    assert (run_dir / "summary.json").is_file()


@pytest.mark.multiprocess
def test_only_a_single_node_launch_checks_the_lock_first(models, holder):
    """On several nodes, a later node's launcher may find the lock its own run's rank 0 already
    took: there the workers' lock decides. Starts the holder process."""
    from megatron_fp8rl.cli import _check_train

    process, run_dir = holder
    _check_train(_cfg(models["a"], run_dir), single_node=False)
    with pytest.raises(RunDirBusyError, match=f"pid {process.pid} "):
        _check_train(_cfg(models["a"], run_dir), single_node=True)
