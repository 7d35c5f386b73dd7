"""Rollout FP8 on the trainer side: the FP8 checkpoint the rollout engine starts from, the tensors
each weight sync sends, and the scales the aligned old-logprob recompute freezes.

Owns (rollout.fp8 modes, fp8/serving.py RolloutFp8; each pair's plan: fp8/serving.py Fp8ServingPlan):
- blockwise / per_tensor: the trainer's high-precision weights quantized as the exporter does
  (convert/fp8_export.py: 128x128 blocks, or one scale per HF tensor; per_tensor static keeps the
  input scales calibrated at start, since a high-precision trainer has no activation bounds).
- aligned with a row-group recipe (RecipePromises.row_group: groupwise): the trainer quantizes
  every weight row and every token in 1x128 groups from their own values, so the served checkpoint
  is the exporter's block layout with 1x128 weight groups (fused shards quantize as their parts)
  and SGLang's fp8rl method quantizes activations as the trainer does: nothing to share or freeze.
- aligned with a shared-scale recipe (RecipePromises.shares_scales): the trainer's own per-tensor
  FP8 quantization. Each Megatron FP8 linear has one weight and one input scale (shared by its
  fused q/k/v or gate/up shards and, through the amax reduction, by its TP shards); the served
  checkpoint holds exactly those as `weight_scale` / `input_scale` of every HF shard, and the
  trainer recomputes old logprobs with the same multipliers frozen
  (`models.megatron_fp8_linear.frozen_fp8_scales`). At start, the actor's one calibration
  forward gives its live quantizers their first input bounds, so the recipe's own rule picks them.
The engine's start checkpoint is written from the actor's own stream, the one every sync sends
(`write_rollout_checkpoint`; trainer/rollout_start.py), after that calibration forward where input scales
are static (`Fp8ServingPlan.needs_calibration`). `prepare_rollout_checkpoint` is the same
checkpoint exported from an HF folder, for an engine without a trainer (tests, bench/rollout.py).
Scales are keyed by (global layer number, Megatron linear path: the model family's
`DecoderLinear.megatron`, models/families/<family>.py), values are fp32 dequant
multipliers (weight_scale_inv, input_scale_inv).
Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_fp8rl.convert.fp8_calibration import calibrate_input_bounds
from megatron_fp8rl.convert.fp8_export import (
    Fp8ExportOptions,
    export_fp8,
    export_tensor,
    quantization_config,
    quantized_module,
)
from megatron_fp8rl.convert.outputs import atomic_output, copy_hf_side_files
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.quantize import finite_amax, quantize_with_scale_inv
from megatron_fp8rl.fp8.recipe import Fp8Recipe, recipe_by_name
from megatron_fp8rl.fp8.serving import Fp8ServingPlan, require_plan
from megatron_fp8rl.models.family import ModelFamily
from megatron_fp8rl.models.registry import family_for, weight_linear
from megatron_fp8rl.rollout.weights import unshared

ROLLOUT_CHECKPOINT = "rollout_fp8"
"""Folder (under the run directory) of the FP8 checkpoint the rollout engine starts from."""
Scales = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def export_options(plan: Fp8ServingPlan, activation_scheme: str, bounds=None) -> Fp8ExportOptions:
    """The exporter's options for the checkpoint `plan` serves (`Fp8ServingPlan.layout`: aligned
    takes the trainer recipe's 1 x G weight groups for a row-group recipe, else per-tensor static)."""
    scheme, activations = plan.layout(activation_scheme)
    if scheme == "block":
        return Fp8ExportOptions(scheme="block", **({"weight_block": (1, plan.row_group)} if plan.row_group else {}))
    return Fp8ExportOptions(scheme="tensor", activation_scheme=activations, bounds=bounds or {})


def _family(checkpoint: Path) -> ModelFamily:
    return family_for(json.loads((Path(checkpoint) / "config.json").read_text()))


def _megatron_linear(family: ModelFamily, module: str) -> tuple[int, str]:
    """'model.layers.3.self_attn.k_proj' -> (3, 'self_attention.linear_qkv'), the key of Scales."""
    layer, linear = family.decoder_linear(module)
    return layer, linear.megatron


def prepare_rollout_checkpoint(hf_path: Path, output: Path, plan: Fp8ServingPlan, activation_scheme: str,
                               calibration_prompts: list[str], recipe: Fp8Recipe | None = None) -> Path:
    """The checkpoint the rollout engine starts from under `plan`: `hf_path` itself for
    rollout.fp8=none, else an FP8 export of it at `output` (static input bounds calibrated on the
    prompts; aligned: with the margin of `recipe`, the trainer's, by default the defaults of the
    plan's trainer recipe)."""
    require_plan(plan, "prepare_rollout_checkpoint")
    if not plan.fp8:
        return Path(hf_path)
    options = export_options(plan, activation_scheme)
    bounds = None
    if options.activation_scheme == "static":
        bounds = calibrate_input_bounds(Path(hf_path), calibration_prompts)
        if plan.aligned:
            bounds = _recipe_bounds(Path(hf_path), bounds, (recipe or recipe_by_name(plan.trainer_fp8)).margin)
        options = export_options(plan, activation_scheme, bounds)
    export_fp8(Path(hf_path), Path(output), options, overwrite=True, progress=False)
    return Path(output)


