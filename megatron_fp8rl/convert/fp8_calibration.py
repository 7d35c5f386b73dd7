"""Static FP8 activation bounds for the export, calibrated on a prompt set with transformers.

Owns: `calibrate_input_bounds` (max |input| of every decoder linear over the prompts, fp32) and
`load_bounds` (a JSON file of per-module bounds, e.g. written from the calibrated recipe:
{module: {"weight": c, "input": c}}). The export turns an input bound c into
`input_scale = c / 448`.
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.registry import family_for


def calibrate_input_bounds(hf_dir: Path, prompts: list[str], max_length: int = 512) -> dict[str, dict[str, float]]:
    """{module: {'input': max |x|}} for every decoder linear of the model's family (a linear its
    table lacks raises UnsupportedModelError naming it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not prompts:
        raise CheckpointError("calibration needs at least one prompt")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    family = family_for(model.config.to_dict())
    bounds: dict[str, dict[str, float]] = {}

    def hook(name):
        def record(module, inputs):
            amax = float(inputs[0].detach().abs().max())
            bounds[name] = {"input": max(amax, bounds.get(name, {}).get("input", 0.0))}
        return record
    handles = [module.register_forward_pre_hook(hook(name))
               for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and family.weight_linear(f"{name}.weight") is not None]
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt", truncation=True, max_length=max_length)
                model(ids["input_ids"])
    finally:
        for handle in handles:
            handle.remove()
    return bounds


def load_bounds(path: Path) -> dict[str, dict[str, float]]:
    """Per-module bounds from a JSON file {module: {"weight"?: c, "input"?: c}}."""
    try:
        bounds = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read FP8 bounds from {path}: {exc}") from None
    for module, entry in bounds.items():
        bad = [k for k, v in entry.items() if k not in ("weight", "input") or not float(v) > 0]
        if bad:
            raise CheckpointError(f"{path}: module {module}: bad bound entries {bad} (need "
                                  "'weight'/'input' > 0)")
    return bounds
