"""Input checks and masked reductions shared by the RL math.

Owns: the errors raised for bad RL inputs (shape mismatches, empty groups, non-finite values) and
the masked mean/sum every loss and metric uses.
Must not import: anything from megatron_fp8rl outside rl/, megatron, or any model code (layer L0:
torch only).

Shape conventions used across rl/: B sequences, T response positions (right-padded), G groups of
n samples each, V vocabulary entries. `response_mask` is [B, T], bool or 0/1 float, true on the
response tokens that count.
"""
from __future__ import annotations

import torch


class RLInputError(ValueError):
    """An RL tensor has the wrong shape, an empty dimension, or non-finite values."""


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise RLInputError naming the first tensor in `others` whose shape differs from `reference`."""
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise RLInputError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; they must match"
            )


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise RLInputError if `tensor` holds NaN or +-inf, saying how many and where the first is."""
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        count = int(bad.sum())
        raise RLInputError(
            f"{name} has {count} non-finite value(s) (first at index {first}: "
            f"{tensor[first].item()}); fix them before they reach the loss"
        )


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise RLInputError if `tensor` is not `ndim`-dimensional; `layout` names the dims, e.g. '[B, T]'."""
    if tensor.ndim != ndim:
        raise RLInputError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_groups(name: str, rewards: torch.Tensor, min_group_size: int = 1) -> None:
    """Validate per-group rewards [G, n]: two dims, no empty dimension, n >= min_group_size, finite."""
    check_ndim(name, rewards, 2, "[num_groups, group_size]")
    num_groups, group_size = rewards.shape
    if num_groups == 0 or group_size == 0:
        raise RLInputError(f"{name} has an empty group dimension: shape {tuple(rewards.shape)}")
    if group_size < min_group_size:
        raise RLInputError(
            f"{name} has groups of {group_size} sample(s); this estimator needs at least "
            f"{min_group_size} per group"
        )
    check_finite(name, rewards)


def float_mask(name: str, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`mask` as 0/1 values in `like`'s dtype after checking it has `like`'s shape."""
    check_same_shape("the per-token values", like, **{name: mask})
    return mask.to(like.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask over `dim` (all dims when None)."""
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask over `dim`; 0 where the mask is empty (not NaN)."""
    return masked_sum(values, mask, dim) / masked_sum(torch.ones_like(values), mask, dim).clamp(min=1)


def checked_log_ratio(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                      response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Δ, mask): Δ = log π_train − log π_rollout, detached fp32 [B, T], and the response mask as
    floats, after checking the three are [B, T] of one shape."""
    check_ndim("train_logprobs", train_logprobs, 2, "[B, T]")
    check_same_shape("train_logprobs", train_logprobs, rollout_logprobs=rollout_logprobs,
                     response_mask=response_mask)
    delta = (train_logprobs.detach() - rollout_logprobs.detach()).float()
    return delta, float_mask("response_mask", response_mask, delta)

