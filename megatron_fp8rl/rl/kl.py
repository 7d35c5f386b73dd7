"""KL penalty estimators toward a reference policy (Schulman, "Approximating KL divergence", 2020),
as verl 0.9.1 computes them (`verl/trainer/ppo/core_algos.py`, `kl_penalty_forward`; verl's
straight-through "k3+" variants are not offered).

Owns: the per-token estimators, the table of their names (ours and verl's / slime's), and the
penalty's reduction to a loss term or a per-sequence reward penalty.
Must not import: anything from megatron_fp8rl outside rl/, megatron, or model code (layer L0).

Shapes: `logprobs` = log π_θ(y_t) [B, T] (carries the gradient), `ref_logprobs` = log π_ref(y_t)
[B, T] (detached), `response_mask` [B, T]. With δ = log π_θ − log π_ref, per token:

    k1  (verl "kl")          δ                                    ∂/∂logp = 1
    k2  (verl "mse")         δ² / 2                               ∂/∂logp = δ
    k3  (verl "low_var_kl")  clamp(e^−δ' + δ' − 1, −10, 10),      ∂/∂logp = 1 − e^−δ' inside both clamps,
                             δ' = clamp(δ, −20, 20)                0 where either clamp binds
    abs (verl "abs")         |δ|                                  ∂/∂logp = sign(δ)

(k3 written as verl writes it: kl = −δ', ratio = e^kl, kld = ratio − kl − 1.) Each estimates
KL(π_θ ‖ π_ref) on tokens sampled from π_θ; the gradients are autograd's of these formulas.
"""
from __future__ import annotations

import torch

from megatron_fp8rl.rl.common import RLInputError, check_ndim, check_same_shape, masked_mean

ESTIMATORS = ("k1", "k2", "k3", "abs")
VERL_NAMES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}
"""verl's `kl_loss_type` / `kl_penalty` names (slime's --kl-loss-type takes the same) -> ours."""
_LOG_RATIO_LIMIT = 20.0  # verl's clamp of k3's log ratio: e^20 stays finite in fp32
_K3_LIMIT = 10.0  # verl's clamp of the k3 value


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL penalty [B, T] of `estimator` (one of ESTIMATORS; the module docstring gives the
    formulas and gradients). `ref_logprobs` is detached: the gradient flows through `logprobs` only."""
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    if estimator not in ESTIMATORS:
        raise RLInputError(f"unknown KL estimator {estimator!r}; choose one of {ESTIMATORS}")
    log_ratio = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    reverse = (-log_ratio).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return (reverse.exp() - reverse - 1).clamp(-_K3_LIMIT, _K3_LIMIT)


def kl_metrics(penalty: torch.Tensor, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """kl/mean and kl/max of a per-token penalty [B, T] over the response tokens (detached; max is
    0 when no token counts)."""
    check_ndim("penalty", penalty, 2, "[B, T]")
    check_same_shape("penalty", penalty, response_mask=response_mask)
    values = penalty.detach()
    mask = response_mask.bool()
    top = values[mask].max() if mask.any() else values.new_zeros(())
    return {"kl/mean": masked_mean(values, response_mask.to(values.dtype)), "kl/max": top}


def sequence_kl_penalty(penalty: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The reward penalty of each sequence [B]: Σ_t m·k_t (verl's `apply_kl_penalty` subtracts
    β·k_t from the token rewards; an outcome-reward advantage such as GRPO's sums them)."""
    check_same_shape("penalty", penalty, response_mask=response_mask)
    return (penalty * response_mask.to(penalty.dtype)).sum(dim=1)
