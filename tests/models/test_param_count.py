"""The example model configs (examples/models/*.yaml): each builds as a Megatron GPTModel on the
meta device (no weights) with exactly the parameter count transformers reports for the same HF
config, and its TP/PP layout divides the model. In process, one rank.
"""
from pathlib import Path

import pytest
import torch
import yaml

from megatron_fp8rl.models.hf import build_model_from_hf, check_parallel_layout

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "models").glob("*.yaml"))


def transformers_param_count(hf_config: dict) -> int:
    """transformers' own count (tied embeddings once), built on the meta device."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config).num_parameters()


def test_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"qwen3_8b", "qwen2_5_32b", "llama3_1_8b"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_meta_model_matches_transformers_param_count(example, megatron_tp1):
    spec = yaml.safe_load(example.read_text())
    hf_config, layout = spec["hf_config"], spec["parallel"]
    check_parallel_layout(hf_config, layout["tensor_parallel"], layout["pipeline_parallel"])
    model = build_model_from_hf(hf_config, params_dtype=torch.bfloat16, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    megatron_count = sum(p.numel() for p in model.parameters())
    assert megatron_count == transformers_param_count(hf_config)
    assert megatron_count > 7e9
