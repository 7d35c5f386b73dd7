"""An HF checkpoint folder converted and loaded into Megatron (TP=1, PP=1), and its logits; a tiny
random Llama with its torch_dist conversion."""
import json

import torch

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.models.hf import build_conversion_target, build_model_from_hf
from tests.helpers.tiny_models import build_tiny_model


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
    """[batch, seq, vocab] logits of `tokens` [batch, seq] (positions 0..seq-1, no mask)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


def converted_tiny_llama(hf_dir, out):
    """A tiny random Llama written to `hf_dir` and converted to torch_dist at `out` (the layout of
    the running process group, as the trainer converts its start checkpoint); returns `hf_dir`."""
    model = build_tiny_model("llama", hf_dir)
    hf_config = json.loads((model / "config.json").read_text())
    convert_hf_to_megatron(model, out, build_conversion_target(hf_config).sharded_state_dict(), progress=False)
    return model
