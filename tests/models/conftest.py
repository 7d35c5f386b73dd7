"""Helpers shared by the model tests: a converted checkpoint loaded into Megatron, and its logits;
the Transformer Engine wheel fixtures (tests/models/te_wheel.py)."""
import json

import torch

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.models.hf import build_model_from_hf
from tests.models.te_wheel import te_recipe_module, te_scaling_functions, te_wheel  # noqa: F401  (fixtures)


def megatron_from_hf_dir(hf_dir, tmp_path, params_dtype=torch.float32):
    """Convert `hf_dir` and load it into a fresh Megatron GPTModel (TP=1, PP=1)."""
    from megatron.core import dist_checkpointing

    hf_config = json.loads((hf_dir / "config.json").read_text())
    meta = build_model_from_hf(hf_config, device="meta")
    convert_hf_to_megatron(hf_dir, tmp_path / "mcore", meta.sharded_state_dict(), progress=False)
    model = build_model_from_hf(hf_config, params_dtype=params_dtype).eval()
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "mcore")))
    return model


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)
