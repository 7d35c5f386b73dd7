"""The Megatron actor: the policy being trained, at the run's TP/PP/DP layout.

Owns: building the GPTModel from an HF checkpoint (converted once to torch_dist), per-token
logprobs/entropy of response tokens (vocab-parallel), the old-logprob recompute, the policy update
of one RL step (`update`: the mini-batch and data-parallel loop, the run's `Objective`, Calibrated
Clipping's shadow forwards, one `optimizer.step()` per mini-batch), streaming its weights out under
Hugging Face names (for rollout weight sync and the final export) and, for aligned FP8 rollouts,
the FP8 scales it shares with the rollout engine and remembers as served (`weights_for_rollout`).
Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron, main_replica_shards
from megatron_fp8rl.convert.integrity import verify_torch_dist
from megatron_fp8rl.fp8.quantizer import weights_updated
from megatron_fp8rl.convert.megatron_to_hf import (
    plan_megatron_to_hf, read_tensor_metadata, read_unit, split_unit,
)
from megatron_fp8rl.models.family import HF_LAYER
from megatron_fp8rl.models.hf import build_conversion_target, build_model_from_hf, check_parallel_layout
from megatron_fp8rl.models.megatron_attention import sglang_call_layout
from megatron_fp8rl.models.megatron_fp8_linear import (
    decoder_layers, fp8_layer_stats, frozen_fp8_scales, shared_fp8_scales,
)
from megatron_fp8rl.models.registry import family_for
from megatron_fp8rl.models.shadow import high_precision_shadow
from megatron_fp8rl.rl.logprobs import vocab_parallel_logprobs_and_entropy
from megatron_fp8rl.rl.noise import NoiseFloor
from megatron_fp8rl.rollout.engine import RolloutSample
from megatron_fp8rl.rollout.weights import WeightSnapshot
from megatron_fp8rl.trainer.batch import (
    RolloutBatch,
    build_batch,
    micro_batches,
    prompt_lengths,
    split_mini_batches,
)
from megatron_fp8rl.trainer.clip_calibration import ClipCalibrator
from megatron_fp8rl.trainer.config import ModelConfig, TrainConfig
from megatron_fp8rl.trainer.megatron_step import (
    StepResult, build_optimizer, forward_backward, forward_only, step_result, wrap_ddp,
)
from megatron_fp8rl.trainer.objective import MiniBatchTerms, Objective
from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors, shares_scales


def convert_initial_checkpoint(hf_path: Path, output: Path) -> Path:
    """HF folder -> torch_dist at `output`, once, in this process: every rank calls it (a
    collective over the default group). Each rank builds its TP/PP shard of the model on the meta
    device and sends rank 0 the chunks it owns; rank 0 writes the whole checkpoint (the converter
    writes from one process), which loads at any layout. Reused when `output` already exists
    (rank 0 decides for all): the caller has checked that it was converted from the same
    checkpoint (trainer/run_dir.py). A failure on rank 0 raises on every rank."""
    reuse = [output.exists()]
    dist.broadcast_object_list(reuse, src=0)
    if reuse[0]:
        return output
    hf_config = json.loads((Path(hf_path) / "config.json").read_text())
    target = build_conversion_target(hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                                     parallel_state.get_pipeline_model_parallel_world_size())
    state = target.sharded_state_dict()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(main_replica_shards(state), gathered, dst=0)
    failure = [None]
    try:
        if dist.get_rank() == 0:
            convert_hf_to_megatron(hf_path, output, state, progress=False,
                                   other_shards=[shard for shards in gathered[1:] for shard in shards])
    except Exception as error:
        failure = [f"{type(error).__name__}: {error}"]
        raise
    finally:
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise RuntimeError(f"converting {hf_path} to Megatron failed on rank 0: {failure[0]}")
    return output


def _load_weights_only(model: torch.nn.Module, directory: Path) -> None:
    """Load the weights of a converted HF checkpoint; FP8 scaling state (`_extra_state`), which
    such a checkpoint does not have, starts fresh. Any other missing tensor is an error."""
    verify_torch_dist(directory)
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = model.load_state_dict(dist_checkpointing.load(sharded, str(directory)),
                                                strict=False)
    weights_updated()
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{directory}: missing tensors {missing}, unexpected {unexpected}")


@dataclass(frozen=True)
class _GatherPlan:
    """What `MegatronActor.hf_tensors_in_memory` gathers: this rank's pieces, every rank's
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


