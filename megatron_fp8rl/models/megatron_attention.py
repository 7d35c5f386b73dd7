"""Megatron core attention computed with torch's SDPA, optionally call-for-call like SGLang.

Owns: `SdpaAttention` (a drop-in for Megatron's local-spec DotProductAttention), the
`sglang_call_layout` context that makes it repeat SGLang's torch_native attention calls as our
plugin serves them, and `serve_output_layer_in_tiles` (the output layer's logits in that layout).
Must not import: sglang (it only mirrors SGLang's call shapes), nor anything above layer L2 (convert,
rollout, data, trainer, cli).

Why: torch's CPU SDPA is not row-consistent: a row's output changes in the last bits with the
call's shape (measured: every decode row of a [9 heads, T, 64] causal call differs by ~3e-7 from
the same row computed alone, and prefix rows change with T). With FP8 activations those ulp
differences flip FP8 codes and avalanche through 30 layers (DESIGN hazard 3), so the aligned
rollout and the calibrated trainer disagree although their FP8 weights and scales are
bit-identical. Upstream SGLang computes a prompt in one causal call at prefill, but as an extend
over whatever prefix its radix cache holds, whose keys another call computed (after an eval, its
prompts'; issue #44). Our plugin (models/served_arithmetic.py) therefore serves every row, prompt
and generated, as a one-query call against the keys up to itself, single-threaded, and this
module repeats exactly those calls (same shapes, same memory layouts, same scale and GQA flag):
the bits then depend on a row's own inputs only, whatever was cached, batched or chunked.

Outside the context it is one causal SDPA over the batch (with autograd), the training path;
inside it under autograd (the aligned training forward of the first mini-batch) the served calls
give the value and the batched call the gradient. TE's attention (GPU tier) ignores the context.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Sequence

import torch
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.nn.functional import scaled_dot_product_attention

from megatron_fp8rl.compat.versions import check_signature, expect, patch
from megatron_fp8rl.fp8.gemm import tiled_matmul
from megatron_fp8rl.models.served_arithmetic import single_threaded

_PROMPT_LENGTHS: ContextVar[Sequence[int] | None] = ContextVar("sglang_prompt_lengths", default=None)


@contextmanager
def sglang_call_layout(prompt_lengths: Sequence[int]):
    """Inside: every SdpaAttention forward over a [S, B] batch computes its rows as our plugin's
    SGLang torch_native backend serves them: each row a one-query call against the keys up to
    itself (rows past a sequence's end, the padding, are computed the same way and mean nothing;
    `prompt_lengths` [B] are checked against the batch). S calls a layer instead of one; the
    float32 CPU output layer computes its logits in 16-row tiles (`serve_output_layer_in_tiles`).
    Under autograd (a training forward) the output has these calls' value and the gradient of the
    one batched causal call, so the backward costs what it costs outside the layout."""
    token = _PROMPT_LENGTHS.set(tuple(int(p) for p in prompt_lengths))
    try:
        yield
    finally:
        _PROMPT_LENGTHS.reset(token)


class SdpaAttention(DotProductAttention):
    """DotProductAttention's interface (causal self-attention, no packing, no attention bias, no
    dropout) with torch SDPA as the kernel."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        unsupported = {"apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
                       "window_size": config.window_size is not None,
                       "softmax_type": config.softmax_type != "vanilla"}
        found = [name for name, used in unsupported.items() if used]
        if found:
            raise ValueError(f"SdpaAttention: {', '.join(found)} not supported (plain causal softmax "
                             f"attention only); use DotProductAttention or TE's attention")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
            raise ValueError("SdpaAttention: packed sequences, attention bias and explicit masks are "
                             "not supported (causal self-attention only)")
        if self.training and self.config.attention_dropout > 0:
            raise ValueError(f"SdpaAttention: attention_dropout must be 0, found {self.config.attention_dropout}")
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        prompt_lengths = _PROMPT_LENGTHS.get()
        if prompt_lengths is None:
            context = self._causal(query, key, value, gqa)
        elif torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            # training forward in the served layout: the value of SGLang's calls, the gradient of
            # the one batched causal call (the same function, so the same gradient up to rounding;
            # differentiating through ~S per-row calls would multiply the backward's cost)
            served = self._sglang_calls(query.detach(), key.detach(), value.detach(), prompt_lengths, gqa)
            context = _ValueOf.apply(self._causal(query, key, value, gqa), served)
        else:
            context = self._sglang_calls(query, key, value, prompt_lengths, gqa)
        return context.reshape(context.shape[0], context.shape[1], self.hidden_size_per_partition)

    def _causal(self, query, key, value, gqa):
        """One causal SDPA over the batch: [sq, b, np, hn] -> [sq, b, np, hn]."""
        context = scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            is_causal=True, enable_gqa=gqa, scale=self.softmax_scale)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3)

    def _sglang_calls(self, query, key, value, prompt_lengths, gqa):
        """SGLang torch_native's calls as our plugin makes them (models/served_arithmetic.py):
        every row, prompt and generated alike, a one-query call against the keys up to itself
        (decode's call; the plugin's extend makes the same one per prompt row, whatever part of the
        prompt the radix cache held). The sequences of a batch share each row's call: torch's SDPA
        computes every (batch, head) slice alone, so the batch size does not change a slice's bits."""
        if len(prompt_lengths) != query.shape[1]:
            raise ValueError(f"sglang_call_layout: {len(prompt_lengths)} prompt lengths for a batch of "
                             f"{query.shape[1]} sequences")
        bad = [p for p in prompt_lengths if not 0 < p <= query.shape[0]]
        if bad:
            raise ValueError(f"sglang_call_layout: prompt length {bad[0]} outside 1..{query.shape[0]} "
                             f"(the batch's sequence length)")
        with single_threaded():  # SGLang's side runs them with one thread too (served_arithmetic.py)
            return self._sglang_call_loop(query, key, value, gqa)

    def _sglang_call_loop(self, query, key, value, gqa):
        context = torch.empty_like(query)
        for row in range(query.shape[0]):  # contiguous copies, the layouts the calls were matched in
            q = query[row:row + 1].contiguous().permute(1, 2, 0, 3)
            k, v = key[:row + 1].contiguous(), value[:row + 1].contiguous()
            context[row:row + 1] = self._sdpa(q, k, v, False, gqa)
        return context

    def _sdpa(self, q, k, v, causal, gqa):
        """q [b, np, sq, hn], k/v [sk, b, ng, hn] -> [sq, b, np, hn]."""
        out = scaled_dot_product_attention(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                           enable_gqa=gqa, scale=self.softmax_scale, is_causal=causal)
        return out.permute(2, 0, 1, 3)


