"""The version gate (compat/versions.py): tested versions pass, anything else is refused by name
unless explicitly allowed, overrides assert the signatures they override, and the optimizer-state
walks raise instead of skipping."""
import subprocess
import sys

import pytest
import torch

from megatron_fp8rl.compat import versions
from megatron_fp8rl.compat.versions import ALLOW_ENV, UntestedVersionError
from tests.helpers.processes import REPO


@pytest.fixture
def torch_at_9(monkeypatch):
    """torch's installed version reads 9.9.9+cu999; the gate's allow-list is reset afterwards."""
    real = versions.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "9.9.9+cu999" if name == "torch" else real(name))
    monkeypatch.setattr(versions, "_allowed", versions._allowed)  # restored after the test


def test_this_install_passes_the_gate():
    found = versions.check_versions()
    assert found["torch"] == "2.13.0" and found["megatron-core"] == "0.16.1" and found["sglang"] == "0.5.23"
    assert "transformer-engine" not in found  # checked only when installed


def test_untested_version_is_refused_by_name_unless_allowed(torch_at_9):
    with pytest.raises(UntestedVersionError, match=f"torch 9.9.9 is installed.*tested with torch 2.13.0.*{ALLOW_ENV}=torch"):
        versions.check_versions()
    assert versions.check_versions(versions.allowed_from_env({ALLOW_ENV: "torch"}))["torch"] == "9.9.9"
    assert versions.check_versions({"all"})["torch"] == "9.9.9"


def test_unknown_override_name_is_refused():
    with pytest.raises(ValueError, match=f"{ALLOW_ENV}: unknown distributions \\['torchh'\\]"):
        versions.allowed_from_env({ALLOW_ENV: "torchh, sglang"})


def test_cli_runs_the_gate_first(torch_at_9, monkeypatch, capsys):
    from megatron_fp8rl.cli import main

    with pytest.raises(UntestedVersionError, match="torch 9.9.9"):
        main(["train", "model.hf_path=/x", "model.fp8=fp4"])
    monkeypatch.setenv(ALLOW_ENV, "torch")
    # past the gate, into the config: a user error, printed as one line with exit status 2
    assert main(["train", "model.hf_path=/x", "model.fp8=fp4"]) == 2
    assert "error: invalid config: model.fp8: 'fp4'" in capsys.readouterr().err


def test_signature_drift_raises():
    def theirs(input, weight, bias, new_flag=False):
        pass

    def ours(self, input, weight, bias):
        pass

    with pytest.raises(UntestedVersionError, match="what: the library's signature changed"):
        versions.check_signature(ours, theirs, "what")


@pytest.mark.multiprocess
def test_fp8_linear_override_refuses_a_new_megatron_argument():
    """A subprocess (importing the module twice in one process would split its classes):
    megatron's linear function gains a keyword; importing our override must fail loudly."""
    code = ("from megatron.core.tensor_parallel import layers\n"
            "original = layers.linear_with_grad_accumulation_and_async_allreduce\n"
            "def drifted(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,"
            " grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None,"
            " fp8_new=None):\n    pass\n"
            "layers.linear_with_grad_accumulation_and_async_allreduce = drifted\n"
            "import megatron_fp8rl.models.megatron_fp8_linear\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode != 0
    assert "UntestedVersionError" in done.stderr and "fp8_new" in done.stderr, done.stderr[-2000:]


def test_adam_step_restore_raises_when_the_checkpoint_restored_none(megatron_tp1):
    from megatron_fp8rl.compat.megatron_optim import ensure_optimizer_state, restore_adam_step
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, wrap_ddp

    model = wrap_ddp(build_gpt_model(tiny_transformer_config(), vocab_size=32, max_sequence_length=8), True)
    optimizer = build_optimizer(model, OptimConfig())
    ensure_optimizer_state(optimizer)
    with pytest.raises(KeyError, match="param group 0: the checkpoint restored no 'step'"):
        restore_adam_step(optimizer)
    for part in optimizer.chained_optimizers:
        for group in part.optimizer.param_groups:
            group["step"] = 3
    restore_adam_step(optimizer)
    state = optimizer.chained_optimizers[0].optimizer.state
    assert all(torch.equal(s["step"], torch.tensor(3.0)) for s in state.values())


def test_an_exact_version_override_allows_that_version_only(torch_at_9):
    assert versions.check_versions(versions.allowed_from_env({ALLOW_ENV: "torch==9.9.9"}))["torch"] == "9.9.9"
    with pytest.raises(UntestedVersionError, match=f"torch 9.9.9 is installed.*{ALLOW_ENV}=torch==9.9.9"):
        versions.check_versions(versions.allowed_from_env({ALLOW_ENV: "torch==2.9.0a0"}))
    with pytest.raises(ValueError, match=r"unknown distributions \['torchh==1'\]"):
        versions.allowed_from_env({ALLOW_ENV: "torchh==1"})


def test_the_dockerfile_allows_exactly_the_versions_it_checks_its_base_image_for():
    text = (REPO / "Dockerfile").read_text()
    assert "MEGATRON_FP8RL_ALLOW_UNTESTED=torch==${TORCH_VERSION},transformer-engine==${TE_VERSION}" in text
    assert "MEGATRON_FP8RL_ALLOW_UNTESTED=torch,transformer-engine" not in text  # no waiver by name
    # the build checks the pins against the base image
    assert "__import__('torch').__version__.split('+')[0] != '${TORCH_VERSION}'" in text
    assert "metadata.version('transformer-engine').split('+')[0] != '${TE_VERSION}'" in text
