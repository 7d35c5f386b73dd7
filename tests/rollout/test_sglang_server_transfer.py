"""Disaggregated rollout pieces on CPU with the real SGLang server: weights sent over a gloo process
group (/update_weights_from_distributed) in several buckets, a server reached by URL, and seeded
sampling that reproduces across server restarts (deterministic inference with the CPU shims).
One server process (+2 SGLang children) at a time; the URL test starts a second client only."""
import pytest
import torch

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.rollout.engine import RolloutEngineError, SamplingParams, WeightUpdateError
from megatron_fp8rl.rollout.sglang_server import SGLangServer
from megatron_fp8rl.rollout.weight_transfer import BucketBuffer, RowChunk, buckets, flatten_bucket, transfer_parts
from tests.helpers import hf_reference as hf
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_hf, random_state_dict

pytestmark = needs_sglang
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def test_buckets_bound_their_size_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 30, 5, 100, 1, 1])]
    parts = buckets(tensors, bucket_bytes=40 * 4)
    assert [name for part in parts for name, _ in part] == [name for name, _ in tensors]
    assert [[name for name, _ in part] for part in parts] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]


def test_transfer_parts_split_only_vocab_tensors_larger_than_a_bucket():
    tensors = [("model.embed_tokens.weight", torch.arange(50.0).reshape(10, 5)),
               ("model.layers.0.mlp.up_proj.weight", torch.zeros(10, 5)), ("model.norm.weight", torch.zeros(5)),
               ("lm_head.weight", torch.zeros(2, 5))]
    parts = transfer_parts(tensors, bucket_bytes=3 * 5 * 4)  # three rows
    chunks = [part for part in parts if isinstance(part, RowChunk)]
    assert [(c.name, c.start, len(c.rows)) for c in chunks] == [("model.embed_tokens.weight", s, min(3, 10 - s))
                                                                 for s in (0, 3, 6, 9)]
    assert torch.equal(torch.cat([c.rows for c in chunks]), tensors[0][1])
    # a non-vocabulary tensor above a bucket goes alone, whole; small ones share buckets in order
    assert [[n for n, _ in part] for part in parts[4:]] == [
        ["model.layers.0.mlp.up_proj.weight"], ["model.norm.weight", "lm_head.weight"]]


def test_bucket_buffer_is_reused_and_grows():
    buffer = BucketBuffer(torch.device("cpu"), shared=True)
    first = buffer.take(100)
    assert first.is_shared() and buffer.nbytes == 100
    assert buffer.take(60).data_ptr() == first.data_ptr()  # the same memory, not a new segment
    ordered, flat = flatten_bucket([("a", torch.ones(3, dtype=torch.float8_e4m3fn)), ("b", torch.full((2,), 2.0))],
                                   torch.device("cpu"), buffer)
    assert [n for n, _ in ordered] == ["b", "a"] and flat.data_ptr() == first.data_ptr()
    assert torch.equal(flat[:8].view(torch.float32), torch.full((2,), 2.0))
    assert buffer.take(200).numel() == 200 and buffer.nbytes == 200
    buffer.release()
    assert buffer.nbytes == 0


def test_unanswered_server_url_is_a_clear_error(tiny_dirs):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutEngineError, match=f"rollout.server_url={url}: no SGLang server answers"):
        SGLangServer(sglang_config(tiny_dirs["llama"]), url=url)
    with pytest.raises(RolloutEngineError, match="expected http://HOST:PORT"):
        SGLangServer(sglang_config(tiny_dirs["llama"]), url="127.0.0.1")


@pytest.fixture(scope="module")
def server(tiny_dirs):
    srv = SGLangServer(sglang_config(tiny_dirs["llama"], deterministic=True),
                       weight_transfer="distributed", bucket_mb=0.05)
    yield srv
    srv.close()


@pytest.mark.slow
def test_seeded_sampling_reproduces_across_restarts(server):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    first = server.generate(PROMPTS, sampling, n=4)
    again = server.generate(PROMPTS, sampling, n=4)
    other = server.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=12), n=4)
    server.start()
    restarted = server.generate(PROMPTS, sampling, n=4)
    tokens = lambda samples: [s.token_ids for s in samples]  # noqa: E731
    assert tokens(first) == tokens(again) == tokens(restarted)
    assert [s.logprobs for s in first] == [s.logprobs for s in restarted]
    assert tokens(first) != tokens(other)
    assert len({tuple(s.token_ids) for s in first[:4]}) > 1  # the n samples of a prompt differ


@pytest.mark.slow
def test_distributed_update_in_buckets_matches_transformers(server, tiny_dirs):
    new_weights = random_state_dict(tiny_dirs["llama"], seed=5)
    assert len(buckets(new_weights.items(), server.bucket_bytes)) > 3
    with pytest.raises(WeightUpdateError, match="has shape"):
        server.update_weights([("model.norm.weight", torch.ones(3))], version=9)
    server.update_weights(new_weights.items(), version=3)
    model = load_hf(tiny_dirs["llama"])
    hf.load_state_dict(model, new_weights)
    for sample, prompt in zip(server.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10)), PROMPTS):
        assert sample.token_ids == hf.greedy(model, prompt, 10, EOS_TOKEN_ID)
        torch.testing.assert_close(torch.tensor(sample.logprobs), hf.token_logprobs(model, prompt, sample.token_ids),
                                   atol=1e-4, rtol=0)
        assert sample.weight_version == 3
    # a second update reuses the group and the host bucket buffer, and serves its own weights
    allocations = server._sender.buffer.allocations
    second = random_state_dict(tiny_dirs["llama"], seed=6)
    server.update_weights(second.items(), version=4)
    assert server._sender.buffer.allocations == allocations and server._sender.buffer.nbytes > 0
    hf.load_state_dict(model, second)
    for sample, prompt in zip(server.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10)), PROMPTS):
        assert sample.token_ids == hf.greedy(model, prompt, 10, EOS_TOKEN_ID)
        assert sample.weight_version == 4


@pytest.mark.slow
def test_client_by_url_generates_and_leaves_the_server_running(server, tiny_dirs):
    client = SGLangServer(sglang_config(tiny_dirs["llama"]), url=server.url, weight_transfer="disk")
    assert client.weight_version == server.weight_version
    ours = client.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    assert [s.token_ids for s in ours] == [s.token_ids for s in server.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))]
    client.close()
    assert server.health()
