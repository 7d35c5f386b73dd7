"""Publishing the actor's weights: gathered at any TP/PP/DP, under Hugging Face names, quantized for
the rollout engine, as the streamed snapshot every weight sync and the engine's start checkpoint are.

Owns: `WeightPublisher` (`publish`: the `WeightSnapshot` handed to an engine or a checkpoint writer;
`hf_tensors_in_memory` / `hf_tensors`: the HF stream from memory or from a saved checkpoint), the
gather plan, the device the snapshot is assembled on (`assembly_device`), and, for aligned FP8
rollouts with shared scales, the FP8 scales it shares with the rollout engine (`aligned_scales`)
and remembers as served (`served_scales`, which the actor's recompute and first mini-batch freeze).
Must not import: cli, trainer.loop, trainer.rl_step, trainer.actor.

Where the snapshot is assembled: on the device the weights live on. On a GPU the pieces travel over
NCCL and rank 0 assembles each HF tensor on its GPU, so the engine flattens the buckets there and
hands them over as CUDA IPC handles (rollout/weight_transfer.py `transfer_device`); on the CPU tier
(gloo) everything is on the CPU, byte for byte as before. A combination that would make the gather
copy through host memory on a GPU (CUDA weights over gloo) is refused, naming both.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from megatron_fp8rl.convert.hf_to_megatron import main_replica_shards
from megatron_fp8rl.convert.megatron_to_hf import (
    plan_megatron_to_hf, read_tensor_metadata, read_unit, split_unit,
)
from megatron_fp8rl.models.megatron_fp8_linear import shared_fp8_scales
from megatron_fp8rl.rollout.weights import WeightSnapshot
from megatron_fp8rl.fp8.serving import Fp8ServingPlan, require_plan
from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors

Scales = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def assembly_device(weights: torch.device, backend: str) -> torch.device:
    """Where rank 0 assembles the gathered HF tensors: the weights' own CUDA device when they live
    on one and the pieces travel over NCCL (the snapshot's buckets then stay on the GPU), the CPU
    for CPU weights over gloo (the CPU tier). ValueError for a pairing that would copy through the
    other side's memory: CUDA weights over a non-NCCL group (a silent host round trip on GPU), or
    CPU weights over NCCL."""
    if weights.type == "cuda" and backend == "nccl":
        return weights
    if weights.type == "cpu" and backend != "nccl":
        return torch.device("cpu")
    raise ValueError(f"weight publishing: the actor's weights are on {weights} and the process group's "
                     f"backend is {backend!r}: the gather would copy every piece through "
                     f"{'host' if weights.type == 'cuda' else 'device'} memory; run CUDA weights on NCCL, "
                     "CPU weights on gloo")


def _on(named: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with every tensor on `device`: the fp32 scalar scales the FP8 conversion makes on
    the CPU (served scales, static input scales: 4 bytes each) join the weights on their GPU, so a
    bucket is one device's; a tensor already there is passed as is (the CPU tier: no copy)."""
    for name, tensor in named:
        yield name, tensor.to(device)


@dataclass(frozen=True)
class _GatherPlan:
    """What `WeightPublisher.hf_tensors_in_memory` gathers: this rank's pieces, every rank's
    metadata (key -> global shape and dtype), who holds each (key, layer) slice, the HF units."""

    pieces: list[torch.Tensor]
    metadata: dict
    holders: dict
    units: list

    def unit_shape(self, unit) -> tuple[int, ...]:
        """The assembled slice's shape: the global shape, less the layer axis of a layered key."""
        size = self.metadata[unit.rule.megatron].size
        layered = self.holders[(unit.rule.megatron, unit.layer)][0][5]
        return tuple(size[1:] if layered else size)


class WeightPublisher:
    """The actor's weights on their way out: `model` is the actor's DDP-wrapped GPTModel chunk."""

    def __init__(self, model: torch.nn.Module, hf_config: dict, serving: Fp8ServingPlan):
        """`serving`: the FP8 serving plan of (model.fp8, rollout.fp8), RunConfig.fp8_plan."""
        self.model, self.hf_config = model, hf_config
        self.serving = require_plan(serving, "WeightPublisher")
        """The pair's FP8 serving plan (fp8/serving.py): what is sent, whether scales are shared."""
        self._served: Scales | None = None
        """Shared-scale aligned FP8 rollouts: the scales the engine serves now (`served_scales`)."""

    def served_scales(self) -> Scales | None:
        """Aligned FP8 rollouts of a shared-scale recipe: the FP8 scales the rollout engine serves
        now (those of the last `publish`, the start checkpoint's included); else None
        (a row-group recipe's scales are recomputed, not shared). RuntimeError before any."""
        if not self.serving.shares_scales:
            return None
        if self._served is None:
            raise RuntimeError("aligned FP8 with shared scales: no weights were served yet "
                               "(WeightPublisher.publish makes the engine's start checkpoint and every sync)")
        return self._served

    def publish(self, consume: Callable[[WeightSnapshot], None],
                input_bounds: dict[str, dict[str, float]] | None = None) -> None:
        """All ranks (collective): the current weights as the rollout engine takes them, quantized
        for rollout.fp8 (rollout_fp8.rollout_tensors), as a lazy stream gathered in memory at any
        TP/PP (`hf_tensors_in_memory`), handed to `consume` on global rank 0 as a `WeightSnapshot`
        whose layout (names, shapes, dtypes) is known before any tensor is gathered, so an engine
        checks it and then sends bucket by bucket (rank 0 holds a few buckets, not the model);
        every other rank iterates its (empty) stream to the end at the same time, sending its
        shards. The engine's start checkpoint and every weight sync are this stream. A refusal
        raises on rank 0 while the other ranks may still be in their sends (as they waited at the
        sync's barrier when the whole update was checked first); torchrun's agent stops the other
        workers when one fails. Aligned mode with shared scales: the trainer's FP8 scales go with
        them and become the served ones of the next recompute and first mini-batch. `input_bounds`
        (HF module -> {"input": bound}, `fp8_observation.calibration_forward`): static input
        scales to send too (the start checkpoint of rollout.fp8=per_tensor static). The tensors
        are on `assembly_device` (the GPU's for CUDA weights)."""
        self._served = self.aligned_scales() if self.serving.shares_scales else None
        plan = self._gather_plan()
        convert = partial(rollout_tensors, num_layers=int(self.hf_config["num_hidden_layers"]),
                          plan=self.serving, scales=self._served, input_bounds=input_bounds)
        tensors = _on(convert(self._gathered(plan)), self.device())
        if dist.get_rank() == 0:
            # the same conversion on meta tensors: the layout, known before any tensor is made
            layout = [(name, tuple(t.shape), t.dtype) for name, t in convert(self._layout(plan))]
            consume(WeightSnapshot(tensors, layout))
        for _ in tensors:  # other ranks: their shards go to rank 0 as the stream is iterated
            pass

    def hf_tensors(self, directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the weights saved in `directory` as (HF name, full tensor), one layer slice at a
        time (any TP/PP; read by one process)."""
        units = plan_megatron_to_hf(self.hf_config, read_tensor_metadata(directory))
        for unit in units:
            yield from split_unit(unit, read_unit(directory, unit)).items()

    def hf_tensors_in_memory(self) -> Iterator[tuple[str, torch.Tensor]]:
        """All ranks (collective over the default group): `hf_tensors` of the current weights
        without a checkpoint written and read back, at any TP/PP/DP. Each rank lists the
        ShardedTensors `save_weights` would write for it (main replicas, FP8 state left out); the
        lists are exchanged once (metadata only); then, one (key, layer) slice at a time in the
        conversion plan's order, the ranks holding pieces of it send them to global rank 0, which
        assembles the slice as the checkpoint reader would (same table, same checks) and yields its
        HF tensors. Rank 0's extra memory is one slice; every other rank yields nothing but must
        iterate to the end (its sends happen there). Pieces travel on the tensors' own device
        (NCCL: GPU; gloo: CPU) and rank 0 assembles them there (`assembly_device`)."""
        return self._gathered(self._gather_plan())

    def _gather_plan(self) -> _GatherPlan:
        """All ranks (collective: one all_gather_object of metadata): what `_gathered` sends and
        assembles."""
        pieces, listed = [], []
        for tensor in main_replica_shards(self.model.module.sharded_state_dict()):
            if not isinstance(tensor, ShardedTensor) or tensor.key.endswith("_extra_state"):
                continue
            layered = tensor.prepend_axis_num == 1
            pieces.append(tensor.data.detach())
            listed.append((tensor.key, tensor.global_offset[0] if layered else None,
                           tuple(tensor.global_shape), tuple(tensor.global_offset[int(layered):]),
                           tuple(tensor.local_shape), tensor.dtype, layered))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, listed)
        metadata, holders = {}, {}
        for source, entries in enumerate(everyone):
            for index, (key, layer, global_shape, offset, local_shape, dtype, layered) in enumerate(entries):
                metadata[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(global_shape), [])
                holders.setdefault((key, layer), []).append((source, index, offset, local_shape, dtype, layered))
        units = list(plan_megatron_to_hf(self.hf_config, metadata))
        for unit in units:
            if (unit.rule.megatron, unit.layer) not in holders:
                raise ValueError(f"no rank holds {unit.rule.megatron} (layer {unit.layer}) of the model")
        return _GatherPlan(pieces, metadata, holders, units)

    def _gathered(self, plan: _GatherPlan) -> Iterator[tuple[str, torch.Tensor]]:
        rank, device = dist.get_rank(), self.device()
        for unit in plan.units:
            parts = plan.holders[(unit.rule.megatron, unit.layer)]
            if rank != 0:
                for source, index, *_ in parts:
                    if source == rank:
                        dist.send(plan.pieces[index].contiguous(), dst=0)
                continue
            target = torch.empty(plan.unit_shape(unit), dtype=parts[0][4], device=device)
            for source, index, offset, local_shape, dtype, _ in parts:
                if source == 0:
                    piece = plan.pieces[index]
                else:
                    piece = torch.empty(local_shape, dtype=dtype, device=device)
                    dist.recv(piece, src=source)
                target[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))] = piece
            yield from split_unit(unit, target).items()

    @staticmethod
    def _layout(plan: _GatherPlan) -> Iterator[tuple[str, torch.Tensor]]:
        """`_gathered`'s stream on meta tensors: its names, shapes and dtypes, no data, no
        communication (the same `split_unit`, so the same names in the same order)."""
        for unit in plan.units:
            dtype = plan.holders[(unit.rule.megatron, unit.layer)][0][4]
            yield from split_unit(unit, torch.empty(plan.unit_shape(unit), dtype=dtype, device="meta")).items()

    def device(self) -> torch.device:
        """Where pieces are received and the snapshot is assembled (`assembly_device` of the
        model's weights and the default group's backend)."""
        return assembly_device(next(self.model.parameters()).device, dist.get_backend())

    def aligned_scales(self) -> Scales:
        """All ranks (collective): {(global layer, linear path): (weight_scale_inv, input_scale_inv)}
        of every FP8 linear of the whole model, fp32 scalars on CPU: the scales the next forward
        would use (a calibrated weight's from its current values, amax-reduced over TP; inputs the
        predicted bound). ValueError when the trainer is not FP8 or has no input bounds yet."""
        local = shared_fp8_scales(self.model)
        if not local and dist.get_world_size() == 1:
            raise ValueError("aligned FP8 rollouts need an FP8 trainer (model.fp8); this model has no FP8 linears")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return {key: value for part in gathered for key, value in part.items()}
