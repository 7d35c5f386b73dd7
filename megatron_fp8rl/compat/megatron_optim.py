"""Megatron-Core optimizer quirks on installs without Apex/Transformer Engine (the CPU tier).

Owns: `ensure_optimizer_state`. Must not import anything of ours above L1.

megatron-core 0.16.1, without Apex/TE, builds its Adam from `torch.optim.Adam(W)`, and
`DistributedOptimizer.state_dict()` then reads each parameter's `step` from the torch state and
asserts there is exactly one value. A freshly built optimizer that has not stepped has no state at
all, so asking it for a sharded state dict to load a checkpoint into fails with a bare
AssertionError. Megatron's `init_state_fn` creates `exp_avg`/`exp_avg_sq` but not `step`; this
fills in both (zeros), exactly the state a checkpoint load then overwrites.

After the load, the per-parameter `step` tensors still hold those zeros (the dp_reshardable path
copies only param/exp_avg/exp_avg_sq), while the restored iteration count sits in each param
group's `step`; Adam's bias correction reads the per-parameter one, so a resumed run would restart
its bias correction. `restore_adam_step` copies the group value back (measured: without it the
first post-resume update diverges from the uninterrupted run).
"""
from __future__ import annotations

import torch


def ensure_optimizer_state(optimizer) -> None:
    """Give every parameter of a Megatron (chained) optimizer an initialized Adam state."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None:
            continue
        if getattr(chained, "init_state_fn", None) is not None:
            chained.init_state_fn(inner, getattr(chained, "config", None))
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def restore_adam_step(optimizer) -> None:
    """After a checkpoint load: per-parameter Adam `step` = the param group's restored `step`."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                if param in inner.state:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
