"""FP8 weights into a disaggregated SGLang server on CPU (the real server, over HTTP on loopback):
each transfer (a gloo process group in several buckets; a safetensors snapshot on disk) carries a
per-tensor FP8 sync that the server then serves as the FP8 oracle computes it; bad tensors are
refused before any byte leaves; a server killed in the middle of a transfer gives a clear error and
a restarted one takes the next update.
One server process (+2 SGLang children) at a time, started twice (the kill test restarts it).
"""
import time

import pytest
import torch

from megatron_fp8rl.compat import sglang_cpu
from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
from megatron_fp8rl.rollout.engine import RolloutEngineError, SamplingParams, WeightUpdateError
from megatron_fp8rl.rollout.weight_transfer import buckets, flatten_bucket
from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors
from tests.helpers.fp8_reference import apply_fp8
from tests.helpers.hf_reference import load_state_dict, token_logprobs
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import load_hf, random_state_dict

pytestmark = needs_sglang
PROMPTS = [[5, 9, 17, 33], [40, 41, 7], [100, 3, 64, 12, 90]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
# As tests/rollout/test_sglang_fp8.py: same FP8 values on both sides, fp32 summation order apart.
MEAN_TOL = 1e-4
MAX_TOL = 5e-3


def test_flattened_bucket_is_what_sglang_reconstructs():
    """An odd-sized FP8 weight before its fp32 scale would sit at an unaligned offset, which
    SGLang's receiver refuses; the widest-first order it is sent in makes a layout SGLang's own
    FlattenedTensorBucket reads back bit for bit."""
    sglang_cpu.install()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = [("w", torch.randn(3, 5).to(torch.float8_e4m3fn)), ("w_scale", torch.tensor(0.25)),
              ("b", torch.randn(7, dtype=torch.bfloat16)), ("n", torch.randn(2, 3))]
    ordered, flat = flatten_bucket(bucket, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == 15 + 4 + 14 + 24
    received = FlattenedTensorBucket.empty([n for n, _ in ordered], [str(t.dtype).removeprefix("torch.") for _, t in ordered],
                                           [list(t.shape) for _, t in ordered], "cpu")
    received.get_flattened_tensor().copy_(flat)
    got = dict(received.reconstruct_tensors())
    assert sorted(got) == sorted(n for n, _ in bucket)
    for name, tensor in bucket:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def fp8_server(tiny_dirs, tmp_path_factory):
    from megatron_fp8rl.rollout.sglang_server import SGLangServer

    fp8_dir = tmp_path_factory.mktemp("fp8") / "dynamic"
    export_fp8(tiny_dirs["qwen3"], fp8_dir, Fp8ExportOptions(scheme="tensor"), progress=False)
    server = SGLangServer(sglang_config(fp8_dir, fp8="per_tensor"), weight_transfer="distributed",
                          bucket_mb=0.02)
    yield server
    server.close()


def _fp8_sync(tiny_dirs, seed: int) -> tuple[dict, dict]:
    """New high-precision weights and the FP8 tensors a rollout.fp8=per_tensor sync sends for them."""
    weights = random_state_dict(tiny_dirs["qwen3"], seed=seed)
    return weights, dict(rollout_tensors(weights.items(), num_layers=2, plan=plan_for(RolloutFp8.PER_TENSOR, "none")))


def _check_served(server, tiny_dirs, weights: dict, sent: dict, version: int) -> None:
    samples = server.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=2)
    assert all(s.weight_version == version for s in samples)
    oracle = load_hf(tiny_dirs["qwen3"])
    load_state_dict(oracle, weights)
    assert apply_fp8(oracle, sent) == 2 * 7
    diff = torch.cat([(torch.tensor(s.logprobs) - token_logprobs(oracle, s.prompt_token_ids, s.token_ids)).abs()
                      for s in samples])
    print(f"v{version} ({server.weight_transfer}) vs FP8 oracle: mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("transfer,seed", [("distributed", 21), ("disk", 22)])
def test_fp8_sync_is_served_after_each_transfer(fp8_server, tiny_dirs, transfer, seed):
    fp8_server.weight_transfer = transfer
    weights, sent = _fp8_sync(tiny_dirs, seed)
    assert sent["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert len(buckets(sent.items(), fp8_server.bucket_bytes)) > 3  # disk: as many shard files
    before = [s.token_ids for s in fp8_server.generate(PROMPTS, GREEDY)]
    fp8_server.update_weights(sent.items(), version=seed)
    assert not list(fp8_server.update_dir.glob("*/*.safetensors"))  # the shards are gone
    assert [s.token_ids for s in fp8_server.generate(PROMPTS, GREEDY)] != before
    _check_served(fp8_server, tiny_dirs, weights, sent, seed)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("bad,message", [
    (("model.layers.1.self_attn.qkv_proj.weight", torch.zeros(128, 64, dtype=torch.float8_e4m3fn)),
     r"'model.layers.1.self_attn.qkv_proj.weight' is not a parameter"),
    (("model.layers.1.mlp.down_proj.weight_scale", torch.ones(64)),
     r"'model.layers.1.mlp.down_proj.weight_scale' has shape \(64,\), expected \(\)"),
    (("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 128)),
     r"'model.layers.1.mlp.down_proj.weight' has dtype torch.float32, expected one of \(torch.float8_e4m3fn,\)"),
])
@pytest.mark.parametrize("transfer", ["distributed", "disk"])
def test_bad_tensor_is_refused_before_any_byte_is_sent(fp8_server, tiny_dirs, bad, message, transfer):
    """The bad tensor comes last, after a whole valid FP8 sync: nothing of it may reach the server."""
    fp8_server.weight_transfer = transfer
    _, sent = _fp8_sync(tiny_dirs, seed=31)
    before = [s.token_ids for s in fp8_server.generate(PROMPTS, GREEDY)]
    version = fp8_server.weight_version
    with pytest.raises(WeightUpdateError, match=message):
        fp8_server.update_weights([*(item for item in sent.items() if item[0] != bad[0]), bad], version=version + 1)
    assert fp8_server.weight_version == version
    served = fp8_server.generate(PROMPTS, GREEDY)
    assert [s.token_ids for s in served] == before and all(s.weight_version == version for s in served)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_server_killed_mid_transfer_is_a_clear_error_and_a_restart_takes_the_next(fp8_server, tiny_dirs,
                                                                                   monkeypatch):
    """The server is SIGKILLed when the trainer posts the third bucket, while it broadcasts it."""
    fp8_server.weight_transfer = "distributed"
    weights, sent = _fp8_sync(tiny_dirs, seed=41)
    version = fp8_server.weight_version
    real_post, posted = fp8_server._post, []

    def post_then_die(path, payload, timeout_s=None):
        posted.append(path)
        if posted.count("/update_weights_from_distributed") == 3:
            fp8_server.kill()
        return real_post(path, payload, timeout_s)

    monkeypatch.setattr(fp8_server, "_post", post_then_die)
    if fp8_server._sender is not None:  # a group formed by an earlier test holds the old callable
        monkeypatch.setattr(fp8_server._sender, "post", post_then_die)
    start = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"bucket 3 \(.*/update_weights_from_distributed: the server process \(pid \d+\) died"):
        fp8_server.update_weights(sent.items(), version=version + 1)
    print(f"error after {time.monotonic() - start:.1f} s")
    assert time.monotonic() - start < 60
    assert fp8_server.weight_version == version and fp8_server._sender is None
    monkeypatch.undo()
    fp8_server.start()
    fp8_server.update_weights(sent.items(), version=version + 2)
    _check_served(fp8_server, tiny_dirs, weights, sent, version + 2)
