"""A one-process Megatron parallel state (TP=1, PP=1) for in-process model tests."""
import pytest

from megatron_fp8rl.compat import megatron_cpu
from megatron_fp8rl.launch import init_distributed, shutdown_distributed


@pytest.fixture(scope="module")
def megatron_tp1():
    layout = init_distributed(tensor_parallel=1, pipeline_parallel=1, seed=3)
    yield layout
    shutdown_distributed()
    megatron_cpu.disable()