class MegatronActor:
    """The trained policy: a GPTModel chunk in Megatron DDP with its distributed optimizer, in
    `model_cfg.dtype` (bfloat16: Megatron mixed precision, trainer.megatron_step.wrap_ddp)."""

    def __init__(self, init_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig,
                 objective: Objective, fp8_gemm: str = "auto", rollout_fp8: str = "none"):
        """`train_cfg`: the optimizer's settings (it is an OptimConfig), mini_batches and
        micro_batch_size; `objective`: the run's, built once; `fp8_gemm`: our FP8 linears' GEMM
        (fp8.linear.GEMMS; RunConfig.trainer_fp8_gemm); `rollout_fp8`: rollout.fp8. The rollout
        engine starts from this actor's own `weights_for_rollout` (trainer/loop.py), so the FP8
        scales it serves are the ones the actor remembers."""
        self.hf_config = json.loads((Path(model_cfg.hf_path) / "config.json").read_text())
        check_parallel_layout(self.hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                              parallel_state.get_pipeline_model_parallel_world_size())
        model = build_model_from_hf(self.hf_config, params_dtype=getattr(torch, model_cfg.dtype),
                                    fp8_recipe=model_cfg.recipe(), fp8_backend=model_cfg.fp8_backend, fp8_gemm=fp8_gemm)
        _load_weights_only(model, init_dir)
        self.model = wrap_ddp(model, distributed_optimizer=train_cfg.distributed_optimizer)
        self.optimizer = build_optimizer(self.model, train_cfg)
        self.model_cfg, self.train_cfg, self.objective = model_cfg, train_cfg, objective
        self.rollout_fp8 = rollout_fp8
        self.calibrator = ClipCalibrator(objective.algo) if objective.algo.clip_calibration != "none" else None
        """Calibrated Clipping's state (algorithm.clip_calibration=shadow, or monitor: measured, not
        applied); None otherwise."""
        self._served: dict | None = None
        """Shared-scale aligned FP8 rollouts: the scales the engine serves now (`_served_scales`)."""

    @staticmethod
    def _forward(chunk: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        return chunk(batch.tokens, batch.position_ids, None)

    @staticmethod
    def token_logprobs(batch: RolloutBatch, logits: torch.Tensor):
        """(logprobs, entropy) [B, S] of each position's target token, over the TP-split vocab."""
        group = parallel_state.get_tensor_model_parallel_group()
        return vocab_parallel_logprobs_and_entropy(logits, batch.target_ids, group)

    @staticmethod
    def _forward_as_served(chunk: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """The logprob forward: attention call for call as SGLang's torch_native backend served
        each sequence (prompt prefill, then one row at a time), so that with the exact FP8 GEMM
        the recompute has the rollout's bits (models/megatron_attention.py; TE attention, the
        GPU tier, ignores the layout)."""
        with sglang_call_layout(prompt_lengths(batch.response_mask)):
            return chunk(batch.tokens, batch.position_ids, None)

    def logprobs(self, micro: list[RolloutBatch], as_served: bool = True) -> list[torch.Tensor]:
        """Per micro-batch [B, S] logprobs on the last pipeline stage ([] on others), computed
        as the rollout engine computed them (`_forward_as_served`; as_served=False: one batched
        attention call, as the training forward)."""

        def collect(batch, logits):
            logprobs, _ = self.token_logprobs(batch, logits)
            return torch.zeros((), device=logits.device), {"logprobs": logprobs}

        forward = self._forward_as_served if as_served else self._forward
        out = forward_only(self.model, micro, forward, collect, micro[0].tokens.shape[1], micro[0].size)
        return [o["logprobs"] for o in out]

    def shadow_logprobs(self, micro: list[RolloutBatch]) -> list[torch.Tensor]:
        """`logprobs` of the high-precision shadow (Calibrated Clipping; models/shadow.py): the same
        weights with every FP8 linear computed in the trainer's dtype, no FP8 scaling state touched;
        a bf16 trainer without FP8: its forward with the weights upcast to float32."""
        with high_precision_shadow(self.model):
            return self.logprobs(micro, as_served=False)

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """log π_old [B, S] of every position, recomputed before the update (real values on the
        last pipeline stage, zeros elsewhere, where the loss is not computed). Aligned FP8
        rollouts: in the rollout's arithmetic (SGLang's attention calls and, for a shared-scale
        recipe, the served scales), bit-identical to it through every decoder layer. Otherwise
        those bits are out of reach and the recompute runs as the training forward does (one
        batched attention call a layer instead of one a row, ~S times fewer calls); in float32 the
        first mini-batch's PPO ratio is then exactly 1."""
        micro = micro_batches(batch, self.train_cfg.micro_batch_size)
        scales = self._served_scales()
        with nullcontext() if scales is None else self.frozen_fp8(scales):
            per_micro = self.logprobs(micro, as_served=self.rollout_fp8 == "aligned")
        return (torch.cat(per_micro) if per_micro else torch.zeros_like(batch.rollout_logprobs))[:batch.size]

    def update(self, batch: RolloutBatch, old_logprobs: torch.Tensor | None, step: int) -> dict[str, float]:
        """RL step `step`'s policy update: one optimizer step per mini-batch on this rank's DP
        slice; metrics averaged over the steps. `old_logprobs` [B, S] (from `old_logprobs()`), or None
        when no recompute ran (bypass, or one mini-batch: trainer.rl_step._recompute_needed); the
        first mini-batch then measures the noise floor from its own forward (objective.py).
        Aligned FP8 rollouts: the first mini-batch (θ = θ_old) trains on a forward in the
        rollout's own arithmetic (`_served_fp8`), so its PPO ratio is exactly 1.
        Calibrated Clipping: the bounds in force clip every mini-batch; a calibrating step also
        runs the shadow forwards on mini-batch m* and recalibrates (trainer/clip_calibration.py)."""
        dp_size, calibrator = parallel_state.get_data_parallel_world_size(), self.calibrator
        noise = None if old_logprobs is None else self.objective.noise_floor(batch, old_logprobs)
        minis = split_mini_batches(batch, old_logprobs, self.train_cfg.mini_batches,
                                   dp_size * self.train_cfg.micro_batch_size)
        target = calibrator.batch_index(len(minis)) if calibrator is not None and calibrator.due(step) else None
        if target is not None:
            shadow_old = self.shadow_logprobs(self._local_micro(minis[target]))
        results, captured = [], []
        for index, mini in enumerate(minis):
            micro = self._local_micro(mini)
            if index == target:
                shadow = shadow_old if index == 0 else self.shadow_logprobs(micro)
            terms = MiniBatchTerms(self.objective.denominator(mini, self.train_cfg.micro_batch_size, dp_size),
                                   noise, at_old_policy=index == 0, clip_bounds=calibrator and calibrator.calibrated,
                                   capture=captured if index == target else None)
            as_served = index == 0 and self.rollout_fp8 == "aligned"
            with self._served_fp8() if as_served else nullcontext():
                losses = forward_backward(self.model, self.optimizer, micro,
                                          self._forward_as_served if as_served else self._forward,
                                          partial(self._policy_loss, terms), micro[0].tokens.shape[1], micro[0].size)
                results.append(step_result(losses, self.optimizer.step()))
                weights_updated()  # the device path's FP8 weight cache (fp8/device_quantize.py)
            if noise is None:
                noise = NoiseFloor.from_metrics(results[0].metrics, self.objective.levels)
        metrics = _mean_metrics(results)
        if target is not None:
            metrics.update(calibrator.update(*_stacked(captured, shadow, shadow_old)))
        if calibrator is not None:
            metrics.update(calibrator.metrics())
        return metrics

    def _policy_loss(self, terms: MiniBatchTerms, batch: RolloutBatch, logits: torch.Tensor):
        """The schedule's loss of one micro-batch: the objective's, on the logits' token logprobs."""
        logprobs, entropy = self.token_logprobs(batch, logits)
        return self.objective.loss(terms, batch, logprobs, entropy)

    def _local_micro(self, mini: RolloutBatch) -> list[RolloutBatch]:
        """This rank's DP slice of one (padded) mini-batch as micro-batches."""
        rows = torch.arange(mini.size).chunk(parallel_state.get_data_parallel_world_size())
        return micro_batches(mini.select(rows[parallel_state.get_data_parallel_rank()]),
                             self.train_cfg.micro_batch_size)

    def _served_fp8(self):
        """The update's first forward in the rollout's arithmetic: SGLang's attention calls
        (`_forward_as_served`, whose gradient is the batched call's), the batch-invariant GEMM the
        actor was built with and, for a shared-scale recipe, the FP8 scales the engine served (the
        live quantizers still observe every tensor and advance, `frozen_fp8(observe=True)`). The
        backward is the usual one."""
        scales = self._served_scales()
        return nullcontext() if scales is None else self.frozen_fp8(scales, observe=True)

    def _served_scales(self) -> dict | None:
        """Aligned FP8 rollouts of a shared-scale recipe: the FP8 scales the rollout engine serves
        now (those of the last `weights_for_rollout`, the start checkpoint's included); else None
        (a row-group recipe's scales are recomputed, not shared). RuntimeError before any."""
        if not shares_scales(self.rollout_fp8, self.model_cfg.fp8):
            return None
        if self._served is None:
            raise RuntimeError("aligned FP8 with shared scales: no weights were served yet "
                               "(weights_for_rollout makes the engine's start checkpoint and every sync)")
        return self._served

    def weights_for_rollout(self, consume: Callable[[WeightSnapshot], None],
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
        them and become the served ones of the next recompute and first mini-batch. `input_bounds` (HF module -> {"input": bound}, `calibration_forward`):
        static input scales to send too (the start checkpoint of rollout.fp8=per_tensor static)."""
        shared = shares_scales(self.rollout_fp8, self.model_cfg.fp8)
        self._served = self.aligned_scales() if shared else None
        plan = self._gather_plan()
        convert = partial(rollout_tensors, num_layers=int(self.hf_config["num_hidden_layers"]),
                          rollout_fp8=self.rollout_fp8, scales=self._served, trainer_fp8=self.model_cfg.fp8,
                          input_bounds=input_bounds)
        tensors = convert(self._gathered(plan))
        if dist.get_rank() == 0:
            # the same conversion on meta tensors: the layout, known before any tensor is made
            layout = [(name, tuple(t.shape), t.dtype) for name, t in convert(self._layout(plan))]
            consume(WeightSnapshot(tensors, layout))
        for _ in tensors:  # other ranks: their shards go to rank 0 as the stream is iterated
            pass

    def calibration_forward(self, prompts: list[list[int]]) -> dict[str, dict[str, float]]:
        """All ranks (collective): no-grad forwards of this actor over `prompts` (token ids, one
        prompt a forward), before any training. Its FP8 linears' live quantizers observe them, so the recipe's own rule
        predicts the input scales the first rollout serves (`aligned_scales`); and every decoder
        linear's max |input| is recorded, maxed over all ranks (TP shards, pipeline stages): HF
        module -> {"input": bound}, each HF linear of a fused Megatron one getting its bound (the
        static input scales of rollout.fp8=per_tensor, TE's 'max' calibration)."""
        family = family_for(self.hf_config)
        bounds: dict[tuple[int, str], float] = {}
        hooks = []

        def record(key):
            def hook(module, args):
                amax = float(args[0].detach().abs().float().max())
                bounds[key] = max(bounds.get(key, 0.0), amax)
            return hook

        for layer in decoder_layers(self.model):
            for linear in family.linears:
                module = layer.get_submodule(linear.megatron)
                hooks.append(module.register_forward_pre_hook(record((layer.layer_number - 1, linear.megatron))))
        try:
            with torch.no_grad():  # one prompt at a time: no padding positions in the maxima
                for index, ids in enumerate(prompts):
                    sample = RolloutSample(index, list(ids), [], [], "stop", 0)
                    self.logprobs([build_batch([sample], torch.zeros(1), len(ids))], as_served=False)
        finally:
            for hook in hooks:
                hook.remove()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bounds)
        merged: dict[tuple[int, str], float] = {}
        for part in everyone:
            for key, value in part.items():
                merged[key] = max(merged.get(key, 0.0), value)
        hf_modules = {linear.megatron: linear.hf for linear in family.linears}
        return {HF_LAYER.format(layer=layer) + module: {"input": value}
                for (layer, path), value in sorted(merged.items()) for module in hf_modules[path]}

    def fp8_metrics(self) -> dict[str, float]:
        """This rank's FP8 quantization statistics of its last forward/backward, for tensorboard:
        `fp8/<layer>.<role>/<stat>` per FP8 linear (role: input, weight, grad_output; stat: bound,
        saturated_fraction, underflow_fraction, recalibrated) and their means over layers as
        `fp8/<role>/<stat>_mean`. Empty when the trainer is not in FP8. Rank 0 holds TP shard 0 of
        the first pipeline stage's layers."""
        metrics, sums = {}, {}
        for name, stats in fp8_layer_stats(self.model).items():
            role = name.rsplit(".", 1)[-1]
            for stat in ("bound", "saturated_fraction", "underflow_fraction", "recalibrated"):
                metrics[f"fp8/{name}/{stat}"] = stats[stat]
                sums.setdefault(f"fp8/{role}/{stat}_mean", []).append(stats[stat])
        metrics.update({key: sum(values) / len(values) for key, values in sums.items()})
        return metrics

    def save_weights(self, directory: Path) -> Path:
        """All ranks: write the current weights as a torch_dist checkpoint (collective)."""
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(self.model.module.sharded_state_dict(), str(directory))
        dist.barrier()
        return directory

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
        (NCCL: GPU; gloo: CPU)."""
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
        rank = dist.get_rank()
        for unit in plan.units:
            parts = plan.holders[(unit.rule.megatron, unit.layer)]
            if rank != 0:
                for source, index, *_ in parts:
                    if source == rank:
                        dist.send(plan.pieces[index].contiguous(), dst=0)
                continue
            target = torch.empty(plan.unit_shape(unit), dtype=parts[0][4])
            for source, index, offset, local_shape, dtype, _ in parts:
                if source == 0:
                    piece = plan.pieces[index]
                else:
                    piece = torch.empty(local_shape, dtype=dtype, device=self._transfer_device())
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

    @staticmethod
    def _transfer_device() -> torch.device:
        """Where point-to-point pieces live: the GPU for NCCL, the CPU for gloo."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def aligned_scales(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
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

    def frozen_fp8(self, scales: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                   observe: bool = False):
        """Context manager: this rank's FP8 linears quantize with `scales`; observe=False changes
        no state (logprob passes), observe=True lets the live quantizers advance (training)."""
        return frozen_fp8_scales(self.model, scales, observe)


def _stacked(captured: list, shadow: list[torch.Tensor], shadow_old: list[torch.Tensor]):
    """(fp8, fp8_old, shadow, shadow_old, advantages, mask) [b, S] of m*'s rows on this rank; empty
    [0, S] tensors where the rank computed no loss (not the last pipeline stage)."""
    if not captured:
        empty = torch.zeros(0, 1)
        return (empty,) * 6
    fp8, fp8_old, advantages, mask = (torch.cat(parts) for parts in zip(*captured))
    return fp8, fp8_old, torch.cat(shadow), torch.cat(shadow_old), advantages, mask


def _mean_metrics(results: list[StepResult]) -> dict[str, float]:
    """Each metric averaged over the mini-batches that report it (bypass: π_old-dependent ones,
    such as mismatch and clip attribution, exist for the first mini-batch only)."""
    names = dict.fromkeys(name for r in results for name in r.metrics)
    metrics = {}
    for name in names:
        values = [r.metrics[name] for r in results if name in r.metrics]
        metrics[name if name.startswith("noise/") else f"train/{name}"] = sum(values) / len(values)
    metrics["train/grad_norm"] = sum(r.grad_norm for r in results) / len(results)
    return metrics
