"""Fixtures every test folder may use. Helpers that test modules share are plain functions in
tests/helpers/, imported explicitly."""
import socket

import pytest
import torch

from tests.helpers.network import guarded


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Fail a test whose process connects a socket to anything but loopback (SGLang servers,
    gloo and TCPStores here all listen on 127.0.0.1). Guards this process; the processes a test
    starts are not patched."""
    monkeypatch.setattr(socket.socket, "connect", guarded(socket.socket.connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(socket.socket.connect_ex))
    yield


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
