"""The in-process SGLang engine against transformers, on CPU with the real SGLang (one engine start
for the module, a tiny Qwen3; its scheduler and detokenizer are 2 child processes)."""
import weakref

import pytest
import torch

from megatron_fp8rl.rollout.engine import SamplingParams, WeightUpdateError
from megatron_fp8rl.rollout.sglang_engine import SGLangEngine
from megatron_fp8rl.rollout.weight_transfer import RowChunk, transfer_parts
from megatron_fp8rl.rollout.weights import WeightSnapshot
from tests.helpers import hf_reference as hf
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_hf, random_state_dict

pytestmark = [needs_sglang, pytest.mark.multiprocess]
PROMPTS = [[5, 6, 7], [9, 10], [3, 40, 41, 42, 43]]
# fp32 on both sides; differences come only from summation order (SGLang's torch_native attention
# and fused qkv/gate_up GEMMs vs HF's separate ones).
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def qwen3_dir(tiny_dirs):
    return tiny_dirs["qwen3"]


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    eng = SGLangEngine(sglang_config(qwen3_dir))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    return load_hf(qwen3_dir)


def _check_greedy_matches(engine, model, version):
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    for sample, prompt in zip(samples, PROMPTS):
        assert sample.token_ids == hf.greedy(model, prompt, 12, EOS_TOKEN_ID), f"prompt {prompt}"
        assert sample.weight_version == version
        assert sample.finish_reason == ("stop" if sample.token_ids[-1] == EOS_TOKEN_ID else "length")


def test_greedy_equals_transformers_and_logprobs_match(engine, hf_model):
    _check_greedy_matches(engine, hf_model, version=0)
    for sample in engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12)):
        want = hf.token_logprobs(hf_model, sample.prompt_token_ids, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=LOGPROB_ATOL, rtol=0)


def test_sampled_logprobs_are_temperature_one(engine, hf_model):
    """At temperature 0.5 SGLang would report log softmax(logits / 0.5) unless
    SGLANG_RETURN_ORIGINAL_LOGPROB is set (docs/design.md hazard 1); the policy's logprobs are at T=1."""
    samples = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.5, max_new_tokens=8), n=3)
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    for sample in samples:
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        want = hf.token_logprobs(hf_model, sample.prompt_token_ids, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=LOGPROB_ATOL, rtol=0)


def test_stop_token_ends_the_sample(engine, hf_model):
    free_run = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12))[0].token_ids
    stop = free_run[3]
    sample = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))[0]
    assert sample.token_ids == free_run[: free_run.index(stop) + 1]
    assert sample.finish_reason == "stop"


@pytest.mark.parametrize(
    "bad, message",
    [
        (("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(128, 64)), "qkv_proj.weight' is not a parameter"),
        (("model.layers.1.mlp.down_proj.weight", torch.zeros(128, 64)), r"shape \(128, 64\), expected \(64, 128\)"),
    ],
)
def test_bad_update_is_refused_and_engine_keeps_old_weights(engine, hf_model, qwen3_dir, bad, message):
    before = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    good = list(random_state_dict(qwen3_dir, seed=7).items())[:3]
    with pytest.raises(WeightUpdateError, match=message):
        engine.update_weights(good + [bad], version=99)
    assert engine.health()
    after = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    assert [s.token_ids for s in after] == [s.token_ids for s in before]
    assert {s.weight_version for s in after} == {before[0].weight_version}


def test_update_weights_then_greedy_equals_transformers_with_new_weights(engine, hf_model, qwen3_dir):
    new_weights = random_state_dict(qwen3_dir, seed=11)
    engine.update_weights(new_weights.items(), version=1)
    hf.load_state_dict(hf_model, new_weights)
    _check_greedy_matches(engine, hf_model, version=1)
    assert engine.weight_version == 1


def test_vocab_tensors_larger_than_a_bucket_go_in_row_chunks(engine, hf_model, qwen3_dir, monkeypatch):
    """With a 10 KiB bucket the 32 KiB embedding and lm_head each go as 4 row chunks (40 + 40 + 40 +
    8 rows) through sglang_rows.load_vocab_rows; the served model then equals transformers with
    the new weights, greedy tokens and logprobs."""
    new_weights = random_state_dict(qwen3_dir, seed=13)
    monkeypatch.setattr(engine, "bucket_bytes", 40 * 64 * 4)  # 40 rows
    chunks = [part for part in transfer_parts(new_weights.items(), engine.bucket_bytes) if isinstance(part, RowChunk)]
    assert sorted((c.name, c.start, len(c.rows)) for c in chunks) == sorted(
        (name, start, min(40, 128 - start)) for name in ("lm_head.weight", "model.embed_tokens.weight")
        for start in range(0, 128, 40))
    engine.update_weights(new_weights.items(), version=2)
    hf.load_state_dict(hf_model, new_weights)
    _check_greedy_matches(engine, hf_model, version=2)
    for sample in engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=8)):
        want = hf.token_logprobs(hf_model, sample.prompt_token_ids, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=LOGPROB_ATOL, rtol=0)


