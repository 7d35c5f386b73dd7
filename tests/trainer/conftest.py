"""Fixtures of the trainer tests; the helpers that run `megatron-fp8rl train` live in
tests/helpers/train.py."""
import pytest

from tests.helpers.tiny_models import build_tiny_rl_inputs


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    """(model folder, prompts JSONL) of a tiny random Llama RL run."""
    root = tmp_path_factory.mktemp("rl")
    return build_tiny_rl_inputs(root)