class _ValueOf(torch.autograd.Function):
    """y = `value` in the forward (bit for bit), with the gradient of `carrier`: dL/dcarrier = dL/dy.
    For two computations of one function that differ only in rounding."""

    @staticmethod
    def forward(ctx, carrier, value):
        if carrier.shape != value.shape:
            raise ValueError(f"_ValueOf: carrier {tuple(carrier.shape)} and value {tuple(value.shape)} differ")
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


check_signature(SdpaAttention.forward, DotProductAttention.forward, "SdpaAttention.forward vs "
                "megatron DotProductAttention.forward", skip_first=False)


def with_sdpa_attention(spec: ModuleSpec) -> ModuleSpec:
    """A local GPT layer spec with its core attention replaced by SdpaAttention (in place)."""
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


OUTPUT_LAYER_FORWARD_PARAMS = ("input", "weight", "args", "kwargs")
"""The parameters of (a bound) ColumnParallelLinear._forward_impl, which serve_output_layer_in_tiles
replaces on the output layer (megatron-core 0.16.1)."""
OUTPUT_GEMM_PARAMS = ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad",
                      "sequence_parallel", "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce",
                      "tp_group")
"""The parameters of the GEMM _forward_impl delegates to (megatron-core 0.16.1): the keywords
ColumnParallelLinear.forward passes it."""


def serve_output_layer_in_tiles(model: torch.nn.Module) -> None:
    """Inside `sglang_call_layout`, the model's float32 CPU output layer (Megatron's
    ColumnParallelLinear `output_layer`, when this stage has one) computes its logits TILE_ROWS rows
    per GEMM (fp8/gemm.py `tiled_matmul`), as our SGLang plugin's lm_head does
    (served_arithmetic.tile_cpu_lm_head): a row's logits then do not depend on how many rows share
    the call. Under autograd the value is the tiles', the gradient the usual GEMM's. Outside the
    layout, or for other dtypes and devices, Megatron's own GEMM. In place, through
    compat.versions.patch (UntestedVersionError when the private method or its GEMM drifted)."""
    layer = getattr(model, "output_layer", None)
    if layer is None:
        return
    # ColumnParallelLinear.forward passes its GEMM's arguments by keyword; forward_impl reads bias
    # and sequence_parallel among them, under the names of the GEMM _forward_impl delegates to
    expect(mcore_layers, "linear_with_grad_accumulation_and_async_allreduce", dist="megatron-core",
           params=OUTPUT_GEMM_PARAMS)

    def forward_impl(input, weight, *args, **kwargs):
        if (_PROMPT_LENGTHS.get() is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or kwargs.get("sequence_parallel")):
            return original(input, weight, *args, **kwargs)
        if kwargs.get("bias") is not None:
            raise ValueError("serve_output_layer_in_tiles: the output layer has a bias; SGLang's lm_head has none")
        served = tiled_matmul(input.detach().reshape(-1, input.shape[-1]), weight.detach())
        served = served.reshape(*input.shape[:-1], weight.shape[0])
        if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad):
            return _ValueOf.apply(original(input, weight, *args, **kwargs), served)
        return served

    original = patch(layer, "_forward_impl", forward_impl, dist="megatron-core", params=OUTPUT_LAYER_FORWARD_PARAMS)
