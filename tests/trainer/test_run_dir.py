"""A run directory remembers what it was made from: reusing it with another model (even one with
the same config.json and shapes) or another config is refused naming both; the same inputs under a
moved path continue it. The end-to-end case starts torchrun with 1 process and fails before any
SGLang process starts."""
import json
import shutil
import subprocess
import sys

import pytest

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.run_dir import PROVENANCE, RunDirError, check_run_dir, claim_run_dir
from tests.helpers.processes import REPO, meet_permission_bits
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
