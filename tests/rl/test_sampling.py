"""DAPO dynamic sampling and overlong reward shaping against hand-worked numbers."""
import pytest
import torch

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.sampling import overlong_penalty, select_informative_groups, shape_overlong_rewards


def test_groups_with_equal_rewards_are_dropped_and_counted():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    selection = select_informative_groups(rewards)
    assert selection.keep.tolist() == [False, True, False, False]
    assert selection.num_dropped == 3


def test_atol_treats_near_equal_rewards_as_equal():
    rewards = torch.tensor([[0.0, 1e-4], [0.0, 1.0]])
    assert select_informative_groups(rewards).keep.tolist() == [True, True]
    assert select_informative_groups(rewards, atol=1e-3).keep.tolist() == [False, True]


def test_dynamic_sampling_rejects_nan_and_empty_groups():
    with pytest.raises(RLInputError, match="rewards has 1 non-finite"):
        select_informative_groups(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(RLInputError, match="rewards has an empty group dimension"):
        select_informative_groups(torch.zeros(0, 8))


def test_overlong_penalty_matches_hand_values():
    # L_max = 20, buffer 4: free up to 16, linear to -1 at 20, -1 beyond.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_length=20, buffer_length=4), expected)
    torch.testing.assert_close(
        overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=0.5), expected * 0.5
    )


def test_shape_overlong_rewards_adds_penalty():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lengths = torch.tensor([[8, 19], [18, 30]])
    expected = torch.tensor([[1.0, -0.75], [0.5, 0.0]])
    shaped = shape_overlong_rewards(rewards, lengths, max_length=20, buffer_length=4)
    torch.testing.assert_close(shaped, expected)


def test_shape_overlong_rewards_rejects_bad_input():
    with pytest.raises(RLInputError, match="rewards has 1 non-finite"):
        shape_overlong_rewards(torch.tensor([float("nan"), 1.0]), torch.tensor([1, 2]), max_length=4,
                               buffer_length=2)
    with pytest.raises(RLInputError, match="response_lengths has shape"):
        shape_overlong_rewards(torch.zeros(3), torch.zeros(2), max_length=4, buffer_length=2)
    with pytest.raises(RLInputError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer_length=0)
    with pytest.raises(RLInputError, match="negative"):
        overlong_penalty(torch.tensor([-1]), max_length=4, buffer_length=2)
