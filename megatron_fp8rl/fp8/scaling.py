"""Delayed-scaling state with Transformer Engine's semantics.

Owns: the amax history of one quantizer and the update that turns it into the next scale, step
for step what TE's `_amax_and_scale_update` does (transformer_engine/pytorch/quantization.py):
1. the tensor's amax is written into history row 0 (max over the calls of one step);
2. row 0 is all-reduced (MAX) over the amax-reduction process group;
3. bound = amax_compute_algo(history): 'max' over the rows (the window), or 'most_recent' (row 0);
4. scale = (fp8_max / bound) / 2**margin, keeping the old scale when bound <= 0 or non-finite;
5. the history rolls by one (row 0 moves to the end) and row 0 is zeroed for the next step.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch only; the
collective is torch.distributed on a group the caller passes).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fp8rl.fp8.quantize import scale_from_bound

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def check_amax_compute_algo(name: str) -> str:
    """`name` if it is a known amax_compute_algo, else ValueError listing the valid ones."""
    if name not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"unknown amax_compute_algo {name!r}; valid: {', '.join(AMAX_COMPUTE_ALGOS)}"
        )
    return name


def bound_from_history(amax_history: torch.Tensor, algo: str = "max") -> torch.Tensor:
    """The bound for the next step from history [L, ...]: max over dim 0, or row 0.

    NaN anywhere in the window propagates into the bound (TE's torch.max does the same), which
    makes `scale_from_bound` keep the old scale.
    """
    check_amax_compute_algo(algo)
    if algo == "max":
        return torch.max(amax_history, dim=0).values
    return amax_history[0].clone()


def roll_amax_history_(amax_history: torch.Tensor) -> torch.Tensor:
    """In place: roll history [L, ...] by -1 along dim 0 and zero row 0 (TE's
    `_update_amax_history`), so row 0 collects the next step's amax."""
    if amax_history.shape[0] > 1:
        amax_history.copy_(torch.roll(amax_history, -1, 0))
    amax_history[0].fill_(0.0)
    return amax_history


def all_reduce_max_(values: torch.Tensor, group=None) -> torch.Tensor:
    """In place MAX all-reduce over `group` when torch.distributed runs with more than one rank
    in it; a no-op otherwise. Every rank must call it the same number of times."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


class DelayedScalingState:
    """Amax history [history_len] and scale [] of one per-tensor quantizer (fp32 tensors).

    The scale starts at 1 and the history at zeros, as in TE.
    """

    def __init__(self, history_len: int, device: torch.device | str = "cpu"):
        if history_len < 1:
            raise ValueError(f"amax history length must be >= 1, found {history_len}")
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    def record(self, amax: torch.Tensor) -> None:
        """Fold this call's amax into row 0 (max with what the step recorded so far)."""
        current = self.amax_history[0]
        self.amax_history[0] = torch.where(torch.isnan(amax), amax, torch.maximum(current, amax))

    def update(
        self, algo: str, fp8_max: float, margin: int, group=None, reduce: bool = True
    ) -> torch.Tensor:
        """Steps 2-5 of the module docstring (step 2 only when `reduce`; `group` None is the
        default group); returns the new scale."""
        if reduce:
            row0 = self.amax_history[0:1].clone()
            self.amax_history[0:1] = all_reduce_max_(row0, group)
        bound = bound_from_history(self.amax_history, algo)
        self.scale = scale_from_bound(bound, fp8_max, margin, self.scale)
        roll_amax_history_(self.amax_history)
        return self.scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the history and scale."""
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor], name: str = "quantizer") -> None:
        """Restore from `state_dict()`; the history length must match."""
        history = state["amax_history"]
        if tuple(history.shape) != tuple(self.amax_history.shape):
            raise ValueError(
                f"{name}.amax_history: expected shape {tuple(self.amax_history.shape)}, "
                f"found {tuple(history.shape)} (was the checkpoint saved with another "
                "amax_history_len?)"
            )
        self.amax_history = history.detach().clone().float().to(self.amax_history.device)
        self.scale = state["scale"].detach().clone().float().reshape(()).to(self.scale.device)
