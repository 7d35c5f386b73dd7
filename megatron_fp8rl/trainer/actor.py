"""The Megatron actor: the policy being trained, at the run's TP/PP/DP layout.

Owns: building the GPTModel from an HF checkpoint (converted once to torch_dist), per-token
logprobs/entropy of response tokens (vocab-parallel), the old-logprob recompute, the policy update
of one RL step (`update`: the mini-batch and data-parallel loop, the run's `Objective`, Calibrated
Clipping's shadow forwards, one `optimizer.step()` per mini-batch), and saving its weights. Its
weights go out through its `publisher` (trainer/weight_publisher.py: gathering, HF names, the
rollout snapshot, the served FP8 scales the recompute freezes); what its FP8 linears observe
(calibration forward, FP8 metrics) is trainer/fp8_observation.py.
Must not import: cli, trainer.loop, trainer.rl_step, trainer.fp8_observation.
"""
from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron, main_replica_shards
from megatron_fp8rl.convert.integrity import verify_torch_dist
from megatron_fp8rl.fp8.quantizer import weights_updated
from megatron_fp8rl.fp8.serving import Fp8ServingPlan, RolloutFp8, plan_for, require_plan
from megatron_fp8rl.models.hf import build_conversion_target, build_model_from_hf, check_parallel_layout
from megatron_fp8rl.models.megatron_attention import sglang_call_layout
from megatron_fp8rl.models.megatron_fp8_linear import frozen_fp8_scales, held_fp8_weight_scales
from megatron_fp8rl.models.shadow import high_precision_shadow
from megatron_fp8rl.rl.logprobs import vocab_parallel_logprobs_and_entropy
from megatron_fp8rl.rl.noise import NoiseFloor
from megatron_fp8rl.trainer.batch import (
    RolloutBatch,
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
from megatron_fp8rl.trainer.weight_publisher import WeightPublisher


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


def load_weights_only(model: torch.nn.Module, directory: Path) -> None:
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


def micro_batch_logprobs(model: torch.nn.Module, micro: list[RolloutBatch], as_served: bool) -> list[torch.Tensor]:
    """Per micro-batch [B, S] logprobs of `model` (a GPTModel chunk, DDP-wrapped or not) on the
    last pipeline stage ([] on others), forward only (`MegatronActor.logprobs`)."""

    def collect(batch, logits):
        logprobs, _ = MegatronActor.token_logprobs(batch, logits)
        return torch.zeros((), device=logits.device), {"logprobs": logprobs}

    forward = MegatronActor._forward_as_served if as_served else MegatronActor._forward
    out = forward_only(model, micro, forward, collect, micro[0].tokens.shape[1], micro[0].size)
    return [o["logprobs"] for o in out]


def batch_logprobs(model: torch.nn.Module, batch: RolloutBatch, micro_batch_size: int, as_served: bool) -> torch.Tensor:
    """log π [B, S] of every position of `batch` under `model`, in the old-logprob recompute's pass
    structure (micro-batches of `micro_batch_size`, padded alike): real values on the last pipeline
    stage, zeros elsewhere. The recompute (`MegatronActor.old_logprobs`) and the reference policy
    (trainer/reference.py) both run it."""
    per_micro = micro_batch_logprobs(model, micro_batches(batch, micro_batch_size), as_served)
    return (torch.cat(per_micro) if per_micro else torch.zeros_like(batch.rollout_logprobs))[:batch.size]


def _serving_plan(serving: Fp8ServingPlan | None, trainer_fp8: str) -> Fp8ServingPlan:
    """`serving`, checked to be an Fp8ServingPlan for this actor's model.fp8 (None: rollout.fp8=none)."""
    if serving is None:
        return plan_for(RolloutFp8.NONE, trainer_fp8)
    require_plan(serving, "MegatronActor(serving=...)")
    if serving.trainer_fp8 != trainer_fp8:
        raise ValueError(f"MegatronActor: the serving plan is for model.fp8={serving.trainer_fp8}, this actor's "
                         f"model.fp8 is {trainer_fp8}")
    return serving


class MegatronActor:
    """The trained policy: a GPTModel chunk in Megatron DDP with its distributed optimizer, in
    `model_cfg.dtype` (bfloat16: Megatron mixed precision, trainer.megatron_step.wrap_ddp)."""

    def __init__(self, init_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig,
                 objective: Objective, fp8_gemm: str = "auto", serving: Fp8ServingPlan | None = None,
                 calibration_dir: Path | None = None):
        """`train_cfg`: the optimizer's settings (it is an OptimConfig), mini_batches and
        micro_batch_size; `objective`: the run's, built once; `fp8_gemm`: our FP8 linears' GEMM
        (fp8.gemm.GEMMS; RunConfig.trainer_fp8_gemm); `serving`: the FP8 serving plan of
        (model.fp8, rollout.fp8), RunConfig.fp8_plan (None: rollouts without FP8). The rollout
        engine starts from this actor's own `publisher.publish` (trainer/rollout_start.py), so the FP8
        scales it serves are the ones the actor remembers. `calibration_dir`: where Calibrated
        Clipping records each calibration's values (algorithm.calibration.record), or None."""
        self.serving = _serving_plan(serving, model_cfg.fp8)
        """The FP8 serving plan of (model.fp8, rollout.fp8): aligned recomputes run as served."""
        self.hf_config = json.loads((Path(model_cfg.hf_path) / "config.json").read_text())
        check_parallel_layout(self.hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                              parallel_state.get_pipeline_model_parallel_world_size())
        model = build_model_from_hf(self.hf_config, params_dtype=getattr(torch, model_cfg.dtype),
                                    fp8_recipe=model_cfg.recipe(), fp8_backend=model_cfg.fp8_backend, fp8_gemm=fp8_gemm)
        load_weights_only(model, init_dir)
        self.model = wrap_ddp(model, distributed_optimizer=train_cfg.distributed_optimizer)
        self.optimizer = build_optimizer(self.model, train_cfg)
        self.model_cfg, self.train_cfg, self.objective = model_cfg, train_cfg, objective
        self.publisher = WeightPublisher(self.model, self.hf_config, self.serving)
        """Where the weights go out: the rollout snapshot, the served FP8 scales (weight_publisher.py)."""
        self.calibrator = (ClipCalibrator(objective.algo, calibration_dir)
                           if objective.algo.calibration.mode != "none" else None)
        """Calibrated Clipping's state (algorithm.calibration.mode=shadow, or monitor: measured, not
        applied); None otherwise."""

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
        return micro_batch_logprobs(self.model, micro, as_served)

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
        scales = self.publisher.served_scales()
        with nullcontext() if scales is None else self.frozen_fp8(scales):
            return batch_logprobs(self.model, batch, self.train_cfg.micro_batch_size, self.serving.aligned)

    def update(self, batch: RolloutBatch, old_logprobs: torch.Tensor | None, step: int) -> dict[str, float]:
        """RL step `step`'s policy update: one optimizer step per mini-batch on this rank's DP
        slice; metrics averaged over the steps. `old_logprobs` [B, S] (from `old_logprobs()`), or None
        when no recompute ran (bypass, or one mini-batch: trainer.rl_step._recompute_needed); the
        first mini-batch then measures the noise floor from its own forward (objective.py).
        Aligned FP8 rollouts: the first mini-batch (θ = θ_old) trains on a forward in the
        rollout's own arithmetic (`_served_fp8`), so its PPO ratio is exactly 1.
        Calibrated Clipping: the bounds in force clip every mini-batch; a calibrating step also
        runs the shadow forwards on mini-batch m* and recalibrates (trainer/clip_calibration.py).
        The shadow gate (calibration.mode=gate): the shadow's log π_old of every mini-batch before
        the first optimizer step, its log π_θ of each later one just before it trains; the loss
        takes each token's clip decision on their ratio (objective.py); on the steps calibration.
        gate_every leaves out, none of it (the plain FP8 decision). model.fp8_step_weight_scales=
        frozen: the weights' FP8 scales stay θ_old's through the step (`_step_weight_scales`)."""
        dp_size, calibrator = parallel_state.get_data_parallel_world_size(), self.calibrator
        noise = None if old_logprobs is None else self.objective.noise_floor(batch, old_logprobs)
        minis = split_mini_batches(batch, old_logprobs, self.train_cfg.mini_batches,
                                   dp_size * self.train_cfg.micro_batch_size)
        target = calibrator.batch_index(len(minis)) if calibrator is not None and calibrator.due(step) else None
        gate = calibrator is not None and calibrator.gates(step)  # mode=gate, on a gated step (gate_every)
        # the shadow's log π_old before any optimizer step: of m* (calibration), of every mini-batch (gate)
        gate_old = [self.shadow_logprobs(self._local_micro(mini)) for mini in minis] if gate else None
        if target is not None:
            shadow_old = gate_old[target] if gate else self.shadow_logprobs(self._local_micro(minis[target]))
        results, captured = [], []
        with self._step_weight_scales():  # θ_old's FP8 weight scales held (model.fp8_step_weight_scales)
            for index, mini in enumerate(minis):
                micro = self._local_micro(mini)
                current = None
                if gate:  # θ = θ_old for the first mini-batch: its shadow ratio is exactly 1
                    current = gate_old[index] if index == 0 else self.shadow_logprobs(micro)
                    micro = _with_shadow(micro, current, gate_old[index])
                if index == target:
                    shadow = (current if current is not None else shadow_old if index == 0
                              else self.shadow_logprobs(micro))
                terms = MiniBatchTerms(self.objective.denominator(mini, self.train_cfg.micro_batch_size, dp_size),
                                       noise, at_old_policy=index == 0,
                                       clip_bounds=calibrator and calibrator.calibrated,
                                       capture=captured if index == target else None)
                as_served = index == 0 and self.serving.aligned
                with self._served_fp8() if as_served else nullcontext():
                    losses = forward_backward(self.model, self.optimizer, micro,
                                              self._forward_as_served if as_served else self._forward,
                                              partial(self._policy_loss, terms), micro[0].tokens.shape[1],
                                              micro[0].size)
                    results.append(step_result(losses, self.optimizer.step()))
                    weights_updated()  # the device path's FP8 weight cache (fp8/device_quantize.py)
                if noise is None:
                    noise = NoiseFloor.from_metrics(results[0].metrics, self.objective.levels)
        metrics = _mean_metrics(results)
        if target is not None:
            metrics.update(calibrator.update(*_stacked(captured, shadow, shadow_old), step=step))
        if calibrator is not None:
            metrics.update(calibrator.metrics())
            if calibrator.gated:
                metrics["clip/gated"] = float(gate)
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

    def _step_weight_scales(self):
        """The update's FP8 weight scales: model.fp8_step_weight_scales=frozen holds each FP8 linear's
        at θ_old's (the weights on entry, as the recompute quantized them) through every mini-batch
        (models/megatron_fp8_linear.held_fp8_weight_scales); live: each forward's own."""
        frozen = self.model_cfg.fp8_step_weight_scales == "frozen"
        return held_fp8_weight_scales(self.model) if frozen else nullcontext()

    def _served_fp8(self):
        """The update's first forward in the rollout's arithmetic: SGLang's attention calls
        (`_forward_as_served`, whose gradient is the batched call's), the batch-invariant GEMM the
        actor was built with and, for a shared-scale recipe, the FP8 scales the engine served (the
        live quantizers still observe every tensor and advance, `frozen_fp8(observe=True)`). The
        backward is the usual one."""
        scales = self.publisher.served_scales()
        return nullcontext() if scales is None else self.frozen_fp8(scales, observe=True)

    def save_weights(self, directory: Path) -> Path:
        """All ranks: write the current weights as a torch_dist checkpoint (collective)."""
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(self.model.module.sharded_state_dict(), str(directory))
        dist.barrier()
        return directory

    def frozen_fp8(self, scales: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                   observe: bool = False):
        """Context manager: this rank's FP8 linears quantize with `scales`; observe=False changes
        no state (logprob passes), observe=True lets the live quantizers advance (training)."""
        return frozen_fp8_scales(self.model, scales, observe)


def _with_shadow(micro: list[RolloutBatch], shadow: list[torch.Tensor], shadow_old: list[torch.Tensor]):
    """The micro-batches carrying the shadow's log π_θ and log π_old (the gate's clip decision);
    unchanged where this rank computes no loss (the shadow returned nothing: not the last stage)."""
    if not shadow:
        return micro
    return [replace(mb, shadow_logprobs=now, shadow_old_logprobs=old) for mb, now, old in zip(micro, shadow, shadow_old)]


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
        metrics[name if name.startswith(("noise/", "kl/")) else f"train/{name}"] = sum(values) / len(values)
    metrics["train/grad_norm"] = sum(r.grad_norm for r in results) / len(results)
    return metrics
