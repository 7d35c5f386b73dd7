"""The high-precision shadow of a trainer model (Calibrated Clipping and its diagnostic).

Owns: `high_precision_shadow(model)`, a context in which the model's forward is its
high-precision twin's, without touching weights, optimizer state or FP8 scaling state:
- a model with our FP8 linears: every FP8 linear computes in the weights' own dtype
  (megatron_fp8_linear.high_precision_fp8_linears; no quantizer runs);
- a Megatron bf16/fp16 mixed-precision model without FP8 linears (Float16Module, DDP): its
  low-precision parameters are seen as float32 copies for the duration (the same values, upcast),
  so the forward is the float32 model with those weights: the reference a bf16 arm's ratio is
  compared with. The parameters themselves stay untouched (their gradient accumulators, which
  Megatron DDP hooks, included).
A float32 model without FP8 linears has no higher precision to compare with: ValueError.
Must not import: anything above layer L2 (convert, rollout, data, trainer, cli).

The upcast works on the trainer's layer spec (SdpaAttention computes in its inputs' dtype).
Megatron's DotProductAttention does not: its softmax casts probabilities back to the config's
bf16 (FusedScaleMaskSoftmax), so a model with one is refused by name rather than
run in a dtype mix.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_fp8rl.models.megatron_attention import SdpaAttention
from megatron_fp8rl.models.megatron_fp8_linear import has_fp8_linears, high_precision_fp8_linears

LOW_PRECISION = (torch.bfloat16, torch.float16)


@contextmanager
def high_precision_shadow(model: torch.nn.Module):
    """Within the block `model`'s forward is its high-precision twin's (module docstring); on exit
    every parameter holds its own tensor again (same storage, dtype and bits)."""
    if has_fp8_linears(model):
        with high_precision_fp8_linears(model):
            yield
        return
    # Each module's low-precision parameter is replaced, for the block, by a float32 copy that
    # needs no gradient; the Parameter objects themselves are never touched. (Setting `param.data`
    # to a float32 tensor and back, as this did before, resets the parameter's gradient
    # accumulator: Megatron DDP's hooks sit on the old one, so later backwards never reached the
    # grad buffers and a bf16 trainer with a shadow did not train at all.)
    swapped = [(module, name, param) for module in model.modules()
               for name, param in module.named_parameters(recurse=False) if param.dtype in LOW_PRECISION]
    if not swapped:
        raise ValueError("high_precision_shadow: the model has neither FP8 linears nor bf16/fp16 weights: "
                         "no higher precision to compare its forward with")
    casting = [name for name, m in model.named_modules()
               if isinstance(m, DotProductAttention) and not isinstance(m, SdpaAttention)]
    if casting:
        raise ValueError(f"high_precision_shadow: {casting[0]} is Megatron's DotProductAttention, whose softmax "
                         "casts attention probabilities to the config's low precision; the upcast shadow needs "
                         "the trainer's SdpaAttention (models/megatron_attention.py)")
    try:
        for module, name, param in swapped:
            module._parameters[name] = torch.nn.Parameter(param.detach().float(), requires_grad=False)
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
