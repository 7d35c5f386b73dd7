"""DAPO's batch-side techniques (Yu et al. 2025): dynamic sampling and overlong reward shaping.

Owns: deciding which prompt groups carry a learning signal, and the soft length penalty.
Must not import: anything from megatron_fp8rl outside rl/, megatron, or model code (layer L0).
Rewards are [G, n] (G prompt groups, n samples each) as in advantages.py; non-finite rewards are
rejected here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fp8rl.rl.common import RLInputError, check_finite, check_groups, check_same_shape


@dataclass(frozen=True)
class GroupSelection:
    """Which groups dynamic sampling keeps."""

    keep: torch.Tensor
    """[G] bool, True for groups whose rewards are not all equal."""
    num_dropped: int
    """How many groups were dropped (all rewards equal: zero advantage, no gradient)."""

def select_informative_groups(rewards: torch.Tensor, *, atol: float = 0.0) -> GroupSelection:
    """DAPO dynamic sampling: drop groups whose rewards are all equal.

    Group g is kept iff max_j r_gj − min_j r_gj > atol. A group whose samples all succeed (or all
    fail) has zero group-normalized advantage and only dilutes the batch; the trainer samples more
    prompts until it has enough kept groups.

    Args:
        rewards: [G, n] float, finite.
        atol: spread at or below which rewards count as equal (0: exactly equal).
    """
    check_groups("rewards", rewards)
    spread = rewards.amax(dim=1) - rewards.amin(dim=1)
    keep = spread > atol
    return GroupSelection(keep=keep, num_dropped=int((~keep).sum()))


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the task reward.

    With L_max = max_length and L_cache = buffer_length:
        0                                         if |y| <= L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache · f   if L_max − L_cache < |y| <= L_max
        −f                                        if |y| > L_max
    (f = penalty_factor; the DAPO paper uses f = 1.) Linear from 0 to −f across the buffer.

    Args:
        response_lengths: [B] or [G, n] integer or float token counts, >= 0.

    Returns:
        float32 penalties shaped like response_lengths.
    """
    if not 0 < buffer_length <= max_length:
        raise RLInputError(f"need 0 < buffer_length <= max_length, got {buffer_length}, {max_length}")
    lengths = response_lengths.to(torch.float32)
    check_finite("response_lengths", lengths)
    if bool((lengths < 0).any()):
        raise RLInputError("response_lengths has negative entries")
    expected = max_length - buffer_length
    penalty = (expected - lengths) / buffer_length * penalty_factor
    return penalty.clamp(min=-penalty_factor, max=0.0)


def shape_overlong_rewards(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """rewards + overlong_penalty(response_lengths); both any same shape ([B] or [G, n]).

    Rewards must be finite. Returns rewards' dtype.
    """
    check_same_shape("rewards", rewards, response_lengths=response_lengths)
    check_finite("rewards", rewards)
    penalty = overlong_penalty(response_lengths, max_length=max_length, buffer_length=buffer_length,
                               penalty_factor=penalty_factor)
    return rewards + penalty.to(rewards.dtype)
