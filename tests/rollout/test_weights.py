"""Weight-update validation against a checkpoint's safetensors headers (no SGLang needed)."""
import pytest
import torch

from megatron_fp8rl.rollout.engine import WeightUpdateError
from megatron_fp8rl.rollout import weights
from megatron_fp8rl.rollout.weights import ExpectedWeights, validate_named_tensors
from tests.helpers.tiny_models import build_tiny_model, load_hf


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_expected_names_and_shapes_equal_the_hf_state_dict(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    hf = {name: tuple(t.shape) for name, t in load_hf(qwen3_dir).state_dict().items()}
    assert expected.shapes == hf


def test_full_and_partial_updates_pass(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    state = load_hf(qwen3_dir).state_dict()
    assert len(validate_named_tensors(state.items(), expected)) == len(state)
    assert len(validate_named_tensors([("lm_head.weight", state["lm_head.weight"])], expected)) == 1


def test_fused_name_is_refused_and_points_at_its_shards(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    with pytest.raises(WeightUpdateError, match=r"'model.layers.0.self_attn.qkv_proj.weight' is not a parameter") as err:
        validate_named_tensors([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(128, 64))], expected)
    assert "model.layers.0.self_attn." in str(err.value).split("e.g.")[1]


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.zeros(64, 128), r"shape \(64, 128\), expected \(128, 64\)"),
        (torch.zeros(128, 64, dtype=torch.int32), "dtype torch.int32"),
        (torch.full((128, 64), float("nan")), "non-finite"),
        (torch.zeros(128, 64).index_fill_(0, torch.tensor([3]), float("inf")), "non-finite"),
        (torch.zeros(128, 64).index_put_((torch.tensor([0, 1]), torch.tensor([0, 0])),
                                         torch.tensor([float("inf"), -float("inf")])), "non-finite"),
    ],
)
def test_bad_tensor_is_refused_naming_it(qwen3_dir, tensor, message):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    with pytest.raises(WeightUpdateError, match=rf"'lm_head.weight'.*{message}"):
        validate_named_tensors([("lm_head.weight", tensor)], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_value_in_the_last_chunk_is_found(qwen3_dir, monkeypatch, dtype):
    """The finite check sums in chunks (bounded upcast memory); a NaN in the last, partial chunk
    of a tensor counts as much as one in the first."""
    monkeypatch.setattr(weights, "FINITE_CHUNK", 1000)
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    tensor = torch.zeros(128, 64, dtype=dtype)
    tensor[-1, -1] = float("nan")
    with pytest.raises(WeightUpdateError, match="'lm_head.weight' has non-finite values"):
        validate_named_tensors([("lm_head.weight", tensor)], expected)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_finite_check_agrees_with_ml_dtypes_on_every_code(monkeypatch, dtype):
    """The FP8 check reads bits, not values: each of the 256 codes, alone in the last chunk of
    a tensor, is judged as ml_dtypes' own float8 type judges it (E4M3FN: 2 NaN codes; E5M2: 6
    NaN and 2 inf codes)."""
    import ml_dtypes
    import numpy as np

    monkeypatch.setattr(weights, "FINITE_CHUNK", 1000)
    oracle = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}[dtype]
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(codes.view(oracle).astype(np.float32))
    assert (~finite).sum() == (2 if dtype == torch.float8_e4m3fn else 8)
    for code in range(256):
        tensor = torch.zeros(2500, dtype=torch.uint8)
        tensor[-1] = code
        assert weights._all_finite(tensor.view(dtype)) == bool(finite[code]), f"code {code:#04x}"


def test_finite_values_whose_sum_overflows_are_accepted(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    huge = torch.full((128, 64), 3e38)  # finite, but their float32 sum is inf
    assert len(validate_named_tensors([("lm_head.weight", huge)], expected)) == 1


def test_duplicate_and_empty_updates_are_refused(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    weight = torch.zeros(128, 64)
    with pytest.raises(WeightUpdateError, match="given twice"):
        validate_named_tensors([("lm_head.weight", weight), ("lm_head.weight", weight)], expected)
    with pytest.raises(WeightUpdateError, match="no tensors"):
        validate_named_tensors([], expected)


def test_folder_without_safetensors_is_refused(tmp_path):
    with pytest.raises(WeightUpdateError, match=str(tmp_path)):
        ExpectedWeights.from_checkpoint(tmp_path)


def _snapshot(state, made, layout=None, swap=None):
    """A WeightSnapshot over `state` whose stream records in `made` each name it makes (a clone,
    as a gather makes each tensor anew); `swap`: (name, tensor) streamed in that name's place."""
    def stream():
        for name, tensor in state.items():
            made.append(name)
            yield (swap if swap and swap[0] == name else (name, tensor.clone()))
    return weights.WeightSnapshot(stream(), layout or [(n, tuple(t.shape), t.dtype) for n, t in state.items()])


def test_snapshot_layout_is_refused_before_any_tensor_is_made(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    state = load_hf(qwen3_dir).state_dict()
    made = []
    layout = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    layout[-1] = ("model.layers.0.self_attn.qkv_proj.weight", (128, 64), torch.float32)
    with pytest.raises(WeightUpdateError, match="qkv_proj.weight' is not a parameter"):
        weights.validated_stream(_snapshot(state, made, layout), expected)
    assert made == []  # refused from the layout alone: the stream was never started


def test_snapshot_streams_lazily_and_checks_each_tensor_against_its_layout(qwen3_dir):
    expected = ExpectedWeights.from_checkpoint(qwen3_dir)
    state = load_hf(qwen3_dir).state_dict()
    made = []
    stream = iter(weights.validated_stream(_snapshot(state, made), expected))
    first = next(stream)
    assert made == [first[0]] and torch.equal(first[1], state[first[0]])  # one made, not the model
    assert len(list(stream)) == len(state) - 1
    name = "model.layers.1.mlp.down_proj.weight"
    diverged = _snapshot(state, [], swap=(name, torch.zeros(3, 3)))
    with pytest.raises(WeightUpdateError, match=r"down_proj.weight' \(3, 3\).*its layout said.*partly updated"):
        list(weights.validated_stream(diverged, expected))
    bad = state[name].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(WeightUpdateError, match=f"{name}' has non-finite values; the served weights are partly"):
        list(weights.validated_stream(_snapshot(state, [], swap=(name, bad)), expected))
    short = weights.WeightSnapshot(iter(list(state.items())[:2]), [(n, tuple(t.shape), t.dtype) for n, t in state.items()])
    with pytest.raises(WeightUpdateError, match=f"ended after 2 of the {len(state)} tensors"):
        list(weights.validated_stream(short, expected))
