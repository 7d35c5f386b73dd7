"""Atomic, resumable training checkpoints in Megatron's torch_dist format.

Owns: saving and loading model + optimizer (sharded, any layout Megatron can reshard), every
rank's RNG states, and the trainer's own state (step, data position, weight version; JSON), with
keep-last-K pruning, and finding the newest intact checkpoint to resume from (damaged ones are
skipped with the reason). Must not import: cli.

Layout of `root`:
    step_00000012/          a complete checkpoint (dist_checkpointing files + trainer_state.json
                            + checksums.sha256, verified at load)
    latest                  text file naming the newest complete checkpoint
    .tmp-step_00000014/     a save in progress or interrupted; ignored and removed later
`latest` is for people and other tools; resume takes the newest step_* folder that is intact.
A checkpoint becomes visible only by the rename of its finished temporary directory, so a crash
mid-save leaves the previous checkpoint as the latest. Our own files hold no pickles: RNG states
are stored as tensors, trainer state as JSON. Megatron's format pickles its metadata and small
objects; the process loads those through restricted loaders (compat/safe_dcp.py, installed by
launch.init_distributed), so a crafted checkpoint fails to load instead of running code.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_fp8rl.compat.megatron_optim import ensure_optimizer_state, restore_adam_step
from megatron_fp8rl.convert.integrity import verify_torch_dist, write_manifest
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.fp8.quantizer import weights_updated

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"


@dataclass
class CheckpointConfig:
    """Where and how often checkpoints are written."""

    dir: str = ""
    """Checkpoint root; empty means <run_dir>/checkpoints (the trainer fills it in at start).
    Checkpointing cannot be turned off: a run always saves after its last step."""
    every: int = 10
    """Save every N RL steps, and always after the last step (0: only after the last step)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a successful save."""
    optimizer_sharding: str = "dp_reshardable"
    """Megatron distributed-optimizer format (Megatron-LM's default): fully parallel, resumes at
    the same TP/PP. 'fully_reshardable' is refused: megatron-core 0.16.1 without Apex/TE fails to
    load it (KeyError 'step' in DistributedOptimizer._set_main_param_and_optimizer_states)."""

    def __post_init__(self):
        if self.optimizer_sharding != "dp_reshardable":
            raise ValueError(f"checkpoint.optimizer_sharding={self.optimizer_sharding!r}: only "
                             "'dp_reshardable' is supported")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's RNG states as uint8/int64 tensors (no pickles)."""
    py_version, py_state, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([py_version, *py_state], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss is not None, py_gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = state
    return states


def _set_rng_tensors(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch"].to(torch.uint8))
    python = states["python"].tolist()
    has_gauss, gauss = states["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    pos, np_has_gauss = states["numpy_pos"].tolist()
    np.random.set_state(("MT19937", states["numpy"].numpy().astype(np.uint32), pos, np_has_gauss,
                         float(states["numpy_gauss"][0])))
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].to(torch.uint8))
    tracker = {k.removeprefix("tracker."): v.to(torch.uint8) for k, v in states.items()
               if k.startswith("tracker.")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def _rng_sharded(states: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    """One row per global rank: every rank saves and restores its own RNG states."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        name: ShardedTensor.from_rank_offsets(f"rng.{name}", tensor.unsqueeze(0).contiguous(),
                                              (0, rank, world), replica_id=0)
        for name, tensor in states.items()
    }


def _unwrap(model):
    """The GPTModel inside Megatron's DDP wrapper: checkpoint keys must not carry 'module.'."""
    return getattr(model, "module", model)


def _sharded_state(model, optimizer, sharding: str, is_loading: bool) -> dict[str, Any]:
    model_state = _unwrap(model).sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding}
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata),
        "rng": _rng_sharded(_rng_tensors()),
    }


def save_checkpoint(cfg: CheckpointConfig, step: int, model, optimizer,
                    trainer_state: dict[str, Any]) -> Path:
    """Write checkpoint `step` atomically on all ranks; prune to `keep_last`. Collective."""
    root = Path(cfg.dir)
    tmp, final = root / f".tmp-step_{step:08d}", _step_dir(root, step)
    if dist.get_rank() == 0:
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, cfg.optimizer_sharding, False), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        state = dict(trainer_state, step=step, optimizer_sharding=cfg.optimizer_sharding)
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, final.name)
        _prune(root, cfg.keep_last)
    dist.barrier()
    return final


def _write_latest(root: Path, name: str) -> None:
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, root / LATEST)


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).is_file())
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint folder `path` cannot be resumed from, or None when it is intact: its trainer
    state is missing or not our JSON, a file differs from its manifest, or `.metadata` is missing,
    corrupt or crafted."""
    state_file = Path(path) / TRAINER_STATE
    if not state_file.is_file():
        return f"no {TRAINER_STATE}"
    try:
        state = json.loads(state_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{state_file} is not valid JSON ({exc})"
    if not isinstance(state, dict) or not {"step", "optimizer_sharding"} <= state.keys():
        return f"{state_file} lacks 'step' or 'optimizer_sharding'"
    try:
        verify_torch_dist(path)
    except (CheckpointError, pickle.UnpicklingError) as exc:
        return str(exc)
    return None


def newest_intact_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest step_* checkpoint under `root` that is intact (None if there is none), and one
    line per newer checkpoint skipped, naming it and why. CheckpointError when checkpoints exist
    but none is intact: starting over would silently discard the run."""
    skipped = []
    for path in sorted(Path(root).glob("step_*"), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path}: {problem}")
    if skipped:
        raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(skipped))
    return None, skipped


def load_checkpoint(path: str | Path, model, optimizer, verify: bool = True) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from `path`; return the trainer state.
    `verify=False` when the caller has already checked it (newest_intact_checkpoint)."""
    path = Path(path)
    problem = checkpoint_problem(path) if verify else None
    if problem is not None:
        raise CheckpointError(f"cannot resume from {path}: {problem}")
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    ensure_optimizer_state(optimizer)
    sharded = _sharded_state(model, optimizer, trainer_state["optimizer_sharding"], True)
    loaded = dist_checkpointing.load(sharded, str(path))
    _unwrap(model).load_state_dict(loaded["model"])
    weights_updated()  # the device path's FP8 weight cache (fp8/device_quantize.py)
    with torch.no_grad():  # fp32 main params are views of parameters that require grad
        optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_step(optimizer)
    _set_rng_tensors({name: tensor.squeeze(0) for name, tensor in loaded["rng"].items()})
    return trainer_state
