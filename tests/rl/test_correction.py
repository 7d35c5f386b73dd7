"""TIS and MIS/IcePop weights: hand cases and properties (cap respected, exact band masking)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.correction import masked_importance_weights, truncated_importance_weights

LN = math.log


def test_token_tis_hand_case():
    train = torch.tensor([[LN(3.0), LN(0.5), 0.0, LN(7.0)]])
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    correction = truncated_importance_weights(train, rollout, mask, cap=2.0)
    torch.testing.assert_close(correction.weights, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert correction.metrics["tis_clip_frac"].item() == pytest.approx(1 / 3)
    assert correction.metrics["tis_weight_mean"].item() == pytest.approx(3.5 / 3)


def test_sequence_and_geometric_tis_hand_case():
    # Row 0: Δ = ln 1.5 twice -> product 2.25, geometric 1.5. Row 1: Δ = ln 0.5, then padding.
    train = torch.tensor([[LN(1.5), LN(1.5)], [LN(0.5), LN(100.0)]])
    mask = torch.tensor([[1, 1], [1, 0]])
    sequence = truncated_importance_weights(train, torch.zeros(2, 2), mask, cap=2.0, level="sequence")
    torch.testing.assert_close(sequence.weights, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    geometric = truncated_importance_weights(train, torch.zeros(2, 2), mask, cap=2.0, level="geometric")
    torch.testing.assert_close(geometric.weights, torch.tensor([[1.5, 1.5], [0.5, 0.0]]))


def test_mis_hand_case():
    train = torch.tensor([[LN(3.0), LN(0.5), 0.0, LN(0.4), LN(2.0)]])
    mask = torch.ones(1, 5)
    correction = masked_importance_weights(train, torch.zeros(1, 5), mask, low=0.5, high=2.0)
    torch.testing.assert_close(correction.weights, torch.tensor([[0.0, 0.5, 1.0, 0.0, 2.0]]))
    assert correction.metrics["mis_drop_frac"].item() == pytest.approx(2 / 5)
    indicator = masked_importance_weights(train, torch.zeros(1, 5), mask, low=0.5, high=2.0, reweight=False)
    torch.testing.assert_close(indicator.weights, torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]]))


def test_sequence_mis_drops_whole_sequences():
    train = torch.tensor([[LN(1.5), LN(1.5)], [LN(1.2), 0.0]])  # products 2.25 and 1.2
    correction = masked_importance_weights(train, torch.zeros(2, 2), torch.ones(2, 2), level="sequence")
    torch.testing.assert_close(correction.weights, torch.tensor([[0.0, 0.0], [1.2, 1.2]]))


def test_weights_are_detached():
    train = torch.zeros(2, 3, requires_grad=True)
    assert not truncated_importance_weights(train, torch.zeros(2, 3), torch.ones(2, 3)).weights.requires_grad
    assert not masked_importance_weights(train, torch.zeros(2, 3), torch.ones(2, 3)).weights.requires_grad


def test_bad_inputs_name_the_problem():
    with pytest.raises(RLInputError, match="rollout_logprobs has shape"):
        truncated_importance_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(RLInputError, match="response_mask has shape"):
        masked_importance_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 3))
    with pytest.raises(RLInputError, match="unknown correction level"):
        truncated_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), level="tok")
    with pytest.raises(RLInputError, match="cap must be > 0"):
        truncated_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0.0)
    with pytest.raises(RLInputError, match="low < high"):
        masked_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), low=2.0, high=1.0)


log_ratios = st.lists(st.floats(-40.0, 40.0, allow_nan=False), min_size=1, max_size=24)
levels = st.sampled_from(["token", "sequence", "geometric"])


def _as_rows(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    width = 4
    padded = values + [0.0] * (-len(values) % width)
    delta = torch.tensor(padded, dtype=torch.float32).reshape(-1, width)
    mask = (torch.arange(len(padded)) < len(values)).reshape(-1, width)
    return delta, mask


@settings(max_examples=60, deadline=None)
@given(log_ratios, st.floats(0.1, 10.0), levels)
def test_tis_weights_never_exceed_cap(values, cap, level):
    delta, mask = _as_rows(values)
    rollout = torch.full_like(delta, -2.0)
    weights = truncated_importance_weights(rollout + delta, rollout, mask, cap=cap, level=level).weights
    assert bool((weights <= cap).all()) and bool((weights >= 0).all())


@settings(max_examples=60, deadline=None)
@given(log_ratios, st.floats(0.05, 0.99), st.floats(1.01, 20.0))
def test_mis_drops_exactly_the_tokens_outside_the_band(values, low, high):
    delta, mask = _as_rows(values)
    rollout = torch.full_like(delta, -3.0)
    train = rollout + delta
    ratio = (train - rollout).exp()  # the same float32 ratios the weights are computed from
    weights = masked_importance_weights(train, rollout, mask, low=low, high=high).weights
    outside = (ratio < low) | (ratio > high)
    assert bool((weights[outside & mask] == 0).all())
    assert bool((weights[~outside & mask] > 0).all())
    torch.testing.assert_close(weights[~outside & mask], ratio[~outside & mask])
