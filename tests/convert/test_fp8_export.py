"""FP8 export: the checkpoint read back (and dequantized) equals what megatron_fp8rl.fp8's
quantizers produce for the same weights, block and per-tensor; kept tensors are untouched; the
config's quantization_config is what SGLang's `fp8` method reads; static input scales come from
bounds (recipe) or from a prompt calibration; the Megatron source gives the same file as the HF
source. In process, one rank. SGLang itself is not installed here; transformers' parser of the
same `quant_method: fp8` config stands in for it.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_fp8rl.convert.fp8_calibration import calibrate_input_bounds
from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.fp8.formats import get_format
from megatron_fp8rl.fp8.quantize import dequantize_blockwise, quantize_blockwise, quantize_per_tensor
from megatron_fp8rl.models.family import UnsupportedModelError
from megatron_fp8rl.models.hf import build_model_from_hf

E4M3 = get_format("e4m3")
Q_PROJ = "model.layers.1.self_attn.q_proj"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Qwen3 with 256-wide layers, so weights span several 128x128 blocks (one partial)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("fp8")
    config = Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=320, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "hf")
    vocab = {chr(97 + i % 26) * (1 + i // 26): i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a").save_pretrained(root / "hf")
    return root / "hf"


def test_block_export_reads_back_as_the_quantizer_output(hf_dir, tmp_path):
    export_fp8(hf_dir, tmp_path / "fp8", Fp8ExportOptions(scheme="block", keep_first_layers=1), progress=False)
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "fp8" / "model.safetensors")
    quantized = [n for n in exported if n.endswith("weight_scale_inv")]
    assert len(quantized) == 2 * 7  # layers 1 and 2; layer 0 kept
    for scale_name in quantized:
        name = scale_name.replace("_scale_inv", "")
        expected = quantize_blockwise(original[name], E4M3)
        assert exported[name].dtype == torch.float8_e4m3fn
        assert torch.equal(exported[name].view(torch.uint8), expected.data.view(torch.uint8)), name
        assert torch.equal(exported[scale_name], expected.scale_inv), scale_name
        torch.testing.assert_close(dequantize_blockwise(exported[name], exported[scale_name]),
                                   expected.dequantize(), atol=0, rtol=0)
    assert exported[f"{Q_PROJ}.weight_scale_inv"].shape == (2, 2)
    assert exported["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.q_norm.weight"):
        assert torch.equal(exported[name], original[name]), name
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert config["activation_scheme"] == "dynamic" and config["fmt"] == "e4m3"
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.down_proj"} <= set(config["modules_to_not_convert"])
    assert "model.layers.1.mlp.down_proj" not in config["modules_to_not_convert"]
    assert (tmp_path / "fp8" / "tokenizer.json").exists()


def test_transformers_fp8_config_parser_accepts_it(hf_dir, tmp_path):
    from transformers.quantizers.auto import AutoQuantizationConfig

    export_fp8(hf_dir, tmp_path / "fp8", Fp8ExportOptions(), progress=False)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    parsed = AutoQuantizationConfig.from_dict(config)
    assert tuple(parsed.weight_block_size) == (128, 128) and parsed.activation_scheme == "dynamic"
    assert "lm_head" in parsed.modules_to_not_convert


def test_per_tensor_static_with_recipe_bounds(hf_dir, tmp_path):
    bounds = {Q_PROJ: {"weight": 0.05, "input": 3.0}}
    bounds.update({f"model.layers.{i}.{m}": {"input": 2.0} for i in range(3) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if f"model.layers.{i}.{m}" != Q_PROJ})
    options = Fp8ExportOptions(scheme="tensor", activation_scheme="static", keep_last_layers=1, bounds=bounds)
    export_fp8(hf_dir, tmp_path / "fp8", options, progress=False)
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "fp8" / "model.safetensors")
    expected = quantize_per_tensor(original[f"{Q_PROJ}.weight"], E4M3, torch.tensor(0.05))
    assert torch.equal(exported[f"{Q_PROJ}.weight"].view(torch.uint8), expected.data.view(torch.uint8))
    assert exported[f"{Q_PROJ}.weight_scale"].shape == () and torch.equal(exported[f"{Q_PROJ}.weight_scale"], expected.scale_inv)
    assert float(exported[f"{Q_PROJ}.input_scale"]) == pytest.approx(3.0 / 448, rel=1e-7)
    assert "model.layers.2.self_attn.q_proj.weight_scale" not in exported  # last layer kept
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["activation_scheme"] == "static" and "weight_block_size" not in config


def test_static_without_bounds_names_the_module(hf_dir, tmp_path):
    options = Fp8ExportOptions(scheme="tensor", activation_scheme="static")
    with pytest.raises(ValueError, match="no input bound for .*model.layers.0.self_attn.q_proj"):
        export_fp8(hf_dir, tmp_path / "fp8", options, progress=False)
    assert not (tmp_path / "fp8").exists()


def test_calibrated_input_bound_is_the_norm_output_amax(hf_dir):
    """q_proj's input is input_layernorm's output: an independent hook must see the same amax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["a b c d e", "bb cc dd aa b"]
    bounds = calibrate_input_bounds(hf_dir, prompts)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seen = []
    model.model.layers[1].input_layernorm.register_forward_hook(lambda m, i, out: seen.append(out.abs().max()))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    with torch.no_grad():
        for prompt in prompts:
            model(tokenizer(prompt, return_tensors="pt")["input_ids"])
    assert bounds[Q_PROJ]["input"] == pytest.approx(float(max(seen)), rel=0)
    assert len(bounds) == 3 * 7


