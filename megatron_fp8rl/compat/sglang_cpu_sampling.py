"""SGLang 0.5.23's seeded (deterministic-inference) sampling on the CPU tier.

Owns: what `--enable-deterministic-inference` needs on a machine without CUDA, so per-request
`sampling_seed`s work there and rollouts are reproducible across engine restarts (exact resume of
an RL run): a pure-torch port of SGLang's `murmur_hash32` (the CPU path calls
`torch.ops.sgl_kernel.murmur_hash32_cpu`, a compiled kernel the CPU tier does not have), a
scheduler-process entry point that registers it and skips SGLang's batch-invariant mode (which
raises "No supported accelerator" without CUDA/XPU), and accepting `torch_native` attention in
deterministic mode. Must not import: anything of ours above layer L1.

Measured on this CPU (tiny Llama, fp32, torch_native): with seeds, two engine starts gave the
same tokens and the same logprobs bit for bit; different seeds gave different samples. Without
batch-invariant kernels the arithmetic may depend on which requests share a batch, so
reproducibility needs the same calls in the same order (what a resumed RL run makes).
"""
from __future__ import annotations

import os

import torch

from megatron_fp8rl.compat.versions import expect, gate, patch

_MASK32 = 0xFFFFFFFF
_library = None


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _MASK32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _MASK32
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """uint32 [n, m]: MurmurHash3 of (seed low 32 bits, seed high 32 bits, position, column), the
    blocks and finalization of SGLang's Triton `murmur_hash32_kernel`. seed, positions: [n];
    col_indices: [m]. int64 arithmetic masked to 32 bits (products stay below 2**63)."""
    seed = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros_like(seed)
    h = _murmur3_mix(h, seed & _MASK32)
    h = _murmur3_mix(h, (seed >> 32) & _MASK32)
    h = _murmur3_mix(h, (positions.to(torch.int64) & _MASK32).view(-1, 1))
    h = _murmur3_mix(h, (col_indices.to(torch.int64) & _MASK32).view(1, -1))
    return _fmix32(h ^ 16).to(torch.uint32)


def register_murmur_hash() -> None:
    """Define `torch.ops.sgl_kernel.murmur_hash32_cpu` in this process (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    library.impl("murmur_hash32_cpu", murmur_hash32, "CPU")
    _library = library


def allow_torch_native_deterministic() -> None:
    """Let ServerArgs accept `attention_backend=torch_native` with deterministic inference (the
    process that resolves the server arguments calls this). torch_native attention has no
    split-KV reduction whose order depends on the batch."""
    from sglang.srt.arg_groups import choices

    allowed = expect(choices, "DETERMINISTIC_ATTENTION_BACKEND_CHOICES", dist="sglang")
    if "torch_native" not in allowed:
        allowed.append("torch_native")


def cpu_scheduler_process(*args, **kwargs):
    """SGLang's `run_scheduler_process` for the CPU tier (pass it as `run_scheduler_process_func`;
    module-level so spawn can pickle it): the version gate of this process (an entry point of its
    own), the murmur hash registered, batch-invariant mode off."""
    gate(os.environ)
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.model_executor.model_runner import ModelRunner

    register_murmur_hash()
    patch(ModelRunner, "maybe_enable_batch_invariant_mode", _no_batch_invariant_mode, dist="sglang",
          params=("self",))
    return run_scheduler_process(*args, **kwargs)


def _no_batch_invariant_mode(self) -> None:
    """Batch-invariant ops exist for CUDA/XPU only (SGLang 0.5.23)."""