def _recipe_bounds(hf_path: Path, input_bounds: dict, margin: int) -> dict[str, dict[str, float]]:
    """Per HF linear: the bounds the trainer's recipe would pick for its fused Megatron linear
    (max over the fused shards, times 2**margin, so scale = fp8_max / bound as the exporter
    computes equals the recipe's (fp8_max / c) / 2**margin)."""
    family, weights = _family(hf_path), {}
    for path in sorted(Path(hf_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                if family.weight_linear(name) is not None:
                    weights[name[: -len(".weight")]] = float(finite_amax(handle.get_tensor(name)))
    groups: dict[tuple[int, str], list[str]] = {}
    for module in weights:
        groups.setdefault(_megatron_linear(family, module), []).append(module)
    bounds = {}
    for members in groups.values():
        missing = [m for m in members if m not in input_bounds]
        if missing:
            raise CheckpointError(f"no calibrated input bound for {missing}")
        weight = max(weights[m] for m in members) * 2.0**margin
        inputs = max(input_bounds[m]["input"] for m in members) * 2.0**margin
        bounds.update({m: {"weight": weight, "input": inputs} for m in members})
    return bounds


def served_scales(fp8_dir: Path) -> Scales:
    """The (weight_scale_inv, input_scale_inv) the served aligned checkpoint holds per Megatron
    linear; CheckpointError when the shards of one fused linear disagree (not an aligned export)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(Path(fp8_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                for kind in ("weight_scale", "input_scale"):
                    if name.endswith("." + kind):
                        found.setdefault(name[: -len(kind) - 1], {})[kind] = handle.get_tensor(name).float()
    scales: Scales = {}
    family = _family(fp8_dir)
    for module, entry in sorted(found.items()):
        key = _megatron_linear(family, module)
        pair = (entry["weight_scale"].reshape(()), entry["input_scale"].reshape(()))
        if key in scales and not all(torch.equal(a, b) for a, b in zip(scales[key], pair)):
            raise CheckpointError(f"{fp8_dir}: the fused shards of layer {key[0]} {key[1]} have different "
                                  f"scales ({module}): not an aligned FP8 checkpoint")
        scales[key] = pair
    if not scales:
        raise CheckpointError(f"{fp8_dir}: no weight_scale/input_scale tensors (not a per-tensor static FP8 checkpoint)")
    return scales


def rollout_tensors(named: Iterable[tuple[str, torch.Tensor]], num_layers: int, plan: Fp8ServingPlan,
                    scales: Scales | None = None,
                    input_bounds: dict[str, dict[str, float]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors a weight sync sends under `plan`: high-precision as is (rollout.fp8=none),
    quantized like the exporter (blockwise, per_tensor: weight and weight scale, plus the
    static input scale of `input_bounds` when given, as the start checkpoint of a static
    per_tensor engine needs, which later syncs keep; aligned with a row-group trainer recipe:
    weight and its 1x128 group scales), or quantized with the trainer's `scales` (aligned with a
    shared-scale recipe: weight, weight_scale and input_scale of every HF linear). Which tensors
    are decoder linears comes from the model families' tables (models.registry.weight_linear): a
    name no family knows raises UnsupportedModelError before anything is sent."""
    require_plan(plan, "rollout_tensors")  # before the generator's first item: at the call
    return _rollout_tensors(named, num_layers, plan, scales, input_bounds)


def _rollout_tensors(named, num_layers, plan, scales, input_bounds):
    """rollout_tensors' stream (a generator: it runs as it is iterated)."""
    if not plan.fp8:
        yield from named
        return
    options = export_options(plan, "static" if input_bounds else "dynamic", input_bounds)
    if plan.shares_scales and scales is None:
        raise ValueError(f"aligned rollouts of trainer recipe {plan.trainer_fp8!r} send the trainer's scales: none given")
    for name, tensor in named:
        module = quantized_module(name, num_layers, options, weight_linear)
        if module is None or scales is None:
            yield from export_tensor(name, tensor, num_layers, options, weight_linear).items()
            continue
        layer, linear = weight_linear(name)
        weight_inv, input_inv = scales[(layer, linear.megatron)]
        quantized = quantize_with_scale_inv(tensor, weight_inv, E4M3)
        yield name, quantized.data
        yield f"{module}.weight_scale", weight_inv.reshape(())
        yield f"{module}.input_scale", input_inv.reshape(())


def write_rollout_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], hf_path: Path, output: Path,
                             plan: Fp8ServingPlan, activation_scheme: str, shard_bytes: int = 1 << 30) -> Path:
    """Global rank 0: the checkpoint the rollout engine starts from, written from the actor's own
    stream (`WeightPublisher.publish`, the tensors every sync sends) at `output`:
    safetensors shards of about `shard_bytes` with an index, the HF side files of `hf_path`, and
    config.json with the `quantization_config` of `plan` (RunConfig.fp8_plan). Written to a
    temporary folder and renamed at the end (convert.outputs.atomic_output); one shard in memory."""
    options = export_options(require_plan(plan, "write_rollout_checkpoint"), activation_scheme)
    hf = json.loads((Path(hf_path) / "config.json").read_text())
    with atomic_output(Path(output), overwrite=True) as tmp:
        weight_map, shard, size, total = {}, [], 0, 0

        def flush():
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(unshared(shard), str(tmp / name))
            weight_map.update({tensor_name: name for tensor_name, _ in shard})
            shard.clear()

        for name, tensor in tensors:
            shard.append((name, tensor))
            nbytes = tensor.numel() * tensor.element_size()
            size, total = size + nbytes, total + nbytes
            if size >= shard_bytes:
                flush()
                size = 0
        if shard:
            flush()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        copy_hf_side_files(Path(hf_path), tmp)
        (tmp / "config.json").write_text(json.dumps(dict(hf, quantization_config=quantization_config(hf, options)),
                                                    indent=2))
    return Path(output)
