"""A model family whose names miss its table fails loudly in every consumer of the family facts.

The checkpoint: a tiny Llama whose attention and MLP are stored fused, as Phi-3 stores them
(`self_attn.qkv_proj`, `mlp.gate_up_proj`), under the Llama architecture: names models/families/llama.py
does not list. Conversion, FP8 export and the weight sync each refuse it naming the family (or,
for the sync, which holds names but no config, every registered family) and the tensor; the SGLang
plugin refuses a linear layer the family does not list, and an architecture no family claims.
Here and not in tests/models/ because it imports SGLang in-process, as this folder's tests do.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.family import UnsupportedModelError
from megatron_fp8rl.models.hf import build_model_from_hf
from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors
from tests.helpers.rollout import needs_sglang
from tests.helpers.tiny_hf import save_tiny_hf, tiny_hf_config

FUSED_QKV = "model.layers.0.self_attn.qkv_proj.weight"
FUSED = r"model\.layers\.0\.(self_attn\.qkv|mlp\.gate_up)_proj\.weight"


def _fused_like_phi3(tensors: dict) -> dict:
    fused = {}
    for name, tensor in tensors.items():
        for parts, into in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if name.endswith(f".{parts[0]}.weight"):
                fused[name.replace(parts[0], into)] = torch.cat([tensors[name.replace(parts[0], p)] for p in parts])
        if not any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            fused[name] = tensor
    return fused


@needs_sglang
def test_names_missing_from_the_family_table_are_refused_everywhere(tmp_path, megatron_tp1):
    hf_dir = save_tiny_hf("llama", tmp_path / "llama")
    tensors = _fused_like_phi3(load_file(hf_dir / "model.safetensors"))
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())

    with pytest.raises(CheckpointError, match=rf"in the llama table, models/families/llama.py\): .*{FUSED_QKV}"):
        convert_hf_to_megatron(hf_dir, tmp_path / "mcore", build_model_from_hf(config, device="meta")
                               .sharded_state_dict(), progress=False)
    with pytest.raises(UnsupportedModelError, match=rf"llama: HF tensor {FUSED} is not in "
                                                    r"the family's name table \(models/families/llama\.py\)"):
        export_fp8(hf_dir, tmp_path / "fp8", Fp8ExportOptions(), progress=False)
    with pytest.raises(UnsupportedModelError, match=rf"HF tensor {FUSED} is in no model "
                                                    r"family's name table \(llama, qwen2, qwen3"):
        list(rollout_tensors(tensors.items(), 2, plan_for(RolloutFp8.PER_TENSOR, "none")))
    assert not (tmp_path / "mcore").exists() and not (tmp_path / "fp8").exists()

    plugin, linear = _sglang_plugin()
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "hf_config": tiny_hf_config("llama")}
    served = plugin.Fp8RLConfig.from_config(quant)
    with pytest.raises(UnsupportedModelError, match=r"llama: SGLang linear model\.layers\.0\.self_attn\.q_a_proj "
                                                    r"is not a decoder linear of the family \(models/families/llama.py"):
        served.get_quant_method(linear, "model.layers.0.self_attn.q_a_proj")
    assert isinstance(served.get_quant_method(linear, "model.layers.0.self_attn.qkv_proj"), plugin.Fp8RLLinearMethod)
    unknown = tiny_hf_config("llama")
    unknown.architectures = ["Phi3ForCausalLM"]
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture \['Phi3ForCausalLM'\]; supported"):
        plugin.Fp8RLConfig.from_config(dict(quant, hf_config=unknown))


def _sglang_plugin():
    """rollout/sglang_fp8.py imported with SGLang's CPU stand-ins, and one SGLang linear layer."""
    from megatron_fp8rl.compat import sglang_cpu

    sglang_cpu.install()
    from sglang.srt.layers.linear import ReplicatedLinear

    from megatron_fp8rl.rollout import sglang_fp8

    return sglang_fp8, ReplicatedLinear(8, 8, bias=False)
