"""The arithmetic SGLang's CPU tier serves with, made repeatable call for call by the trainer.

Owns: `single_threaded()` (a block in which torch's intra-op pool has one thread) and the plugin's
patches of SGLang's CPU serving arithmetic, applied in the scheduler process by
rollout/sglang_fp8.register(): `align_torch_native_attention()` (the torch_native backend's SDPA
calls run single-threaded, and its extend computes every query row as its own one-query call) and
`tile_cpu_lm_head()` (a float32 lm_head computed TILE_ROWS rows per GEMM, fp8/gemm.py's
`tiled_matmul`). The trainer's side of the same arithmetic lives in models/megatron_attention.py.
Must not import: anything of ours above layer L2; sglang only inside the patch functions.

Why: aligned rollouts need the trainer's recompute to have SGLang's bits. torch's CPU SDPA and
GEMMs are not row-consistent: a row's last bits change with the call's shape (how many query rows
share an SDPA call, how many rows share a GEMM) and with the thread split. Upstream, a prompt's
rows are computed in one causal call at prefill, but as an extend over a cached prefix when SGLang's
radix cache holds part of it (after an eval its prompts' prefixes are cached; samples of one
prompt; a shared chat template), and then the cached keys were computed in a call of another shape
(issue #44: mismatch 0.09 on SmolLM2 on every step after an eval). One query row per SDPA call on
both sides (decode already is), one thread, and fixed 16-row lm_head tiles remove every such
dependence: a row's bits depend on its own inputs only, however the scheduler batches, caches or
chunks the prompt.

Every patch goes through compat/versions.patch: it checks the sglang version and the signature of
the private method it replaces, and raises UntestedVersionError naming it on a drift.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch.nn.functional import scaled_dot_product_attention

from megatron_fp8rl.compat.versions import expect, patch
from megatron_fp8rl.fp8.gemm import tiled_matmul


@contextmanager
def single_threaded():
    """torch.set_num_threads(1) for the block; the previous count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pinned(method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        with single_threaded():
            return method(*args, **kwargs)

    run.megatron_fp8rl_pinned = True
    return run


def pin_torch_native_attention_threads() -> None:
    """Make SGLang's TorchNativeAttnBackend run its SDPA calls (`_run_sdpa_forward_extend`,
    `_run_sdpa_forward_decode`) with one thread, in this process (idempotent). AttributeError
    naming the method when an SGLang version no longer has it."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    for name in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode"):
        method = expect(TorchNativeAttnBackend, name, dist="sglang")
        if not getattr(method, "megatron_fp8rl_pinned", False):
            patch(TorchNativeAttnBackend, name, _pinned(method), dist="sglang")


def align_torch_native_attention() -> None:
    """SGLang's torch_native attention as the trainer repeats it (idempotent): its extend computes
    each query row as a one-query SDPA call against the keys up to that row (the call decode makes),
    and both run single-threaded. UntestedVersionError when sglang's version or the extend's
    signature is not the one this was written against."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    current = expect(TorchNativeAttnBackend, "_run_sdpa_forward_extend", dist="sglang")
    if not getattr(current, "megatron_fp8rl_row_calls", False):
        _extend_row_by_row.megatron_fp8rl_row_calls = True
        patch(TorchNativeAttnBackend, "_run_sdpa_forward_extend", _extend_row_by_row, dist="sglang",
              like=_extend_row_by_row)
    pin_torch_native_attention_threads()


def _extend_row_by_row(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                       extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                       causal=False, is_cross_attn=False, sliding_window_size=None):
    """TorchNativeAttnBackend._run_sdpa_forward_extend (SGLang 0.5.23) for causal decoder
    self-attention, every extend row its own one-query call: query [tokens, heads, dim] ->
    output. The layouts are decode's (`_run_sdpa_forward_decode`): a [heads, 1, dim] view of the
    query, the keys gathered from the cache as [keys, kv heads, dim] and moved to [kv heads, keys,
    dim]. ValueError for what it does not reproduce (encoder, cross or non-causal attention, a
    sliding window)."""
    if encoder_lens is not None or is_cross_attn or not causal or sliding_window_size is not None:
        raise ValueError(f"megatron_fp8rl's row-by-row extend serves causal decoder self-attention only; "
                         f"found encoder_lens={encoder_lens is not None}, is_cross_attn={is_cross_attn}, "
                         f"causal={causal}, sliding_window_size={sliding_window_size}")
    query = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
    start_q = 0
    for seq in range(seq_lens.shape[0]):
        prefix, rows = int(extend_prefix_lens[seq]), int(extend_seq_lens[seq])
        tokens = req_to_token[req_pool_indices[seq], :int(seq_lens[seq])]
        keys, values = k_cache[tokens], v_cache[tokens]  # [keys, kv heads, dim], contiguous
        for row in range(rows):
            end_kv = prefix + row + 1
            key = keys[:end_kv].movedim(0, 1).to(query.dtype)
            value = values[:end_kv].movedim(0, 1).to(query.dtype)
            out = scaled_dot_product_attention(query[:, start_q + row:start_q + row + 1].unsqueeze(0),
                                               key.unsqueeze(0), value.unsqueeze(0), enable_gqa=enable_gqa,
                                               scale=scaling, is_causal=False)
            output[start_q + row:start_q + row + 1] = out.squeeze(0).movedim(1, 0)
        start_q += rows
    return output


def tile_cpu_lm_head() -> None:
    """SGLang's plain float32 lm_head on CPU computed TILE_ROWS rows per GEMM (fp8/gemm.py's
    `tiled_matmul`, as the trainer's output layer in the served layout), so a row's logits do not
    depend on how many rows the batch has (idempotent). Other lm_heads (LoRA, quantized, GPU,
    bf16) keep SGLang's path. UntestedVersionError on an sglang version or signature drift."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    current = expect(LogitsProcessor, "_compute_lm_head", dist="sglang")
    if getattr(current, "megatron_fp8rl_tiled", False):
        return

    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    def compute_lm_head(self, hidden_states, lm_head, embedding_bias=None, *, out=None):
        weight = getattr(lm_head, "weight", None)
        plain = (embedding_bias is None and not hasattr(lm_head, "set_lora") and isinstance(weight, torch.Tensor)
                 and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None)))
        if plain and weight.device.type == "cpu" and weight.dtype == hidden_states.dtype == torch.float32:
            return tiled_matmul(hidden_states, weight)
        return current(self, hidden_states, lm_head, embedding_bias, out=out)

    compute_lm_head.__qualname__ = "LogitsProcessor._compute_lm_head"
    compute_lm_head.megatron_fp8rl_tiled = True
    patch(LogitsProcessor, "_compute_lm_head", compute_lm_head, dist="sglang", like=compute_lm_head)