def test_cpu_syncs_reuse_one_kept_host_bucket_and_serve_each_syncs_weights(engine, hf_model, qwen3_dir):
    """The shared-memory bucket outlives a sync (allocating and unmapping it was most of a SmolLM2
    sync): the second sync allocates nothing, and what it serves is its own weights, not bytes
    left from the first."""
    allocations = []
    for seed, version in ((17, 5), (19, 6)):
        new_weights = random_state_dict(qwen3_dir, seed=seed)
        engine.update_weights(new_weights.items(), version=version)
        allocations.append(engine.buffer.allocations)
        hf.load_state_dict(hf_model, new_weights)
        _check_greedy_matches(engine, hf_model, version=version)
    assert engine.buffer.nbytes > 0 and allocations[1] == allocations[0]


def test_streamed_snapshot_is_sent_bucket_by_bucket_holding_a_few_buckets(engine, hf_model, qwen3_dir, monkeypatch):
    """A WeightSnapshot (what every sync of the actor is) goes out as its stream fills buckets: at
    most a few buckets of its tensors are alive at once (the rest not yet made or already
    dropped), where a held update keeps all of them; the served model then equals transformers
    with the new weights."""
    new_weights = random_state_dict(qwen3_dir, seed=23)
    bucket = 40 * 2**10
    monkeypatch.setattr(engine, "bucket_bytes", bucket)
    alive, most = {}, [0]

    def stream():  # each tensor made anew, as a gather makes it
        for name, tensor in new_weights.items():
            made = tensor.clone()
            alive[name] = made.numel() * made.element_size()
            weakref.finalize(made, alive.pop, name)
            most[0] = max(most[0], sum(alive.values()))
            yield name, made

    layout = [(n, tuple(t.shape), t.dtype) for n, t in new_weights.items()]
    engine.update_weights(WeightSnapshot(stream(), layout), version=7)
    sizes = [t.numel() * t.element_size() for t in new_weights.values()]
    # the bucket being sent, the next one (made before, to learn whether this is the last), the
    # one being filled, and the tensor that overflowed it: 155 KiB here, of 354 KiB
    bound = 3 * bucket + max(sizes)
    assert 0 < most[0] <= bound < sum(sizes), (most[0], bound, sum(sizes))
    hf.load_state_dict(hf_model, new_weights)
    _check_greedy_matches(engine, hf_model, version=7)


def test_release_and_resume_are_no_ops_on_cpu(engine):
    engine.release_memory()
    engine.resume_memory()
    assert engine.health()


def test_idle_engine_leaves_the_cpu_to_the_trainer(engine):
    """Colocated on CPU the trainer computes while SGLang idles: an idle scheduler must sleep,
    not busy-poll its sockets on a whole core (SGLang's default; sleep_on_idle turns it off)."""
    import time

    import psutil

    engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=2))
    children = [psutil.Process(pid) for pid in engine._child_pids]
    time.sleep(1.0)  # let the scheduler reach its idle loop
    before = [sum(p.cpu_times()[:2]) for p in children]
    started = time.monotonic()
    time.sleep(3.0)
    elapsed = time.monotonic() - started
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(children, before)]
    # busy-polling costs ~1 CPU-second per second; sleeping costs a few milliseconds
    assert max(used) < 0.25 * elapsed, f"idle SGLang children used {used} CPU-seconds in {elapsed:.1f} s"


def test_memory_release_and_resume_through_sglangs_api(engine, hf_model):
    """Colocated mode's protocol on CPU (SGLang frees nothing here: torch_memory_saver is CUDA-only,
    and SGLangConfig refuses memory_saver on CPU): released, the engine refuses to generate or take
    weights; weights resumed, a sync lands; all resumed, it serves what transformers computes."""
    from megatron_fp8rl.rollout.engine import RolloutEngineError
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig

    with pytest.raises(ValueError, match="memory_saver: torch_memory_saver frees CUDA memory only"):
        SGLangConfig(model_path="unused", device="cpu", memory_saver=True)
    engine.release_memory()
    with pytest.raises(RolloutEngineError, match="generate: SGLang's cuda_graph, kv_cache, weights memory is released"):
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
    state = {name: tensor for name, tensor in hf_model.state_dict().items() if name in engine.expected.shapes}
    with pytest.raises(RolloutEngineError, match="update_weights: SGLang's weights memory is released"):
        engine.update_weights(state.items(), version=7)
    engine.resume_memory(["weights"])
    engine.update_weights(state.items(), version=7)
    engine.resume_memory()
    _check_greedy_matches(engine, hf_model, version=7)
