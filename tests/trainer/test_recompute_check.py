"""The old-logprob recompute as a periodic check where the rollout is bit-identical to the trainer
(aligned FP8 rollouts, float32 trainer): which steps recompute, check or skip; a check that finds
any difference stops the run naming the step and the largest difference; an aligned run skips
and logs what it skipped (1 torchrun process + SGLang's 2)."""
import pytest
import torch

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.rollout.engine import RolloutSample
from megatron_fp8rl.trainer.batch import RolloutBatch, build_batch
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.rl_step import RecomputeMismatch, check_recompute, recompute_plan
from tests.helpers.train import run_train, tb_scalars

ALIGNED = ("model.fp8=groupwise32", "rollout.fp8=aligned")


def _plans(*overrides: str, steps: int = 25) -> list[str]:
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "train.mini_batches=2", *overrides])
    return [recompute_plan(cfg, step) for step in range(1, steps + 1)]


def test_aligned_float32_runs_check_on_steps_1_11_21_and_skips_the_others():
    plans = _plans(*ALIGNED)
    assert [step for step, plan in enumerate(plans, 1) if plan == "check"] == [1, 11, 21]
    assert {plan for step, plan in enumerate(plans, 1) if step not in (1, 11, 21)} == {"skip"}
    assert set(_plans(*ALIGNED, "algorithm.recompute_check_every=1")) == {"check"}


def test_rollouts_that_are_not_bit_identical_recompute_every_step():
    assert set(_plans()) == {"recompute"}  # float32 trainer, float32 SGLang: different kernels
    assert set(_plans("model.fp8=groupwise32", "rollout.fp8=blockwise")) == {"recompute"}
    assert set(_plans(*ALIGNED, "model.dtype=bfloat16", "rollout.dtype=bfloat16")) == {"recompute"}


def test_an_update_that_needs_no_recompute_neither_checks_nor_skips():
    assert set(_plans(*ALIGNED, "train.mini_batches=1")) == {"none"}
    assert set(_plans(*ALIGNED, "algorithm.old_policy=bypass", "algorithm.correction=none")) == {"none"}


def _batch() -> RolloutBatch:
    samples = [RolloutSample(0, [5, 6], [7, 8, 9], [-0.5, -1.25, -2.0], "stop", 1),
               RolloutSample(0, [5], [7, 3], [-0.75, -0.125], "length", 1)]
    return build_batch(samples, torch.tensor([1.0, -1.0]), length=5)


def test_a_recompute_equal_to_the_rollout_on_every_response_token_passes(megatron_tp1):
    batch = _batch()
    recomputed = batch.rollout_logprobs.clone()
    recomputed[batch.response_mask == 0] = -3.0  # prompt and padding positions are not compared
    assert check_recompute(recomputed, batch, step=3) == 0.0


def test_a_planted_difference_stops_the_run_naming_the_step_and_the_largest_difference(megatron_tp1):
    batch = _batch()
    recomputed = batch.rollout_logprobs.clone()
    rows, cols = batch.response_mask.nonzero(as_tuple=True)
    recomputed[rows[0], cols[0]] += 2.0 ** -20  # one ulp-scale flip of one token
    recomputed[rows[-1], cols[-1]] -= 0.03125
    with pytest.raises(RecomputeMismatch, match=r"^step 7: the recomputed log π_old differs from the aligned "
                                                r"rollout's logprobs by up to 0.03125 \(largest \|difference\|"):
        check_recompute(recomputed, batch, step=7)
    recomputed = batch.rollout_logprobs.clone()
    recomputed[rows[1], cols[1]] = float("nan")
    with pytest.raises(RecomputeMismatch, match=r"^step 2: .* by up to nan"):
        check_recompute(recomputed, batch, step=2)


@pytest.mark.multiprocess
def test_aligned_run_checks_the_first_step_and_skips_the_next(tiny_run_inputs, tmp_path):
    """groupwise32 + aligned rollouts, 2 mini-batches, recompute_check_every=2, 3 steps: steps 1
    and 3 recompute and find 0 difference, step 2 takes the rollout's logprobs (no forward);
    π_old is the same bits either way, so the mismatch is 0 on every step."""
    run_train(tiny_run_inputs, tmp_path, 1, *ALIGNED, "algorithm.recompute_check_every=2", "train.steps=3",
              "train.mini_batches=2", "train.micro_batch_size=2", "train.eval_every=0", "algorithm.name=grpo",
              "algorithm.dynamic_sampling=false")
    scalars = tb_scalars(tmp_path)
    assert scalars["recompute/skipped"] == [0.0, 1.0, 0.0]
    assert scalars["recompute/check_max_abs_diff"] == [0.0, 0.0]
    recompute_s = scalars["time/recompute_s"]
    assert recompute_s[1] < 0.01 < min(recompute_s[0], recompute_s[2]), recompute_s
    assert scalars["train/mismatch_abs_logprob_diff_max"] == [0.0, 0.0, 0.0]
