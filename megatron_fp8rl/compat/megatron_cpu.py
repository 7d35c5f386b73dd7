"""Run the real megatron-core on a machine without CUDA (the CPU tier).

Owns: the patches that let Megatron-Core's GPTModel, pipeline schedules, DDP, optimizers and
dist_checkpointing run on CPU tensors with the gloo backend. Must not import anything of ours above
layer L1.

Tested megatron-core versions: compat/versions.TESTED_VERSIONS. On any other version `enable()`
raises rather than patching code it has not been checked against (unless the entry point allowed
it explicitly, compat/versions.py).

What fails unpatched on CPU, and what each patch does (see docs/design.md):
- `torch.cuda.current_device/synchronize/set_device/manual_seed/get_rng_state/set_rng_state/
  current_stream/Stream/Event` are called unconditionally. They are redirected to CPU
  equivalents (the CPU default generator stands in for "the" CUDA generator).
- `megatron.core.tensor_parallel.random._get/_set_cuda_rng_state` reach into
  `torch.cuda.default_generators`; redirected to the CPU generator, so Megatron's RNG tracker forks
  (model-parallel vs data-parallel seeds) keep their semantics.
- Factory calls with `device="cuda"` / `device=torch.cuda.current_device()`, `.cuda()`,
  `.pin_memory()` and `.to("cuda")` appear in the schedules, the memory buffer and p2p code. A
  `TorchFunctionMode` rewrites any CUDA device argument to CPU.
- The optimizers check `param.type() == 'torch.cuda.FloatTensor'`. Under the mode `Tensor.type()`
  reports CPU float tensors under their CUDA type names, so those checks see the dtype they test.
- Not a failure but a cost: bf16 GEMMs (matmul, mm, bmm, baddbmm, addmm, linear with every tensor
  operand bf16) run under the mode as fp32 GEMMs of the bf16 values, the result rounded to bf16
  once (compat/bf16_gemm.py: a GPU bf16 GEMM's arithmetic); with the CPU's own bf16 kernels a
  Megatron bf16 step of the stability study took 402 s, with the rule 13 s.
  The mode does not see inside `torch.autograd.backward` (torch 2.13 dispatches that call to the
  mode, and a mode is off while it handles a call), so the backward of Megatron's linear autograd
  Functions, whose dgrad/wgrad are explicit bf16 matmuls, runs under its own bf16-GEMM mode.

Usage: entry points call `enable()` once, explicitly, before building models (never as an import
side effect). It is a no-op when CUDA is available. `disable()` undoes it (tests).
"""
from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

from megatron_fp8rl.compat.bf16_gemm import bf16_gemm_in_fp32, in_bf16_gemm_mode
from megatron_fp8rl.compat.versions import patch, require, restore

_CPU = torch.device("cpu")
_saved: dict[tuple[object, str], object] = {}
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA ordinal in torch's device parsing
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _bf16_gemm_backward(backward):
    """`backward` of a custom autograd Function, run with bf16 GEMMs in fp32."""
    return staticmethod(in_bf16_gemm_mode(backward))


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every request for a CUDA device into a CPU one; runs bf16 GEMMs in fp32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (result := bf16_gemm_in_fp32(func, args, kwargs)) is not None:
            return result
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.pop("pin_memory", False):
            pass  # pinned host memory is a CUDA concept
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


class _NullStream:
    """CPU stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return _NullEvent()

    def synchronize(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _NullEvent:
    """CPU stand-in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _null_stream_context(stream):
    return _NullStream()


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _patch(owner: object, name: str, value: object, dist: str = "torch", params=None) -> None:
    """`versions.patch` (version, existence and, with `params`, signature checked), remembering
    the first original for `disable`."""
    original = patch(owner, name, value, dist=dist, params=params)
    _saved.setdefault((owner, name), original)


class _SameContextRngWarningFilter(logging.Filter):
    """On CPU the "CUDA" generator is the CPU generator, so Megatron's warning that the CPU RNG
    state changed inside an RNG-tracker fork is expected and says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_FILTER = _SameContextRngWarningFilter()


def check_version() -> str:
    """Return the installed megatron-core version; raise if the shims were not tested on it
    (compat/versions.py, whose override the entry point set)."""
    return require("megatron-core")


def enable() -> bool:
    """Activate the CPU patches unless CUDA is available. Returns True if they are active."""
    global _mode
    if torch.cuda.is_available():
        return False
    if _mode is not None:
        return True
    check_version()
    from megatron.core.tensor_parallel import random as mcore_random

    cuda = torch.cuda
    _patch(cuda, "current_device", lambda: _CPU, params=())
    _patch(cuda, "set_device", lambda device: None, params=("device",))
    _patch(cuda, "device_count", lambda: 0, params=())
    _patch(cuda, "synchronize", lambda device=None: None, params=("device",))
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    _patch(cuda, "manual_seed", _cpu_manual_seed, params=("seed",))
    _patch(cuda, "manual_seed_all", lambda seed: None, params=("seed",))
    _patch(cuda, "get_rng_state", _cpu_get_rng_state, params=("device",))
    _patch(cuda, "set_rng_state", _cpu_set_rng_state, params=("new_state", "device"))
    _patch(cuda, "current_stream", lambda device=None: _NullStream(), params=("device",))
    _patch(cuda, "default_stream", lambda device=None: _NullStream(), params=("device",))
    _patch(cuda, "stream", _null_stream_context, params=("stream",))
    _patch(cuda, "Stream", _NullStream)
    _patch(cuda, "Event", _NullEvent)
    _patch(cuda.random, "get_rng_state", _cpu_get_rng_state, params=("device",))
    _patch(cuda.random, "set_rng_state", _cpu_set_rng_state, params=("new_state", "device"))
    _patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state, "megatron-core",
           ("device", "clone", "graph_safe"))
    _patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state, "megatron-core",
           ("new_state", "device", "graph_safe"))
    logging.getLogger(mcore_random.__name__).addFilter(_RNG_FILTER)
    from megatron.core.tensor_parallel import layers as mcore_layers

    for function in (mcore_layers.LinearWithGradAccumulationAndAsyncCommunication,
                     mcore_layers.LinearWithFrozenWeight):
        _patch(function, "backward", _bf16_gemm_backward(function.backward), "megatron-core",
               ("ctx", "grad_output"))
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    return True


def disable() -> None:
    """Undo `enable()`: restore every patched attribute and leave the function mode."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    for (owner, name), value in reversed(list(_saved.items())):
        restore(owner, name, value)
    _saved.clear()
    from megatron.core.tensor_parallel import random as mcore_random

    logging.getLogger(mcore_random.__name__).removeFilter(_RNG_FILTER)
