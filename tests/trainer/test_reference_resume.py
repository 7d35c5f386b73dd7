"""Resume keeps the reference policy: a KL run continued from its step-1 checkpoint has, at step 2,
the KL terms of the run that went through (the reference is the run's start, init_megatron, not
the newest checkpoint). Rollouts are reproducible across processes as in test_rl_resume.py: an
SGLang server with deterministic inference and per-step seeds.

Starts torchrun with 1 process three times (2 steps; 1 step; the same run continued to 2 steps);
each run's rank 0 starts one SGLang server (1 process + 2 SGLang children).
"""
import pytest

from tests.helpers.train import run_train, tb_scalars

SETTINGS = ("checkpoint.every=1", "train.eval_every=0", "rollout.mode=disaggregated",
            "rollout.weight_transfer=distributed", "rollout.deterministic=true", "rollout.temperature=1.0",
            "algorithm.kl.coef=0.01", "algorithm.kl.estimator=k3")
KL_TAGS = ("kl/mean", "kl/max", "train/kl_loss", "train/pg_loss")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(2400)  # three runs of ~1-3 minutes each on a loaded 2-core box
def test_a_resumed_run_has_the_uninterrupted_runs_kl(tiny_run_inputs, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(tiny_run_inputs, straight, 1, "train.steps=2", *SETTINGS)
    run_train(tiny_run_inputs, resumed, 1, "train.steps=1", *SETTINGS)
    run_train(tiny_run_inputs, resumed, 1, "train.steps=2", *SETTINGS)  # continues from step 1's checkpoint
    want, got = tb_scalars(straight), tb_scalars(resumed)
    assert all(len(want[tag]) == len(got[tag]) == 2 for tag in KL_TAGS)
    assert want["kl/mean"][1] > 0  # step 2 is after an update: a KL that a wrong reference would change
    assert {tag: got[tag][1] for tag in KL_TAGS} == {tag: want[tag][1] for tag in KL_TAGS}
