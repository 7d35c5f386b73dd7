"""The Megatron actor: the policy being trained, at the run's TP/PP/DP layout.

Owns: building the GPTModel from an HF checkpoint (converted once to torch_dist), per-token
logprobs/entropy of response tokens (vocab-parallel), an optimizer step on a policy loss,
streaming its weights out under Hugging Face names (for rollout weight sync and the final export),
and, for aligned FP8 rollouts, the FP8 scales it shares with the rollout engine (`aligned_scales`)
and the frozen-scale mode its old-logprob recompute runs in (`frozen_fp8`).
Must not import: cli.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from megatron_fp8rl.compat.megatron_attention import sglang_call_layout
from megatron_fp8rl.compat.megatron_fp8_linear import (
    fp8_layer_stats, frozen_fp8_scales, high_precision_fp8_linears, shared_fp8_scales,
)
from megatron_fp8rl.compat.process_env import torchrun_free_env
from megatron_fp8rl.convert.integrity import verify_torch_dist
from megatron_fp8rl.convert.megatron_to_hf import (
    plan_megatron_to_hf, read_tensor_metadata, read_unit, split_unit,
)
from megatron_fp8rl.models.hf import build_model_from_hf, check_parallel_layout
from megatron_fp8rl.rl.logprobs import vocab_parallel_logprobs_and_entropy
from megatron_fp8rl.trainer.batch import prompt_lengths
from megatron_fp8rl.trainer.config import ModelConfig
from megatron_fp8rl.trainer.megatron_step import (
    OptimConfig, StepResult, build_optimizer, forward_only, train_step, wrap_ddp,
)


def convert_initial_checkpoint(hf_path: Path, output: Path) -> Path:
    """HF folder -> torch_dist at `output`, once (rank 0, in a one-process subprocess: the
    converter needs Megatron at TP=1/PP=1). Reused when `output` already exists: the caller has
    checked that it was converted from the same checkpoint (trainer/run_dir.py)."""
    if output.exists():
        return output
    env = torchrun_free_env()
    cmd = [sys.executable, "-m", "megatron_fp8rl.cli", "convert", "hf-to-megatron",
           str(hf_path), str(output), "--no-progress"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"converting {hf_path} to Megatron failed:\n{result.stderr[-4000:]}")
    return output


def _load_weights_only(model: torch.nn.Module, directory: Path) -> None:
    """Load the weights of a converted HF checkpoint; FP8 scaling state (`_extra_state`), which
    such a checkpoint does not have, starts fresh. Any other missing tensor is an error."""
    verify_torch_dist(directory)
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = model.load_state_dict(dist_checkpointing.load(sharded, str(directory)),
                                                strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{directory}: missing tensors {missing}, unexpected {unexpected}")


class MegatronActor:
    """The trained policy: a GPTModel chunk in Megatron DDP with its distributed optimizer, in
    `model_cfg.dtype` (bfloat16: Megatron mixed precision, trainer.megatron_step.wrap_ddp)."""

    def __init__(self, init_dir: Path, model_cfg: ModelConfig, optim: OptimConfig, fp8_gemm: str = "auto"):
        """`fp8_gemm`: our FP8 linears' GEMM (fp8.linear.GEMMS); RunConfig.trainer_fp8_gemm."""
        self.hf_config = json.loads((Path(model_cfg.hf_path) / "config.json").read_text())
        check_parallel_layout(self.hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                              parallel_state.get_pipeline_model_parallel_world_size())
        model = build_model_from_hf(self.hf_config, params_dtype=getattr(torch, model_cfg.dtype),
                                    fp8_recipe=model_cfg.recipe(), fp8_backend=model_cfg.fp8_backend, fp8_gemm=fp8_gemm)
        _load_weights_only(model, init_dir)
        self.model = wrap_ddp(model, distributed_optimizer=True)
        self.optimizer = build_optimizer(self.model, optim)
        self.rollout_scales: dict | None = None
        """Aligned FP8 rollouts: the scales the engine serves now (set by each weight sync)."""

    @staticmethod
    def _forward(chunk: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return chunk(batch["tokens"], batch["position_ids"], None)

    @staticmethod
    def token_logprobs(batch: dict[str, torch.Tensor], logits: torch.Tensor):
        """(logprobs, entropy) [B, S] of each position's target token, over the TP-split vocab."""
        group = parallel_state.get_tensor_model_parallel_group()
        return vocab_parallel_logprobs_and_entropy(logits, batch["target_ids"], group)

    @staticmethod
    def _forward_as_served(chunk: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logprob forward: attention call for call as SGLang's torch_native backend served
        each sequence (prompt prefill, then one row at a time), so that with the exact FP8 GEMM
        the recompute has the rollout's bits (compat/megatron_attention.py; TE attention, the
        GPU tier, ignores the layout)."""
        with sglang_call_layout(prompt_lengths(batch["response_mask"])):
            return chunk(batch["tokens"], batch["position_ids"], None)

    def logprobs(self, micro_batches: list[dict[str, torch.Tensor]], as_served: bool = True) -> list[torch.Tensor]:
        """Per micro-batch [B, S] logprobs on the last pipeline stage ([] on others), computed
        as the rollout engine computed them (`_forward_as_served`; as_served=False: one batched
        attention call, as the training forward)."""

        def collect(batch, logits):
            logprobs, _ = self.token_logprobs(batch, logits)
            return torch.zeros((), device=logits.device), {"logprobs": logprobs}

        seq = micro_batches[0]["tokens"].shape[1]
        forward = self._forward_as_served if as_served else self._forward
        out = forward_only(self.model, micro_batches, forward, collect, seq, micro_batches[0]["tokens"].shape[0])
        return [o["logprobs"] for o in out]

    def shadow_logprobs(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """`logprobs` of the high-precision shadow: the same weights with every FP8 linear computed
        in the trainer's dtype, no FP8 scaling state touched (Calibrated Clipping)."""
        with high_precision_fp8_linears(self.model):
            return self.logprobs(micro_batches, as_served=False)

    def train(self, micro_batches: list[dict[str, torch.Tensor]],
              loss_fn: Callable[[dict, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]],
              as_served: bool = False, served_scales: dict | None = None) -> StepResult:
        """One optimizer step; `loss_fn(batch, logprobs, entropy)` returns (loss, metrics).

        `as_served` (aligned FP8 rollouts, on an update's first mini-batch, where θ = θ_old): the
        forward computes exactly what the rollout engine and the recompute computed, so the PPO
        ratio is exactly 1 there: SGLang's attention calls (`_forward_as_served`, whose gradient
        is the batched call's), the batch-invariant GEMM the actor was built with and, for a
        shared-scale recipe, `served_scales`, the FP8 scales the engine served (the live
        quantizers still observe every tensor and advance, `frozen_fp8(observe=True)`). The
        backward is the usual one. Otherwise: the live scales and one batched attention call."""

        def loss(batch, logits):
            logprobs, entropy = self.token_logprobs(batch, logits)
            return loss_fn(batch, logprobs, entropy)

        seq, size = micro_batches[0]["tokens"].shape
        if not as_served:
            return train_step(self.model, self.optimizer, micro_batches, self._forward, loss, seq, size)
        frozen = nullcontext() if served_scales is None else self.frozen_fp8(served_scales, observe=True)
        with frozen:
            return train_step(self.model, self.optimizer, micro_batches, self._forward_as_served, loss, seq, size)

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
        """`hf_tensors` of the current weights straight from the model, without a checkpoint
        written and read back: the same ShardedTensors `save_weights` would write, assembled per
        (key, layer) as the checkpoint reader would (same table, same checks). Only where this
        rank holds every weight (TP = PP = 1); ValueError otherwise."""
        if (parallel_state.get_tensor_model_parallel_world_size() != 1
                or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise ValueError("hf_tensors_in_memory needs TP = PP = 1 (this rank must hold every "
                             "weight); use save_weights + hf_tensors")
        sharded = self.model.module.sharded_state_dict()
        apply_factories(sharded)
        slices, metadata = {}, {}
        for tensor in nested_values(sharded):
            if not isinstance(tensor, ShardedTensor) or tensor.key.endswith("_extra_state"):
                continue
            layered = tensor.prepend_axis_num == 1
            layer = tensor.global_offset[0] if layered else None
            shape = tuple(tensor.global_shape[1:] if layered else tensor.global_shape)
            target = slices.setdefault((tensor.key, layer), torch.empty(shape, dtype=tensor.dtype))
            region = tuple(slice(o, o + n) for o, n in zip(tensor.global_offset[int(layered):], tensor.local_shape))
            target[region] = tensor.data.detach()
            metadata[tensor.key] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype),
                                                         torch.Size(tensor.global_shape), [])
        for unit in plan_megatron_to_hf(self.hf_config, metadata):
            yield from split_unit(unit, slices[(unit.rule.megatron, unit.layer)]).items()

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
