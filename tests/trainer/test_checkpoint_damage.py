"""Resume walks back past damaged checkpoints: a truncated .distcp, a garbage trainer_state.json or
a missing .metadata in the newest checkpoint skips it, naming the folder and the problem, and the
intact one before it loads; when none is intact the error lists them all. In process, one rank
(tiny GPT, distributed optimizer)."""
import re
import shutil

import pytest
import torch

from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.trainer.checkpoint import (
    TRAINER_STATE, CheckpointConfig, load_checkpoint, newest_intact_checkpoint, save_checkpoint,
)

SEQ = 12


@pytest.fixture(scope="module")
def actor(megatron_tp1):
    from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    model = wrap_ddp(build_gpt_model(tiny_transformer_config(), 64, SEQ), distributed_optimizer=True)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, distributed_optimizer=True))
    tokens = torch.randint(0, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(SEQ).expand(4, SEQ).contiguous()}

    def step():
        train_step(model, optimizer, [batch],
                   lambda chunk, b: chunk(b["tokens"], b["position_ids"], None, labels=b["labels"]),
                   lambda b, loss: (loss.float().mean(), {"loss": loss.float().mean()}), SEQ, 4)
    return model, optimizer, step


@pytest.fixture(scope="module")
def intact_checkpoints(actor, tmp_path_factory):
    """Checkpoints at steps 1 and 2, saved once per module (a save is ~1 s of the edit-loop
    tier); returns (root, the weights saved at step 1)."""
    model, optimizer, step = actor
    root = tmp_path_factory.mktemp("intact")
    cfg = CheckpointConfig(dir=str(root), keep_last=3)
    for number in (1, 2):
        step()
        save_checkpoint(cfg, number, model, optimizer, {"sampler": {}})
        if number == 1:
            saved = {k: v.clone() for k, v in model.module.state_dict().items() if "weight" in k}
    return root, saved


@pytest.fixture
def checkpoints(intact_checkpoints, tmp_path):
    """A fresh copy of the intact checkpoints for the test to damage; (root, step-1 weights)."""
    root, saved = intact_checkpoints
    shutil.copytree(root, tmp_path / "checkpoints")
    return tmp_path / "checkpoints", saved


def _truncate_distcp(path):
    damaged = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[:64])
    return damaged.name


DAMAGE = {
    "truncated .distcp": (_truncate_distcp, r"{name}: contents differ"),
    "garbage trainer_state.json": (lambda p: (p / TRAINER_STATE).write_text("{garbage") and TRAINER_STATE,
                                   r"{name} is not valid JSON"),
    "missing .metadata": (lambda p: (p / ".metadata").unlink() or ".metadata", r"{name}: missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint(actor, checkpoints, damage):
    root, saved = checkpoints
    make_damage, reason = DAMAGE[damage]
    name = make_damage(root / "step_00000002")
    path, skipped = newest_intact_checkpoint(root)
    assert path == root / "step_00000001"
    assert len(skipped) == 1 and skipped[0].startswith(str(root / "step_00000002"))
    assert re.search(reason.format(name=re.escape(name)), skipped[0]), skipped[0]
    model, optimizer, _ = actor
    assert load_checkpoint(path, model, optimizer)["step"] == 1
    for key, value in saved.items():
        assert torch.equal(model.module.state_dict()[key], value), key


def test_all_damaged_is_an_error_naming_each(checkpoints):
    root, _ = checkpoints
    (root / "step_00000001" / TRAINER_STATE).write_text("[]")
    (root / "step_00000002" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint.*\n.*step_00000002: .*\n.*step_00000002/\.metadata: missing"
                                              r"\n.*step_00000001: .*lacks 'step'"):
        newest_intact_checkpoint(root)


def test_load_refuses_a_damaged_checkpoint_by_name(actor, checkpoints):
    root, _ = checkpoints
    name = _truncate_distcp(root / "step_00000002")
    model, optimizer, _ = actor
    with pytest.raises(CheckpointError, match=rf"cannot resume from .*step_00000002: .*\n.*{name}: contents differ"):
        load_checkpoint(root / "step_00000002", model, optimizer)
