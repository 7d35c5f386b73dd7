"""Rollout samples -> padded training batch: response positions and each row's prompt length."""
import torch

from megatron_fp8rl.rollout.engine import RolloutSample
from megatron_fp8rl.trainer.batch import build_batch, pad_rows, prompt_lengths


def _sample(prompt, response):
    return RolloutSample(prompt_index=0, prompt_token_ids=prompt, token_ids=response, logprobs=[-0.5] * len(response),
                         finish_reason="stop", weight_version=0)


def test_prompt_lengths_are_read_back_from_the_response_mask():
    samples = [_sample([1, 2, 3], [4, 5]), _sample([7], [8, 9, 10, 11]), _sample([1, 2, 3, 4, 5, 6], [])]
    batch = pad_rows(build_batch(samples, torch.ones(3), length=8), 4)
    assert batch.response_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # predicts tokens 3 and 4
    assert prompt_lengths(batch.response_mask) == [3, 1, 8, 8]  # no response / filler row: all prompt
