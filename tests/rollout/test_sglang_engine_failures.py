"""In-process SGLang engines that fail, and the Llama family; each test starts its own engine
(scheduler + detokenizer: 2 child processes), so all are slow on a 2-core box."""
import time

import psutil
import pytest
import torch

from megatron_fp8rl.rollout.engine import RolloutEngineError, SamplingParams
from megatron_fp8rl.rollout.sglang_engine import SGLangEngine
from tests.helpers import hf_reference as hf
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_hf

pytestmark = [needs_sglang, pytest.mark.slow]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def test_llama_greedy_and_logprobs_equal_transformers(tiny_dirs):
    model = load_hf(tiny_dirs["llama"])
    with SGLangEngine(sglang_config(tiny_dirs["llama"])) as engine:
        samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    for sample, prompt in zip(samples, PROMPTS):
        assert sample.token_ids == hf.greedy(model, prompt, 12, EOS_TOKEN_ID)
        want = hf.token_logprobs(model, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=1e-4, rtol=0)


def test_unloadable_model_directory_is_a_clear_error_and_leaves_no_children(tiny_dirs, tmp_path):
    for f in tiny_dirs["qwen3"].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RolloutEngineError, match=f"SGLang could not start on model directory {tmp_path}"):
        SGLangEngine(sglang_config(tmp_path))
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_child_crash_is_contained_to_a_clear_error(tiny_dirs):
    """A scheduler or detokenizer that dies (here: SIGKILLed) makes stock SGLang kill the host
    process; here the pending call and later ones raise RolloutEngineError instead."""
    engine = SGLangEngine(sglang_config(tiny_dirs["qwen3"]))
    try:
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
        for pid in engine._child_pids:
            psutil.Process(pid).kill()
        started = time.monotonic()
        with pytest.raises(RolloutEngineError, match="engine (died|is dead)"):
            engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=200))
        assert time.monotonic() - started < 60
        assert not engine.health()
        with pytest.raises(RolloutEngineError, match="engine is dead"):
            engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
    finally:
        engine.shutdown()


def test_start_retries_when_another_process_takes_the_scheduler_port(tiny_dirs, monkeypatch):
    """The parent picks the scheduler's torch.distributed port; when another process holds it by
    the time the scheduler binds it (the race behind a start-up flake seen in CI), the scheduler
    dies during initialization and start-up retries with a fresh port."""
    import socket

    from megatron_fp8rl.compat import sglang_cpu

    sglang_cpu.install()  # before sglang's first import in this process (CPU mode is import-time)
    import sglang.srt.server_args as server_args

    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    picked = []
    real = server_args.get_free_port_below_ephemeral

    def first_one_taken(*args, **kwargs):
        port = taken if not picked else real(*args, **kwargs)
        picked.append(port)
        return port

    monkeypatch.setattr(server_args, "get_free_port_below_ephemeral", first_one_taken)
    try:
        with SGLangEngine(sglang_config(tiny_dirs["qwen3"])) as engine:
            samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
    finally:
        holder.close()
    assert picked[0] == taken and len(picked) == 2
    assert all(len(s.token_ids) == 4 for s in samples)
