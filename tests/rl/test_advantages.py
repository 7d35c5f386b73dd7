"""GRPO / RLOO advantages against hand-worked numbers, and their bad-input errors."""
import math

import pytest
import torch

from megatron_fp8rl.rl.advantages import expand_to_tokens, grpo_advantages, rloo_advantages
from megatron_fp8rl.rl.common import RLInputError


def test_grpo_with_std_matches_hand_values():
    # Group 0: mean 0.5, unbiased std sqrt(1/3). Group 1: mean 0.25, unbiased std 0.5.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    advantages = grpo_advantages(rewards, eps=0.0)
    half_over_std = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor(
        [[half_over_std, -half_over_std, -half_over_std, half_over_std], [-0.5, -0.5, -0.5, 1.5]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(advantages, expected)


def test_grpo_eps_is_added_to_std():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(grpo_advantages(rewards, eps=0.5)[0, 3], torch.tensor(0.75))


def test_grpo_without_std_is_centered_rewards():
    rewards = torch.tensor([[1.0, 2.0, 6.0], [3.0, 3.0, 3.0]])
    expected = torch.tensor([[-2.0, -1.0, 3.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grpo_advantages(rewards, scale_by_std=False), expected)


def test_grpo_uniform_group_gets_zero_advantage():
    assert torch.equal(grpo_advantages(torch.full((2, 5), 0.7)), torch.zeros(2, 5))


def test_rloo_matches_hand_values():
    # Leave-one-out baselines: 11/3, 10/3, 9/3, 6/3.
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=torch.float64)
    expected = torch.tensor([[-8 / 3, -4 / 3, 0.0, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(rloo_advantages(rewards), expected)


def test_expand_to_tokens_masks_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    expected = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    torch.testing.assert_close(expand_to_tokens(torch.tensor([2.0, -1.0]), mask), expected)


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_nan_reward_is_rejected_with_its_name(estimator):
    rewards = torch.tensor([[1.0, float("nan")], [0.0, 1.0]])
    with pytest.raises(RLInputError, match=r"rewards has 1 non-finite.*\(0, 1\)"):
        estimator(rewards)


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_empty_groups_are_rejected(estimator, shape):
    with pytest.raises(RLInputError, match="rewards has an empty group dimension"):
        estimator(torch.zeros(shape))


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_single_sample_groups_are_rejected_where_undefined(estimator):
    with pytest.raises(RLInputError, match="at least 2 per group"):
        estimator(torch.zeros(3, 1))


def test_grpo_without_std_accepts_single_sample_groups():
    assert torch.equal(grpo_advantages(torch.ones(3, 1), scale_by_std=False), torch.zeros(3, 1))


def test_flat_rewards_are_rejected():
    with pytest.raises(RLInputError, match=r"rewards must be \[num_groups, group_size\]"):
        grpo_advantages(torch.zeros(8))


def test_expand_to_tokens_rejects_row_count_mismatch():
    with pytest.raises(RLInputError, match="sequence_values has 3 sequences but response_mask has 2"):
        expand_to_tokens(torch.zeros(3), torch.ones(2, 4))
