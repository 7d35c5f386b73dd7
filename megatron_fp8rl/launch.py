"""Process start-up: torch.distributed from torchrun's environment, Megatron's parallel state, seeds.

Owns: reading torchrun's environment variables and creating process groups (entry-point layer L5,
beside cli.py; nothing below L5 reads the environment or creates groups).
Must not import: trainer internals; it only prepares the process for them.
"""
from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from megatron_fp8rl.compat import megatron_cpu, safe_dcp, versions
from megatron_fp8rl.compat.tcp_store import bound_store

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """The process layout or environment cannot start the requested parallel run."""


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the run."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the run."""
    local_rank: int
    """Rank on this node (selects the GPU on the GPU tier)."""
    tensor_parallel: int
    """Tensor-parallel size."""
    pipeline_parallel: int
    """Pipeline-parallel size."""
    data_parallel: int
    """Data-parallel size = world_size / (tensor_parallel * pipeline_parallel)."""
    device: torch.device
    """The device this process computes on."""
    backend: str
    """torch.distributed backend: nccl on GPU, gloo on CPU."""


def read_torchrun_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, or (0, 1, 0) without torchrun."""
    present = [k for k in _TORCHRUN_VARS if k in env]
    if not present:
        return 0, 1, 0
    missing = [k for k in _TORCHRUN_VARS if k not in env]
    if missing:
        raise LaunchError(
            f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} "
            "missing; launch with torchrun or unset them for a single process"
        )
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    except ValueError as exc:
        raise LaunchError(f"torchrun environment variable is not an integer: {exc}") from None
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world, local


def check_layout(world_size: int, tensor_parallel: int, pipeline_parallel: int) -> int:
    """Validate TP x PP against the world size; return the data-parallel size."""
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise LaunchError(
            f"tensor_parallel={tensor_parallel} and pipeline_parallel={pipeline_parallel} "
            "must both be >= 1"
        )
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise LaunchError(
            f"tensor_parallel ({tensor_parallel}) x pipeline_parallel ({pipeline_parallel}) = "
            f"{model_parallel} does not divide the world size {world_size}"
        )
    return world_size // model_parallel


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (Megatron's model-parallel RNG tracker is seeded separately)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def init_distributed(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 1234,
    env: Mapping[str, str] | None = None,
    timeout_minutes: int = 30,
) -> ParallelLayout:
    """Start torch.distributed and Megatron's parallel state for this process.

    First the version gate (compat/versions.py; override: its ALLOW_ENV in `env`). Works under
    torchrun (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) and as a single
    plain process (a one-rank group on 127.0.0.1). Uses NCCL when CUDA is available and gloo
    otherwise, in which case the megatron-core CPU compatibility layer is enabled first. Checkpoint
    loads in this process unpickle nothing but checkpoint metadata (compat/safe_dcp.py).
    """
    env = os.environ if env is None else env
    versions.gate(env)
    rank, world_size, local_rank = read_torchrun_env(env)
    data_parallel = check_layout(world_size, tensor_parallel, pipeline_parallel)
    megatron_cpu.enable()
    safe_dcp.install()
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        # a plain process hosts its one-rank rendezvous on loopback only (compat/tcp_store.py)
        store = None if "MASTER_ADDR" in env else bound_store("127.0.0.1", 0, 1, True, timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
        )
    seed_everything(seed)
    mcore_tp.model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        data_parallel=data_parallel,
        device=device,
        backend=backend,
    )


def shutdown_distributed() -> None:
    """Tear down Megatron's parallel state, the default process group and the CPU shims
    (undoing everything `init_distributed` set up)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    megatron_cpu.disable()