def test_megatron_source_gives_the_same_checkpoint(hf_dir, tmp_path, megatron_tp1):
    config = json.loads((hf_dir / "config.json").read_text())
    meta = build_model_from_hf(config, device="meta")
    convert_hf_to_megatron(hf_dir, tmp_path / "mcore", meta.sharded_state_dict(), progress=False)
    export_fp8(hf_dir, tmp_path / "from_hf", Fp8ExportOptions(), progress=False)
    export_fp8(tmp_path / "mcore", tmp_path / "from_megatron", Fp8ExportOptions(), source="megatron", progress=False)
    a, b = load_file(tmp_path / "from_hf" / "model.safetensors"), load_file(tmp_path / "from_megatron" / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


@pytest.mark.parametrize("architecture, model_type", [("MixtralForCausalLM", "mixtral"),
                                                      ("GPT2LMHeadModel", "gpt2")])
def test_families_without_a_table_are_refused_by_name(hf_dir, tmp_path, architecture, model_type):
    """Before: an "FP8 export" of whatever names matched the Llama pattern, exit 0."""
    import shutil

    other = shutil.copytree(hf_dir, tmp_path / model_type)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, architectures=[architecture],
                                                       model_type=model_type)))
    with pytest.raises(UnsupportedModelError, match=rf"unsupported architecture \['{architecture}'\]; supported:"):
        export_fp8(other, tmp_path / "out", Fp8ExportOptions(), progress=False)
    assert not (tmp_path / "out").exists()


def test_groupwise_aligned_checkpoint_and_sync_hold_the_trainers_1x128_groups(hf_dir, tmp_path):
    """rollout.fp8=aligned with the groupwise trainer recipe: the start checkpoint and every sync
    quantize each HF weight in 1x128 groups exactly as the recipe's quantizer does (a row's
    groups depend on that row only, so the trainer's fused q/k/v and gate/up rows quantize the
    same), and the config shows SGLang 1x128 blocks with dynamic activation groups."""
    from megatron_fp8rl.fp8.quantizer import make_quantizers
    from megatron_fp8rl.fp8.recipe import groupwise
    from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
    from megatron_fp8rl.trainer.rollout_fp8 import prepare_rollout_checkpoint, rollout_tensors

    plan = plan_for(RolloutFp8.ALIGNED, "groupwise")
    served = prepare_rollout_checkpoint(hf_dir, tmp_path / "served", plan, "dynamic", [])
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(served / "model.safetensors")
    synced = dict(rollout_tensors(original.items(), 3, plan))
    assert synced.keys() == exported.keys()
    quantizer = make_quantizers(groupwise()).weight
    for scale_name in [n for n in exported if n.endswith("weight_scale_inv")]:
        name = scale_name.replace("_scale_inv", "")
        expected = quantizer.quantize(original[name])
        rows, columns = original[name].shape
        assert expected.block == (1, 128) and exported[scale_name].shape == (rows, -(-columns // 128))
        for source in (exported, synced):
            assert torch.equal(source[name].view(torch.uint8), expected.data.view(torch.uint8)), name
            assert torch.equal(source[scale_name], expected.scale_inv), scale_name
    config = json.loads((served / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [1, 128] and config["activation_scheme"] == "dynamic"
