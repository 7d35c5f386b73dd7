"""Megatron-Core GPTModel logits equal transformers' on the same tokens, per architecture.

The HF checkpoint goes through the real conversion (HF safetensors -> torch_dist) and Megatron's
own dist_checkpointing load, so this checks the config mapping, the name/layout tables (q/k/v
interleaving, gate/up order, norms, biases, q/k norms, tied embeddings) and the rope settings
(Llama's llama3 scaling: positions run to 200, past the original context of 64).
In process, one rank (TP=1, PP=1), fp32.
"""
import json

import pytest
import torch

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.models.hf import build_model_from_hf
from tests.helpers.megatron_models import megatron_from_hf_dir, megatron_logits
from tests.helpers.tiny_hf import ARCHITECTURES, VOCAB, tiny_hf_model

# fp32 on CPU, logits of magnitude ~1.5: the two implementations differ only in summation order
# and rope/norm formulation; measured max |diff| 5e-7 to 8e-7. 1e-4 is far below any mapping
# error (a wrong rope scaling or a swapped q/k head moves logits by >1e-2).
ATOL = 1e-4
SEQ = 200


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_megatron_logits_match_transformers(arch, megatron_tp1, tmp_path):
    hf = tiny_hf_model(arch)
    hf.save_pretrained(tmp_path / "hf")
    model = megatron_from_hf_dir(tmp_path / "hf", tmp_path)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    got = megatron_logits(model, tokens)
    assert got.shape == expected.shape
    assert expected.abs().max() > 0.5  # not a degenerate comparison
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_fp8_local_spec_loads_the_converted_checkpoint(megatron_tp1, tmp_path):
    """With an FP8 recipe the local spec's linears are the FP8 drop-ins; the same converted
    checkpoint loads and the logits stay within FP8 noise of transformers' (measured max |diff|
    0.08 on logits up to ~1.6, per-tensor E4M3 weights and activations) while visibly differing."""
    from megatron.core import dist_checkpointing

    from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling
    from megatron_fp8rl.models.megatron_fp8_linear import Fp8ColumnParallelLinear

    hf = tiny_hf_model("qwen3")
    hf.save_pretrained(tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    meta = build_model_from_hf(hf_config, device="meta")
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mcore", meta.sharded_state_dict(), progress=False)
    model = build_model_from_hf(hf_config, fp8_recipe=CalibratedDelayedScaling()).eval()
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv, Fp8ColumnParallelLinear)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "mcore")))
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (megatron_logits(model, tokens) - hf(tokens).logits).abs().max()
    assert 1e-3 < float(difference) < 0.5
