"""The reference policy of algorithm.kl: a frozen copy of the run's initial checkpoint (or of
algorithm.kl.reference_path) at the actor's TP/PP layout, forward only, without optimizer state,
whose log-probs the KL penalty compares the policy with (rl/kl.py).

Owns: `ReferencePolicy` (building, loading, the forward pass in the recompute's pass structure,
host offload), `build_reference` (which checkpoint, checked against the actor's architecture and
vocabulary), and `reward_kl_penalty` (algorithm.kl.in_reward).
Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import Float16Module

from megatron_fp8rl.models.hf import build_model_from_hf
from megatron_fp8rl.rl.kl import VERL_NAMES as KL_ESTIMATORS
from megatron_fp8rl.rl.kl import kl_estimate, kl_metrics, sequence_kl_penalty
from megatron_fp8rl.trainer.actor import MegatronActor, batch_logprobs, convert_initial_checkpoint, load_weights_only
from megatron_fp8rl.trainer.batch import RolloutBatch
from megatron_fp8rl.trainer.algorithm_config import KLConfig
from megatron_fp8rl.trainer.config import ModelConfig

ARCHITECTURE_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                       "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "tie_word_embeddings")
"""config.json fields a reference checkpoint must share with the actor's: the same network shape
and vocabulary, so that its log-probs score the same tokens at the same layout."""
REFERENCE_CHECKPOINT = "reference_megatron"
"""The run directory's torch_dist conversion of algorithm.kl.reference_path (made once, reused on
resume as init_megatron is)."""


class ReferenceMismatchError(ValueError):
    """A reference checkpoint whose architecture or vocabulary is not the actor's."""


def check_reference_config(reference: dict, actor: dict, where: str) -> None:
    """Refuse a reference config.json (read from `where`) that differs from the actor's in an
    ARCHITECTURE_FIELDS field, naming the first such field and both values."""
    for name in ARCHITECTURE_FIELDS:
        if reference.get(name) != actor.get(name):
            raise ReferenceMismatchError(
                f"algorithm.kl.reference_path={where}: config.json field {name} is {reference.get(name)!r}, "
                f"the actor's (model.hf_path) is {actor.get(name)!r}; the reference must share the actor's "
                "architecture and vocabulary")


def reference_arithmetic(precision: str, model_cfg: ModelConfig) -> tuple[torch.dtype, object]:
    """(parameter dtype, FP8 recipe or None) of algorithm.kl.precision: actor (model.dtype with the
    actor's recipe), bfloat16 or float32 (no FP8)."""
    if precision == "actor":
        return getattr(torch, model_cfg.dtype), model_cfg.recipe()
    return getattr(torch, precision), None


class ReferencePolicy:
    """The frozen reference: a GPTModel chunk (Float16Module-wrapped in bf16, as the actor's DDP
    wrapper does) with no gradients and no optimizer."""

    def __init__(self, checkpoint: Path, hf_config: dict, model_cfg: ModelConfig, kl: KLConfig,
                 micro_batch_size: int, as_served: bool = False, fp8_gemm: str = "auto"):
        """`checkpoint`: torch_dist weights of `hf_config`'s architecture; `micro_batch_size` and
        `as_served`: the old-logprob recompute's (train.micro_batch_size; aligned FP8 rollouts);
        `fp8_gemm`: the actor's FP8 GEMM. ValueError naming algorithm.kl.offload without CUDA."""
        if kl.offload and not torch.cuda.is_available():
            raise ValueError("algorithm.kl.offload: moves the reference's weights between GPU and host "
                             "memory; this process has no CUDA device (the CPU tier keeps them where they are)")
        dtype, recipe = reference_arithmetic(kl.precision, model_cfg)
        model = build_model_from_hf(hf_config, params_dtype=dtype, fp8_recipe=recipe,
                                    fp8_backend=model_cfg.fp8_backend, fp8_gemm=fp8_gemm)
        load_weights_only(model, checkpoint)
        model.requires_grad_(False)
        self.model = Float16Module(model.config, model) if model.config.bf16 else model
        self.micro_batch_size, self.as_served, self.offload = micro_batch_size, as_served, kl.offload
        if self.offload:
            self.model.cpu()

    def logprobs(self, batch: RolloutBatch, timings: dict[str, float]) -> torch.Tensor:
        """log π_ref [B, S] of every position of `batch`, by the old-logprob recompute's function
        (trainer.actor.batch_logprobs: same micro-batches, same padding), on every rank: the last
        pipeline stage computes them and broadcasts them to the earlier stages. Offload: the
        weights' round trip to the GPU goes into `timings` as time/reference_offload_s."""
        with self._resident(timings):
            logprobs = batch_logprobs(self.model, batch, self.micro_batch_size, self.as_served)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(logprobs, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return logprobs

    @contextmanager
    def _resident(self, timings: dict[str, float]):
        """The weights on the GPU for the block (offload: brought from host memory and sent back)."""
        if not self.offload:
            yield
            return
        start = time.perf_counter()
        self.model.cuda()
        moved = time.perf_counter() - start
        try:
            yield
        finally:
            start = time.perf_counter()
            self.model.cpu()
            torch.cuda.synchronize()
            timings["time/reference_offload_s"] = moved + time.perf_counter() - start


def build_reference(kl: KLConfig, run_dir: Path, actor: MegatronActor, model_cfg: ModelConfig,
                    micro_batch_size: int, fp8_gemm: str) -> ReferencePolicy:
    """All ranks (collective): the run's reference policy. algorithm.kl.reference_path is checked
    against the actor's config.json (ReferenceMismatchError naming the field) and converted once to
    <run_dir>/reference_megatron; otherwise the reference loads <run_dir>/init_megatron, the
    actor's own start, which a resumed run still has."""
    checkpoint, hf_config = run_dir / "init_megatron", actor.hf_config
    if kl.reference_path:
        config_file = Path(kl.reference_path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"algorithm.kl.reference_path={kl.reference_path}: no config.json "
                                    "(not an HF checkpoint folder)")
        hf_config = json.loads(config_file.read_text())
        check_reference_config(hf_config, actor.hf_config, kl.reference_path)
        checkpoint = convert_initial_checkpoint(Path(kl.reference_path), run_dir / REFERENCE_CHECKPOINT)
    return ReferencePolicy(checkpoint, hf_config, model_cfg, kl, micro_batch_size,
                           as_served=actor.serving.aligned, fp8_gemm=fp8_gemm)


def reward_kl_penalty(kl: KLConfig, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """algorithm.kl.in_reward: (β·Σ_t k_t [B], kl/mean and kl/max) with k the estimator of the
    rollout's log-probs against the batch's `ref_logprobs`, to subtract from each sequence's
    reward before advantages (verl's use_kl_in_reward, which scores its recomputed old log-probs;
    here the policy that sampled the tokens reports them, and no recompute has to run first)."""
    penalty = kl_estimate(batch.rollout_logprobs, batch.ref_logprobs, KL_ESTIMATORS[kl.estimator])
    metrics = {name: float(value) for name, value in kl_metrics(penalty, batch.response_mask).items()}
    return kl.coef * sequence_kl_penalty(penalty, batch.response_mask), metrics
