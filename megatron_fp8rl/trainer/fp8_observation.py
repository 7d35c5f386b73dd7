"""What the actor's FP8 linears observe: the calibration forward before training (input bounds for
static input scales, and the first bounds of the live quantizers) and the per-layer FP8 statistics
logged every step.

Owns: `calibration_forward`, `fp8_metrics`. Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fp8rl.models.family import HF_LAYER
from megatron_fp8rl.models.megatron_fp8_linear import decoder_layers, fp8_layer_stats
from megatron_fp8rl.models.registry import family_for
from megatron_fp8rl.rollout.engine import RolloutSample
from megatron_fp8rl.trainer.batch import build_batch

if TYPE_CHECKING:
    from megatron_fp8rl.trainer.actor import MegatronActor


def calibration_forward(actor: MegatronActor, prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    """All ranks (collective): no-grad forwards of `actor` over `prompts` (token ids, one
    prompt a forward), before any training. Its FP8 linears' live quantizers observe them, so the recipe's own rule
    predicts the input scales the first rollout serves (`WeightPublisher.aligned_scales`); and every decoder
    linear's max |input| is recorded, maxed over all ranks (TP shards, pipeline stages): HF
    module -> {"input": bound}, each HF linear of a fused Megatron one getting its bound (the
    static input scales of rollout.fp8=per_tensor, TE's 'max' calibration)."""
    family = family_for(actor.hf_config)
    bounds: dict[tuple[int, str], float] = {}
    hooks = []

    def record(key):
        def hook(module, args):
            amax = float(args[0].detach().abs().float().max())
            bounds[key] = max(bounds.get(key, 0.0), amax)
        return hook

    for layer in decoder_layers(actor.model):
        for linear in family.linears:
            module = layer.get_submodule(linear.megatron)
            hooks.append(module.register_forward_pre_hook(record((layer.layer_number - 1, linear.megatron))))
    try:
        with torch.no_grad():  # one prompt at a time: no padding positions in the maxima
            for index, ids in enumerate(prompts):
                sample = RolloutSample(index, list(ids), [], [], "stop", 0)
                actor.logprobs([build_batch([sample], torch.zeros(1), len(ids))], as_served=False)
    finally:
        for hook in hooks:
            hook.remove()
    return _hf_bounds(family, _max_over_ranks(bounds))


def _max_over_ranks(bounds: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
    """All ranks (collective): every rank's bounds, maxed key by key."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bounds)
    merged: dict[tuple[int, str], float] = {}
    for part in everyone:
        for key, value in part.items():
            merged[key] = max(merged.get(key, 0.0), value)
    return merged


def _hf_bounds(family, merged: dict[tuple[int, str], float]) -> dict[str, dict[str, float]]:
    """(layer, Megatron linear) -> bound, as HF module -> {"input": bound} for each HF linear."""
    hf_modules = {linear.megatron: linear.hf for linear in family.linears}
    return {HF_LAYER.format(layer=layer) + module: {"input": value}
            for (layer, path), value in sorted(merged.items()) for module in hf_modules[path]}


def fp8_metrics(model: torch.nn.Module) -> dict[str, float]:
    """This rank's FP8 quantization statistics of its last forward/backward, for tensorboard:
    `fp8/<layer>.<role>/<stat>` per FP8 linear (role: input, weight, grad_output; stat: bound,
    saturated_fraction, underflow_fraction, recalibrated) and their means over layers as
    `fp8/<role>/<stat>_mean`. Empty when the trainer is not in FP8. Rank 0 holds TP shard 0 of
    the first pipeline stage's layers."""
    metrics, sums = {}, {}
    for name, stats in fp8_layer_stats(model).items():
        role = name.rsplit(".", 1)[-1]
        for stat in ("bound", "saturated_fraction", "underflow_fraction", "recalibrated"):
            metrics[f"fp8/{name}/{stat}"] = stats[stat]
            sums.setdefault(f"fp8/{role}/{stat}_mean", []).append(stats[stat])
    metrics.update({key: sum(values) / len(values) for key, values in sums.items()})
    return metrics
