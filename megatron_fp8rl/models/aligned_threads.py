"""Thread pinning for the attention calls that trainer and rollout must compute bit-identically.

Owns: `single_threaded()` (a block in which torch's intra-op pool has one thread) and
`pin_torch_native_attention_threads()` (SGLang's torch_native attention calls run single-threaded).
Must not import: anything of ours above layer L2; sglang only inside the patch function.

Why: aligned rollouts need the trainer's attention (models/megatron_attention.py, which repeats
SGLang's calls) to have SGLang's bits. torch's CPU SDPA splits work across its intra-op threads
in a way that can change a row's last bits with the thread count and the call's batch: on an
AVX2-only machine the trainer's batched calls and SGLang's per-request calls disagreed with 2
threads and agreed with 1 (tests/models/test_megatron_attention.py). The SGLang scheduler and the
trainer need not run with the same thread count either. Running exactly these calls with one
thread on both sides removes the dependence; they are small (one query row, or one prompt), so
the pool buys little there.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

_PINNED = "_megatron_fp8rl_single_threaded"


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

    setattr(run, _PINNED, True)
    return run


def pin_torch_native_attention_threads() -> None:
    """Make SGLang's TorchNativeAttnBackend run its SDPA calls (`_run_sdpa_forward_extend`,
    `_run_sdpa_forward_decode`) with one thread, in this process (idempotent). AttributeError
    naming the method when an SGLang version no longer has it."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    for name in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode"):
        method = getattr(TorchNativeAttnBackend, name, None)
        if method is None:
            raise AttributeError(f"sglang's TorchNativeAttnBackend has no {name}: the aligned-attention "
                                 "thread pin targets SGLang 0.5.23's backend")
        if not getattr(method, _PINNED, False):
            setattr(TorchNativeAttnBackend, name, _pinned(method))
