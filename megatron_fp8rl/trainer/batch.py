"""Rollout samples -> the padded tensors the Megatron actor trains on.

Owns: `RolloutBatch` (all tensors [B, S] in *prediction* coordinates: position t holds what the
logits at t say about token t+1), the typed batch of the whole step, of a mini-batch and of a
micro-batch alike, and splitting it into mini-batches and equal-shape micro-batches.
Must not import: cli.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatron_fp8rl.rl.advantages import expand_to_tokens
from megatron_fp8rl.rollout.engine import RolloutSample


@dataclass
class RolloutBatch:
    """B sequences of prompt + response, right-padded to S tokens."""

    tokens: torch.Tensor
    """[B, S] int64 input ids (pad 0)."""
    position_ids: torch.Tensor
    """[B, S] int64."""
    target_ids: torch.Tensor
    """[B, S] int64: tokens shifted left by one (the token each position predicts)."""
    response_mask: torch.Tensor
    """[B, S] float: 1 where the predicted token is a response token."""
    rollout_logprobs: torch.Tensor
    """[B, S] float: the rollout engine's logprob of each response token (0 elsewhere)."""
    advantages: torch.Tensor
    """[B, S] float: the sequence's advantage on its response positions."""
    old_logprobs: torch.Tensor | None = None
    """[B, S] float: log π_old as the trainer recomputed it before the update (0 on padding rows);
    None when no recompute ran (trainer.rl_step._recompute_needed)."""
    shadow_logprobs: torch.Tensor | None = None
    """[B, S] float: the high-precision shadow's log π_θ at the mini-batch's θ (the shadow gate,
    algorithm.calibration.mode=gate; set on micro-batches just before they train), else None."""
    shadow_old_logprobs: torch.Tensor | None = None
    """[B, S] float: the shadow's log π_old (before the update), with `shadow_logprobs`."""
    ref_logprobs: torch.Tensor | None = None
    """[B, S] float: the reference policy's log π_ref (algorithm.kl, trainer/reference.py), else None."""

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: torch.Tensor | slice) -> "RolloutBatch":
        return RolloutBatch(**{name: None if tensor is None else tensor[rows] for name, tensor in self.named_tensors()})

    def named_tensors(self) -> list[tuple[str, torch.Tensor | None]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


def build_batch(samples: list[RolloutSample], advantages: torch.Tensor, length: int) -> RolloutBatch:
    """Pad `samples` to `length` tokens; `advantages` is [B] (one value per sample; RLInputError
    when their count is not the samples')."""
    size = len(samples)
    tokens = torch.zeros(size, length, dtype=torch.long)
    response_mask = torch.zeros(size, length)
    rollout_logprobs = torch.zeros(size, length)
    for row, sample in enumerate(samples):
        sequence = sample.prompt_token_ids + sample.token_ids
        if len(sequence) > length:
            raise ValueError(f"sample {row} has {len(sequence)} tokens, more than the batch length {length}")
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        start, end = len(sample.prompt_token_ids) - 1, len(sequence) - 1
        response_mask[row, start:end] = 1.0
        rollout_logprobs[row, start:end] = torch.tensor(sample.logprobs, dtype=torch.float32)
    target_ids = torch.zeros_like(tokens)
    target_ids[:, :-1] = tokens[:, 1:]
    return RolloutBatch(
        tokens=tokens,
        position_ids=torch.arange(length).expand(size, length).contiguous(),
        target_ids=target_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=expand_to_tokens(advantages.float(), response_mask),
    )


def prompt_lengths(response_mask: torch.Tensor) -> list[int]:
    """[B, S] response mask -> each row's prompt length (its first response prediction position
    + 1; S for a row without response tokens, such as pad_rows' fillers)."""
    has_response = response_mask.bool().any(dim=1)
    first = response_mask.bool().int().argmax(dim=1) + 1
    return torch.where(has_response, first, response_mask.shape[1]).tolist()


def pad_rows(batch: RolloutBatch, multiple: int) -> RolloutBatch:
    """Append all-masked rows so the size is a multiple of `multiple` (they contribute nothing)."""
    missing = -batch.size % multiple
    if not missing:
        return batch
    padded = {}
    for name, tensor in batch.named_tensors():
        if tensor is None:
            padded[name] = None
            continue
        filler = tensor[:1].expand(missing, *tensor.shape[1:]).clone()
        if name in ("response_mask", "rollout_logprobs", "advantages", "old_logprobs", "shadow_logprobs",
                    "shadow_old_logprobs", "ref_logprobs"):
            filler.zero_()
        padded[name] = torch.cat([tensor, filler])
    return RolloutBatch(**padded)


def micro_batches(batch: RolloutBatch, micro_batch_size: int) -> list[RolloutBatch]:
    """Equal-shape micro-batches (Megatron's pipeline schedule needs one shape)."""
    batch = pad_rows(batch, micro_batch_size)
    return [batch.select(slice(i, i + micro_batch_size)) for i in range(0, batch.size, micro_batch_size)]


def split_mini_batches(batch: RolloutBatch, old_logprobs: torch.Tensor | None, mini_batches: int,
                       multiple: int) -> list[RolloutBatch]:
    """The batch's real rows in up to `mini_batches` contiguous chunks (fewer when there are fewer
    rows), each padded with all-masked rows to a multiple of `multiple` (DP size x micro-batch
    size), carrying the matching rows of `old_logprobs` [B, S] (zeros on padding) when given.
    Padding each chunk, not the whole batch, keeps padding out of whole mini-batches: with 8 rows,
    2 mini-batches and micro-batches of 8, padding the batch to 16 first left the second
    optimizer step nothing but padding."""
    batch = replace(batch, old_logprobs=old_logprobs)
    return [pad_rows(batch.select(rows), multiple) for rows in torch.arange(batch.size).chunk(mini_batches)]
