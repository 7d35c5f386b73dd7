"""FP8 export for SGLang: an HF (BF16/FP32) or Megatron checkpoint -> an FP8 HF checkpoint.

Owns: choosing which weights to quantize (the decoder linears of models/families/<family>.py,
except optionally the first/last N layers; `modules_to_not_convert` lists the rest; a tensor the
family's table lacks is refused by name), quantizing them with megatron_fp8rl.fp8 (E4M3),
optional static activation scales from a prompt-set calibration or from the calibrated recipe's
bounds, and writing safetensors plus a config.json whose `quantization_config` SGLang's `fp8`
method parses:
- block:  weight E4M3 [N, K] + `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)] (dequant
          multipliers; `weight_block` bn x bk, 128x128 by default, 1x128 for aligned rollouts of
          the groupwise recipe), activations quantized dynamically per token group;
          {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [bn, bk]}.
- tensor: weight E4M3 + `weight_scale` fp32 [] (dequant multiplier) and, when static,
          `input_scale` fp32 [] = bound / 448; {quant_method: fp8, fmt: e4m3, activation_scheme}.
Tensors stream one at a time (HF source) or one Megatron layer slice at a time.
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from megatron_fp8rl.convert.hf_to_megatron import HF_SIDE_FOLDER
from megatron_fp8rl.convert.integrity import verify_manifest
from megatron_fp8rl.convert.megatron_to_hf import (
    hf_dtype,
    plan_megatron_to_hf,
    read_tensor_metadata,
    read_unit,
    split_unit,
)
from megatron_fp8rl.convert.outputs import atomic_output, check_output, copy_hf_side_files
from megatron_fp8rl.convert.safetensors_io import CheckpointError, HFCheckpoint, SafetensorsWriter
from megatron_fp8rl.fp8.formats import get_format
from megatron_fp8rl.fp8.quantize import (
    WEIGHT_BLOCK,
    Fp8Tensor,
    finite_amax,
    quantize_blockwise,
    quantize_with_scale_inv,
    scale_from_bound,
)
from megatron_fp8rl.models.family import HF_LAYER, LAYER_PREFIX, DecoderLinear
from megatron_fp8rl.models.registry import family_for

E4M3 = get_format("e4m3")
SCHEMES = ("block", "tensor")
WeightLinear = Callable[[str], "tuple[int, DecoderLinear] | None"]
"""HF tensor name -> (layer, decoder linear) of the weights that get quantized, None for other
tensors, raising for names the family's table lacks (`ModelFamily.weight_linear`, or
models.registry.weight_linear where no config is at hand)."""


@dataclass(frozen=True)
class Fp8ExportOptions:
    """How to quantize."""

    scheme: str = "block"
    """'block' (weight scales per `weight_block`, dynamic activations) or 'tensor' (one scale per weight)."""
    weight_block: tuple[int, int] = WEIGHT_BLOCK
    """scheme 'block': rows x columns of weight per scale."""
    activation_scheme: str = "dynamic"
    """'dynamic' or, for scheme 'tensor' only, 'static' (needs input bounds)."""
    keep_first_layers: int = 0
    """Leave the first N decoder layers in high precision."""
    keep_last_layers: int = 0
    """Leave the last N decoder layers in high precision."""
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Module name -> {'weight': bound, 'input': bound} (values mapped to 448), e.g. from the
    calibrated recipe; a missing weight bound means the weight's amax."""

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown FP8 export scheme {self.scheme!r}; valid: {', '.join(SCHEMES)}")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"activation_scheme must be dynamic or static, not {self.activation_scheme!r}")
        if self.activation_scheme == "static" and self.scheme != "tensor":
            raise ValueError("static activation scales need scheme 'tensor' (block scales are dynamic)")
        if len(self.weight_block) != 2 or min(self.weight_block) < 1:
            raise ValueError(f"weight_block must be two positive integers, found {self.weight_block!r}")


def quantized_module(name: str, num_layers: int, options: Fp8ExportOptions,
                     weight_linear: WeightLinear) -> str | None:
    """The module name of an HF tensor that gets quantized (a decoder linear's weight), or None to
    keep it as is."""
    found = weight_linear(name)
    if found is None:
        return None
    layer = found[0]
    if layer < options.keep_first_layers or layer >= num_layers - options.keep_last_layers:
        return None
    return name[: -len(".weight")]


