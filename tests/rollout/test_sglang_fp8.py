"""SGLang serving FP8 checkpoints through our quantization method (rollout/sglang_fp8.py), on CPU.

Oracle: transformers in fp32 with the checkpoint's FP8 weights dequantized and every quantized
linear's input quantized-dequantized by hooks, with plain torch float8 casts
(tests/helpers/fp8_reference.py). Checkpoints come from convert/fp8_export.py: per-tensor static
and per-tensor dynamic (tiny Qwen3), blockwise 128x128 (tiny Llama, whose loader renames
weight_scale_inv). Also: a quantized weight sync is served (sent in several buckets), and bad
updates are refused while the engine keeps serving. Each test starts one SGLang engine (scheduler + detokenizer processes).
"""
import pytest
import torch

from megatron_fp8rl.convert.fp8_calibration import calibrate_input_bounds
from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
from megatron_fp8rl.rollout.engine import SamplingParams, WeightUpdateError
from megatron_fp8rl.rollout.weight_transfer import buckets
from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors
from tests.helpers.fp8_reference import apply_fp8
from tests.helpers.hf_reference import load_state_dict, token_logprobs
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import load_hf, random_state_dict

pytestmark = [needs_sglang, pytest.mark.slow]

PROMPTS = [[5, 9, 17, 33], [40, 41, 7], [100, 3, 64, 12, 90]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)
# Same FP8 values on both sides; what differs is fp32 summation order (and x * (1/s) vs x / s in
# the activation cast), which can move an activation across an FP8 rounding boundary
# (DESIGN hazard 3). Measured (fp32, 3 prompts x 2 samples x 8 tokens, |delta logprob| mean/max):
# per-tensor static 5.6e-6 / 2.4e-4, dynamic 6.9e-7 / 2.4e-6, blockwise 4.9e-7 / 2.2e-6, after a
# sync 5.8e-7 / 2.5e-6; FP8 vs the fp32 model: 0.17-0.35 mean.
MEAN_TOL = 1e-4
MAX_TOL = 5e-3


def _export(hf_dir, out, family_scheme: str):
    if family_scheme == "tensor_static":
        prompts = [" ".join(f"w{t}" for t in p) for p in PROMPTS]
        bounds = calibrate_input_bounds(hf_dir, prompts)
        options = Fp8ExportOptions(scheme="tensor", activation_scheme="static", bounds=bounds)
    elif family_scheme == "tensor_dynamic":
        options = Fp8ExportOptions(scheme="tensor")
    else:
        options = Fp8ExportOptions(scheme="block")
    export_fp8(hf_dir, out, options, progress=False)
    return out


def _engine(fp8_dir, scheme: str, bucket_mb: float = 512):
    from megatron_fp8rl.rollout.sglang_engine import SGLangEngine

    fp8 = "blockwise" if scheme == "block" else "per_tensor"
    return SGLangEngine(sglang_config(fp8_dir, fp8=fp8, activation_scheme=scheme.split("_")[-1]
                                      if scheme != "block" else "dynamic"), bucket_mb=bucket_mb)


def _differences(samples, model) -> torch.Tensor:
    """|SGLang logprob - model logprob| of every generated token."""
    diffs = []
    for s in samples:
        expected = token_logprobs(model, s.prompt_token_ids, s.token_ids)
        diffs.append((torch.tensor(s.logprobs) - expected).abs())
    return torch.cat(diffs)


def _check_against_oracle(samples, hf_dir, tensors_or_dir, expect_quantized: int):
    oracle = load_hf(hf_dir)
    reference = load_hf(hf_dir)
    assert apply_fp8(oracle, tensors_or_dir) == expect_quantized
    fp8_diff, hp_diff = _differences(samples, oracle), _differences(samples, reference)
    print(f"vs FP8 oracle: mean {fp8_diff.mean():.2e} max {fp8_diff.max():.2e}; "
          f"vs fp32 model: mean {hp_diff.mean():.2e}")
    assert fp8_diff.mean() < MEAN_TOL and fp8_diff.max() < MAX_TOL
    # The comparison means something: FP8 moves logprobs far more than the tolerance.
    assert hp_diff.mean() > 10 * fp8_diff.mean() and hp_diff.mean() > 2 * MEAN_TOL


@pytest.mark.parametrize("family,scheme", [("qwen3", "tensor_static"), ("llama", "block")])
def test_fp8_checkpoint_matches_oracle(tiny_dirs, tmp_path, family, scheme):
    fp8_dir = _export(tiny_dirs[family], tmp_path / "fp8", scheme)
    engine = _engine(fp8_dir, scheme)
    try:
        samples = engine.generate(PROMPTS, SAMPLING, n=2)
    finally:
        engine.shutdown()
    _check_against_oracle(samples, tiny_dirs[family], fp8_dir, expect_quantized=2 * 7)


@pytest.fixture(scope="module")
def dynamic_engine(tiny_dirs, tmp_path_factory):
    fp8_dir = _export(tiny_dirs["qwen3"], tmp_path_factory.mktemp("fp8") / "dyn", "tensor_dynamic")
    engine = _engine(fp8_dir, "tensor_dynamic", bucket_mb=0.02)  # weight syncs in several calls
    yield engine, fp8_dir
    engine.shutdown()


def test_per_tensor_dynamic_matches_oracle(dynamic_engine, tiny_dirs):
    engine, fp8_dir = dynamic_engine
    samples = engine.generate(PROMPTS, SAMPLING, n=2)
    _check_against_oracle(samples, tiny_dirs["qwen3"], fp8_dir, expect_quantized=2 * 7)


def test_quantized_weight_sync_is_served(dynamic_engine, tiny_dirs):
    """New high-precision weights, quantized as a rollout.fp8=per_tensor sync sends them."""
    engine, _ = dynamic_engine
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    new_weights = random_state_dict(tiny_dirs["qwen3"], seed=11)
    sent = dict(rollout_tensors(new_weights.items(), num_layers=2, plan=plan_for(RolloutFp8.PER_TENSOR, "none")))
    assert sent["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert len(buckets(sent.items(), engine.bucket_bytes)) > 3
    engine.update_weights(sent.items(), version=3)
    after = engine.generate(PROMPTS, SAMPLING, n=2)
    assert all(s.weight_version == 3 for s in after)
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy)] != [s.token_ids for s in before]
    oracle = load_hf(tiny_dirs["qwen3"])
    load_state_dict(oracle, new_weights)
    assert apply_fp8(oracle, sent) == 2 * 7
    diff = _differences(after, oracle)
    print(f"after sync vs FP8 oracle: mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL


@pytest.mark.parametrize("bad,message", [
    (("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(128, 64, dtype=torch.float8_e4m3fn)), "not a parameter"),
    (("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32, dtype=torch.float8_e4m3fn)), "shape"),
    (("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64)), "dtype"),
    (("model.layers.0.self_attn.q_proj.weight_scale", torch.tensor(float("nan"))), "non-finite"),
])
def test_bad_fp8_update_is_refused_and_engine_keeps_serving(dynamic_engine, bad, message):
    engine, _ = dynamic_engine
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = [s.token_ids for s in engine.generate(PROMPTS, greedy)]
    version = engine.weight_version
    with pytest.raises(WeightUpdateError, match=message):
        engine.update_weights([bad], version=version + 1)
    assert engine.health() and engine.weight_version == version
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy)] == before
