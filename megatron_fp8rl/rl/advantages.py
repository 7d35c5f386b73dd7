"""Outcome-reward advantages for group sampling: GRPO (with/without std scaling) and RLOO.

Owns: turning one scalar reward per sample, grouped by prompt, into advantages, and spreading a
per-sequence value over its response tokens.
Must not import: anything from megatron_fp8rl outside rl/, megatron, or model code (layer L0).

Layout: rewards are [G, n], G prompts (groups) with n sampled responses each, sample j of prompt g
at [g, j]. Flattening with `.reshape(-1)` gives the rollout order [B = G·n] (prompt-major).
Non-finite rewards are rejected here, before they can reach a loss.
"""
from __future__ import annotations

import torch

from megatron_fp8rl.rl.common import RLInputError, check_groups, check_ndim, float_mask


def grpo_advantages(
    rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-normalized advantages.

    With std scaling (GRPO, Shao et al. 2024):  A_gj = (r_gj − mean_g) / (std_g + eps)
    Without (Dr. GRPO, Liu et al. 2025):         A_gj =  r_gj − mean_g
    where mean_g and std_g are over the n samples of group g and std is the unbiased (Bessel,
    n − 1) estimate, as torch.std, verl and TRL compute it. A group whose rewards are all equal
    gets zero advantages either way.

    Args:
        rewards: [G, n] float, one scalar reward per sample. Must be finite; n >= 2 when
            scale_by_std (the unbiased std of one sample is undefined).
        scale_by_std: divide by the group std.
        eps: added to the std so uniform groups do not divide by zero.

    Returns:
        [G, n] advantages in rewards' dtype.
    """
    check_groups("rewards", rewards, min_group_size=2 if scale_by_std else 1)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

        A_gj = r_gj − (1 / (n − 1)) Σ_{k≠j} r_gk  =  n / (n − 1) · (r_gj − mean_g)

    Args:
        rewards: [G, n] float, finite, n >= 2 (the baseline of a lone sample is undefined).

    Returns:
        [G, n] advantages in rewards' dtype.
    """
    check_groups("rewards", rewards, min_group_size=2)
    group_size = rewards.shape[1]
    leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    return rewards - leave_one_out_mean


def expand_to_tokens(sequence_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Give every response token its sequence's value: out[i, t] = sequence_values[i] · mask[i, t].

    Args:
        sequence_values: [B] (or [G, n], flattened prompt-major to [B]) per-sequence advantages.
        response_mask: [B, T] bool or 0/1.

    Returns:
        [B, T] in sequence_values' dtype, zero on masked-out positions.
    """
    flat = sequence_values.reshape(-1)
    check_ndim("response_mask", response_mask, 2, "[B, T]")
    if flat.shape[0] != response_mask.shape[0]:
        raise RLInputError(
            f"sequence_values has {flat.shape[0]} sequences but response_mask has "
            f"{response_mask.shape[0]} rows"
        )
    per_token = flat[:, None].expand(response_mask.shape)
    return per_token * float_mask("response_mask", response_mask, per_token)
