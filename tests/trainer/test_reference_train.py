"""`megatron-fp8rl train` with a KL penalty end to end on CPU (tiny random Llama, real SGLang, real
Megatron): the reference pass runs, is timed and logged; KL is exactly 0 at step 1 (the one
mini-batch trains at θ_old, which the reference equals bit for bit in float32) and positive after
the first update, in the loss; in the rewards (the rollout's log-probs, which match the
trainer's to 1e-3 in float32) within 1e-6 at step 1.

Starts torchrun with 1 process per run; rank 0 starts one SGLang engine (2 more processes).
"""
import pytest

from tests.helpers.train import run_train, tb_scalars


@pytest.mark.multiprocess
@pytest.mark.parametrize("in_reward", [False, True])
def test_kl_is_zero_before_the_first_update_and_logged(tiny_run_inputs, tmp_path, in_reward):
    run_train(tiny_run_inputs, tmp_path, 1, "algorithm.kl.coef=0.01", "algorithm.kl.estimator=low_var_kl",
              f"algorithm.kl.in_reward={str(in_reward).lower()}", "train.eval_every=0")
    scalars = tb_scalars(tmp_path)
    for tag in ("kl/mean", "kl/max", "time/reference_s", "time/setup_reference_s"):
        assert tag in scalars, f"{tag} not logged; have {sorted(scalars)}"
    assert ("train/kl_loss" in scalars) != in_reward
    if in_reward:  # the rollout's log-probs (SGLang, float32) against the reference's: within 1e-3
        assert scalars["kl/max"][0] < 1e-6  # k3 ≈ δ²/2
    else:  # step 1: the training forward at θ_old equals the reference bit for bit
        assert scalars["kl/mean"][0] == 0 and scalars["kl/max"][0] == 0
    assert scalars["kl/mean"][1] > 0 and scalars["kl/max"][1] >= scalars["kl/mean"][1]  # step 2: moved
    assert "time/reference_offload_s" not in scalars
