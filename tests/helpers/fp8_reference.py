"""An independent FP8 oracle for SGLang's FP8 rollouts: transformers' fp32 model whose quantized
linears use the FP8 checkpoint's weights dequantized here, and whose inputs are quantized and
dequantized by forward pre-hooks, all with plain torch float8 casts (none of megatron_fp8rl.fp8).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _cast(x: torch.Tensor) -> torch.Tensor:
    """Saturating E4M3 round trip of x (already divided by its scale)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()


def _static(scale: torch.Tensor):
    return lambda x: _cast(x / scale) * scale


def _per_token(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _cast(x / scale) * scale


def _per_group(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    pad = (-x.shape[-1]) % group
    padded = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, group))
    restored = _per_token(padded).flatten(-2)
    return restored[..., : x.shape[-1]]


def _block_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    full = torch.kron(scale_inv, torch.ones(block, block))[: weight.shape[0], : weight.shape[1]]
    return weight.float() * full


def apply_fp8(model: torch.nn.Module, fp8: Path | dict[str, torch.Tensor]) -> int:
    """Make `model` (the high-precision HF model) compute what the FP8 checkpoint folder (or the
    dict of FP8 tensors a weight sync sends) means; returns the number of quantized linears."""
    tensors = fp8 if isinstance(fp8, dict) else load_file(Path(fp8) / "model.safetensors")
    modules = dict(model.named_modules())
    count = 0
    for name, tensor in tensors.items():
        if tensor.dtype != FP8:
            continue
        module_name = name[: -len(".weight")]
        module = modules[module_name]
        if f"{module_name}.weight_scale_inv" in tensors:
            weight = _block_weight(tensor, tensors[f"{module_name}.weight_scale_inv"])
            quantize_input = _per_group
        else:
            weight = tensor.float() * tensors[f"{module_name}.weight_scale"]
            scale = tensors.get(f"{module_name}.input_scale")
            quantize_input = _per_token if scale is None else _static(scale)
        with torch.no_grad():
            module.weight.copy_(weight)
        module.register_forward_pre_hook(lambda m, args, q=quantize_input: (q(args[0]),) + args[1:])
        count += 1
    return count
