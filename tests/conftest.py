"""Shared pytest fixtures and helpers. Multi-process helpers live in tests/torchrun.py."""
import ctypes
import os

import pytest
import torch

_PR_CAPBSET_DROP = 24
_PERMISSION_BYPASSES = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def meet_permission_bits() -> None:
    """Popen preexec_fn: the child meets file permission bits even when the tests run as root
    (CI containers do), by dropping the capabilities that bypass them from its bounding set
    before exec; for any other user a no-op. Raises when the drop is refused."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for capability in _PERMISSION_BYPASSES:
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"cannot drop capability {capability}")


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Keep CPU math reproducible and the 2-core CI box responsive."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    yield


@pytest.fixture(autouse=True)
def _triton_interpreter(request, monkeypatch):
    """Tests marked `triton` run Triton kernels on CPU tensors through Triton's interpreter.
    triton 3.x reads TRITON_INTERPRET (its `knobs.runtime.interpret`) when `triton.jit` wraps a
    function; fp8/triton_gemm.py wraps its kernel at first use per mode and calls only triton
    builtins, so setting it for the test's duration is enough. Kernels wrapped at import (SGLang's,
    or any calling triton.language's own jit helpers such as tl.zeros) need it set before the
    process first imports triton: run those in a subprocess."""
    if request.node.get_closest_marker("triton") is not None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(scope="module")
def megatron_tp1():
    """A one-process Megatron parallel state (TP=1, PP=1, gloo, CPU shims) for in-process tests;
    torn down (shims included) after the module."""
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    layout = init_distributed(tensor_parallel=1, pipeline_parallel=1, seed=3)
    yield layout
    shutdown_distributed()
