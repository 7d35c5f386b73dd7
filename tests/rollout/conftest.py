"""Fixtures for the rollout tests: tiny checkpoints sized for a 2-core CPU box."""
import pytest

from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> folder of a tiny random-weight checkpoint with its tokenizer."""
    return {f: build_tiny_model(f, tmp_path_factory.mktemp(f)) for f in ("qwen3", "llama")}
