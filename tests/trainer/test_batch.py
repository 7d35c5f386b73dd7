"""Rollout samples -> padded training batch: response positions and each row's prompt length."""
import pytest
import torch

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rollout.engine import RolloutSample
from megatron_fp8rl.trainer.batch import (
    RolloutBatch, build_batch, micro_batches, pad_rows, prompt_lengths, split_mini_batches,
)


def _sample(prompt, response):
    return RolloutSample(prompt_index=0, prompt_token_ids=prompt, token_ids=response, logprobs=[-0.5] * len(response),
                         finish_reason="stop", weight_version=0)


def test_advantages_spread_over_response_tokens_and_must_be_one_per_sample():
    """build_batch goes through rl.advantages.expand_to_tokens: a single advantage for two samples
    is refused, not broadcast to both."""
    samples = [_sample([1, 2], [3, 4]), _sample([1], [5])]
    batch = build_batch(samples, torch.tensor([2.0, -1.0]), length=4)
    assert batch.advantages.tolist() == [[0.0, 2.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    with pytest.raises(RLInputError, match="sequence_values has 1 sequences but response_mask has 2 rows"):
        build_batch(samples, torch.tensor([2.0]), length=4)


def test_prompt_lengths_are_read_back_from_the_response_mask():
    samples = [_sample([1, 2, 3], [4, 5]), _sample([7], [8, 9, 10, 11]), _sample([1, 2, 3, 4, 5, 6], [])]
    batch = pad_rows(build_batch(samples, torch.ones(3), length=8), 4)
    assert batch.response_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # predicts tokens 3 and 4
    assert prompt_lengths(batch.response_mask) == [3, 1, 8, 8]  # no response / filler row: all prompt


def test_every_mini_batch_gets_real_rows_and_its_own_padding():
    """8 real rows, 2 mini-batches, DP x micro multiple 8: 4 real rows + 4 padding rows each (padding
    the whole batch to 16 first gave the second optimizer step padding only); old logprobs follow
    their rows, zeros on padding; fewer rows than mini-batches give fewer mini-batches."""
    samples = [_sample([1, 2], [3 + i, 4]) for i in range(8)]
    batch = build_batch(samples, torch.arange(8.0), length=4)
    old = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    minis = split_mini_batches(batch, old, mini_batches=2, multiple=8)
    assert [m.size for m in minis] == [8, 8]
    for index, mini in enumerate(minis):
        assert mini.response_mask[:4].sum() == 8 and mini.response_mask[4:].sum() == 0
        assert torch.equal(mini.tokens[:4], batch.tokens[4 * index:4 * index + 4])
        assert torch.equal(mini.old_logprobs[:4], old[4 * index:4 * index + 4]) and not mini.old_logprobs[4:].any()
    unrecomputed = split_mini_batches(batch.select(slice(0, 1)), None, mini_batches=2, multiple=8)
    assert len(unrecomputed) == 1 and unrecomputed[0].old_logprobs is None


def test_micro_batches_are_typed_equal_shape_slices():
    """5 rows with old logprobs, micro-batches of 2: three RolloutBatch micro-batches of 2 rows,
    the last one padded with an all-masked row whose old logprobs are 0."""
    samples = [_sample([1, 2], [3 + i, 4]) for i in range(5)]
    old = -torch.arange(1, 5 * 4 + 1, dtype=torch.float32).reshape(5, 4)
    (mini,) = split_mini_batches(build_batch(samples, torch.arange(5.0), length=4), old, 1, 1)
    micro = micro_batches(mini, 2)
    assert [m.size for m in micro] == [2, 2, 2] and all(isinstance(m, RolloutBatch) for m in micro)
    assert torch.equal(torch.cat([m.old_logprobs for m in micro])[:5], old)
    assert not micro[2].old_logprobs[1].any() and not micro[2].response_mask[1].any()