def quantize_weight(module: str, weight: torch.Tensor, options: Fp8ExportOptions) -> Fp8Tensor:
    """The FP8 weight of `module` (the quantizer of the chosen scheme, megatron_fp8rl.fp8)."""
    if options.scheme == "block":
        return quantize_blockwise(weight, E4M3, tuple(options.weight_block))
    bound = options.bounds.get(module, {}).get("weight")
    bound = finite_amax(weight) if bound is None else torch.tensor(float(bound))
    # Quantized through the stored multiplier, as the rollout engine and the trainer's frozen-scale
    # recompute read it back (1 / (1 / s) need not be s in fp32).
    return quantize_with_scale_inv(weight, scale_from_bound(bound, E4M3.max).reciprocal(), E4M3)


def input_scale(module: str, options: Fp8ExportOptions) -> torch.Tensor:
    """Static activation dequant multiplier bound / 448 (TE's scale formula, inverted)."""
    bound = options.bounds.get(module, {}).get("input")
    if bound is None:
        raise CheckpointError(f"static activation scheme: no input bound for {module} "
                              "(calibrate on prompts or pass recipe bounds)")
    return scale_from_bound(torch.tensor(float(bound)), E4M3.max).reciprocal()


def _scale_name(module: str, options: Fp8ExportOptions) -> str:
    return f"{module}.weight_scale_inv" if options.scheme == "block" else f"{module}.weight_scale"


