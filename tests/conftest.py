"""Shared pytest fixtures. Multi-process helpers live in tests/torchrun.py."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Keep CPU math reproducible and the 2-core CI box responsive."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    yield
