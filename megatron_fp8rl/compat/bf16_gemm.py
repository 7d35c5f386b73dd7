"""bf16 GEMMs on CPU computed as a GPU computes them: the fp32 GEMM of the bf16 values, rounded to
bf16 once.

Owns: the rule (`bf16_gemm_in_fp32`), a function mode that applies it (`Bf16GemmMode`), and the
SGLang patch that runs the served model's unquantized linears and lm_head under it on CPU
(`patch_sglang_bf16_gemms`). Must not import: anything of ours above layer L1; sglang only inside
the patch function.

Why: bf16 x bf16 products are exact in fp32, and a GPU bf16 GEMM accumulates in fp32 and rounds
once, so the emulation has a GPU GEMM's arithmetic (up to summation order). The CPU's own bf16
kernels on an AVX2 machine without bf16 instructions are slow: 2.6x (x @ W^T), 18x (dy @ W) and
1.6x (dy^T @ x) an fp32 GEMM at SmolLM2's [512, 576] x [576, 1536] (2 threads). Both sides of a
bf16 RL step use it on the CPU tier: the Megatron trainer (compat/megatron_cpu.py) and SGLang's
bf16 rollouts (the `sglang.srt.plugins` entry point calls `patch_sglang_bf16_gemms`), which
before took ~2.5x an FP8 rollout's time per sequence in the stability study.
"""
from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

from megatron_fp8rl.compat.versions import expect, patch

BF16_GEMMS = frozenset({torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
                        torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm,
                        torch.nn.functional.linear})


def bf16_gemm_in_fp32(func, args: tuple, kwargs: dict):
    """A bf16 GEMM as the GPU computes it (module docstring), or None when `func` is not one of
    BF16_GEMMS on CPU tensors that are all bf16 (or writes to `out`)."""
    if func not in BF16_GEMMS or "out" in kwargs:
        return None
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return None

    def up(value):
        return value.float() if isinstance(value, torch.Tensor) else value

    return func(*map(up, args), **{k: up(v) for k, v in kwargs.items()}).to(torch.bfloat16)


class Bf16GemmMode(TorchFunctionMode):
    """Runs every bf16 CPU GEMM of the block by `bf16_gemm_in_fp32`; other calls unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        result = bf16_gemm_in_fp32(func, args, kwargs)
        return func(*args, **kwargs) if result is None else result


def in_bf16_gemm_mode(method):
    """`method` run under `Bf16GemmMode` (works for functions and static methods' functions)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with Bf16GemmMode():
            return method(*args, **kwargs)

    run.megatron_fp8rl_bf16_gemms = True
    return run


def patch_sglang_bf16_gemms() -> bool:
    """On SGLang's CPU engine, run `UnquantizedLinearMethod.apply` (every linear left in high
    precision) and `LogitsProcessor._compute_lm_head` under `Bf16GemmMode`; float32 calls pass
    through unchanged (one dtype test per GEMM). Idempotent; False (nothing patched) off the CPU
    engine, where SGLang's own kernels run."""
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        return False
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    for owner, name, params in ((UnquantizedLinearMethod, "apply", ("self", "layer", "x", "bias")),
                                (LogitsProcessor, "_compute_lm_head",
                                 ("self", "hidden_states", "lm_head", "embedding_bias", "out"))):
        method = expect(owner, name, dist="sglang")
        if not getattr(method, "megatron_fp8rl_bf16_gemms", False):
            patch(owner, name, in_bf16_gemm_mode(method), dist="sglang", params=params)
    return True