def output_entries(name, shape, dtype, num_layers, options, weight_linear) -> list[tuple[str, torch.dtype, tuple]]:
    """The tensors one source tensor becomes in the FP8 checkpoint."""
    module = quantized_module(name, num_layers, options, weight_linear)
    if module is None:
        return [(name, dtype, tuple(shape))]
    if options.scheme == "block":
        scale_shape = tuple(-(-d // b) for d, b in zip(shape, options.weight_block))
    else:
        scale_shape = ()
    entries = [(name, E4M3.dtype, tuple(shape)), (_scale_name(module, options), torch.float32, scale_shape)]
    if options.activation_scheme == "static":
        entries.append((f"{module}.input_scale", torch.float32, ()))
    return entries


def export_tensor(name, tensor, num_layers, options, weight_linear) -> dict[str, torch.Tensor]:
    """Quantize (or pass through) one source tensor."""
    module = quantized_module(name, num_layers, options, weight_linear)
    if module is None:
        return {name: tensor}
    quantized = quantize_weight(module, tensor, options)
    out = {name: quantized.data, _scale_name(module, options): quantized.scale_inv.float().reshape(
        () if options.scheme == "tensor" else quantized.scale_inv.shape)}
    if options.activation_scheme == "static":
        out[f"{module}.input_scale"] = input_scale(module, options)
    return out


def quantization_config(hf: dict, options: Fp8ExportOptions) -> dict:
    """The `quantization_config` of config.json (SGLang's and transformers' `fp8` method); the
    modules left in high precision are the family's tensors outside the decoder layers (embeddings,
    final norm, lm_head) and the linears of the kept layers."""
    num_layers = int(hf["num_hidden_layers"])
    kept = [i for i in range(num_layers)
            if i < options.keep_first_layers or i >= num_layers - options.keep_last_layers]
    family = family_for(hf)
    outside = sorted({name.removesuffix(".weight") for rule in family.tensors
                      if not rule.megatron.startswith(LAYER_PREFIX) for name in rule.hf})
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": options.activation_scheme,
              "modules_to_not_convert": outside + [HF_LAYER.format(layer=i) + module for i in kept
                                                   for linear in family.linears for module in linear.hf]}
    if options.scheme == "block":
        config["weight_block_size"] = list(options.weight_block)
    return config


def _check_input_bounds(names: list[str], options: Fp8ExportOptions) -> None:
    """Before writing: every static input scale needs an input bound."""
    missing = sorted(n[: -len(".input_scale")] for n in names if n.endswith(".input_scale")
                     and "input" not in options.bounds.get(n[: -len(".input_scale")], {}))
    if missing:
        raise CheckpointError(f"static activation scheme: no input bound for {', '.join(missing[:8])}"
                              f"{' ...' if len(missing) > 8 else ''} (calibrate on prompts or pass "
                              "recipe bounds)")


TensorGroup = tuple[list[tuple[str, tuple, torch.dtype]], Callable[[], dict[str, torch.Tensor]]]
"""(source tensors (name, shape, dtype), loader returning them)."""


def hf_source(hf_dir: Path) -> list[TensorGroup]:
    """Every tensor of an HF folder, one group each (read only when its group is written)."""
    checkpoint = HFCheckpoint(hf_dir)

    def loader(entry):
        def load():
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            checkpoint.read_rows(entry.name, 0, entry.shape[0] if entry.shape else 1,
                                 tensor if tensor.dim() else tensor.view(1))
            return {entry.name: tensor}
        return load
    return [([(e.name, e.shape, e.dtype)], loader(e)) for e in checkpoint.entries.values()]


def megatron_source(megatron_dir: Path, hf: dict, dtype: torch.dtype | None,
                    key_prefix: str = "") -> list[TensorGroup]:
    """The HF tensors of a torch_dist checkpoint, one Megatron layer slice per group."""
    verify_manifest(megatron_dir)
    units = plan_megatron_to_hf(hf, read_tensor_metadata(megatron_dir, key_prefix))

    def loader(unit):
        return lambda: {k: v.to(dtype or unit.dtype) for k, v in
                        split_unit(unit, read_unit(megatron_dir, unit, key_prefix)).items()}
    return [([(n, s, dtype or u.dtype) for n, s in u.hf], loader(u)) for u in units]


def write_fp8_checkpoint(groups: Iterable[TensorGroup], hf: dict, output: Path,
                         options: Fp8ExportOptions, progress: bool = True) -> dict[str, str]:
    """Quantize and write every group into one model.safetensors; returns name -> file."""
    groups = list(groups)
    num_layers, weight_linear = int(hf["num_hidden_layers"]), family_for(hf).weight_linear
    entries = [e for source, _ in groups for n, s, d in source
               for e in output_entries(n, s, d, num_layers, options, weight_linear)]
    _check_input_bounds([n for n, _, _ in entries], options)
    writer = SafetensorsWriter(output / "model.safetensors", entries)
    for source, load in tqdm(groups, desc="export-fp8", disable=not progress):
        for name, tensor in load().items():
            for out_name, out_tensor in export_tensor(name, tensor, num_layers, options, weight_linear).items():
                writer.write(out_name, out_tensor)
    writer.close()
    return {name: "model.safetensors" for name, _, _ in entries}


def export_fp8(source_dir: Path, output_dir: Path, options: Fp8ExportOptions,
               source: str = "hf", hf_config_dir: Path | None = None, overwrite: bool = False,
               key_prefix: str = "", progress: bool = True) -> dict[str, str]:
    """Export an HF folder (`source='hf'`) or a torch_dist checkpoint (`source='megatron'`)."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    side = Path(hf_config_dir) if hf_config_dir else (
        source_dir if source == "hf" else source_dir / HF_SIDE_FOLDER)
    check_output(output_dir, overwrite, inputs=(source_dir, side))
    if not (side / "config.json").is_file():
        raise CheckpointError(f"no HF config.json in {side}; pass the HF config folder")
    hf = json.loads((side / "config.json").read_text())
    family_for(hf)  # a family without a table (Mixtral, GPT-2, ...) is refused by name
    if source == "hf":
        groups = hf_source(source_dir)
    elif source == "megatron":
        groups = megatron_source(source_dir, hf, hf_dtype(hf), key_prefix)
    else:
        raise ValueError(f"source must be 'hf' or 'megatron', not {source!r}")
    with atomic_output(output_dir, overwrite) as tmp:
        weight_map = write_fp8_checkpoint(groups, hf, tmp, options, progress)
        copy_hf_side_files(side, tmp)
        hf_out = dict(hf, quantization_config=quantization_config(hf, options))
        (tmp / "config.json").write_text(json.dumps(hf_out, indent=2))
    return weight_map

