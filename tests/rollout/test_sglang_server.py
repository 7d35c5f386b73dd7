"""SGLang as a server subprocess behind the HTTP client, on CPU with the real SGLang.
The slow tests share one server (a tiny Llama; 1 server process + 2 SGLang children)."""
import os
import socket
import threading
import time

import psutil
import pytest
import torch

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.rollout.engine import RolloutEngineError, SamplingParams, WeightUpdateError
from megatron_fp8rl.rollout.sglang_server import PortTakenError, SGLangServer
from tests.helpers import hf_reference as hf
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_hf, random_state_dict

pytestmark = needs_sglang
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]
LOGPROB_ATOL = 1e-4


def test_port_in_use_is_a_clear_error(tiny_dirs):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(RolloutEngineError, match=rf"port 127\.0\.0\.1:{port} is already in use"):
            SGLangServer(sglang_config(tiny_dirs["llama"]), port=port)
        assert time.monotonic() - started < 5


def _take_port_of_first_server(holder: socket.socket, taken: list[int]) -> threading.Thread:
    """A thread that waits for this process's first SGLang server child and binds its --port on
    `holder` before the server does (its start-up takes seconds): the race another process can win."""
    def take():
        while True:
            for child in psutil.Process().children():
                try:
                    argv = child.cmdline()
                except psutil.Error:
                    continue
                if "megatron_fp8rl.rollout.sglang_launch" in argv:
                    taken.append(int(argv[argv.index("--port") + 1]))
                    holder.bind(("127.0.0.1", taken[0]))
                    holder.listen()
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


@pytest.mark.multiprocess
def test_port_taken_during_start_up_is_a_clear_error_within_seconds(tiny_dirs):
    """1 server process, killed as soon as another process listens on its port (before this fix
    it stayed up without serving until the start-up timeout: 600 s by default)."""
    port, taken = free_port(), []
    with socket.socket() as holder:
        _take_port_of_first_server(holder, taken)
        started = time.monotonic()
        with pytest.raises(PortTakenError, match=rf"port 127\.0\.0\.1:{port} of the starting SGLang server "
                                                 rf"was taken by pid {os.getpid()} \(python"):
            SGLangServer(sglang_config(tiny_dirs["llama"]), port=port, startup_timeout_s=120)
        assert time.monotonic() - started < 30
    assert taken == [port]
    assert not [c for c in psutil.Process().children() if "sglang_launch" in " ".join(c.cmdline())]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_port_lost_during_start_up_is_retried_on_a_fresh_port(tiny_dirs):
    """2 server starts (the first stopped when its port is taken) + 2 SGLang children."""
    taken = []
    with socket.socket() as holder:
        _take_port_of_first_server(holder, taken)
        with SGLangServer(sglang_config(tiny_dirs["llama"]), startup_timeout_s=300) as server:
            assert server.port != taken[0]
            assert server.health()


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(RolloutEngineError, match=f"{tmp_path / 'nope'} does not exist"):
        SGLangServer(sglang_config(tmp_path / "nope"))


def test_cpu_scheduler_outlasts_a_slow_forward_batch():
    """SGLang's watchdog kills the scheduler when one forward batch passes watchdog_timeout (300 s
    by default): on a loaded 2-core box the demo's first eval batch did. SGLang's own argument
    parser must read our CPU servers' timeout back."""
    import argparse

    from megatron_fp8rl.compat import sglang_cpu
    from megatron_fp8rl.rollout.sglang_common import CPU_WATCHDOG_TIMEOUT_S, SGLangConfig, server_argv

    sglang_cpu.install()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = server_argv(SGLangConfig(model_path="unused", device="cpu"), "127.0.0.1", 1)
    assert parser.parse_args(argv).watchdog_timeout == CPU_WATCHDOG_TIMEOUT_S >= 1800


@pytest.mark.slow
def test_unloadable_model_directory_reports_the_server_log(tiny_dirs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_dirs["llama"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(RolloutEngineError, match=r"(?s)exited with code .* during start-up.*SafetensorError"):
        SGLangServer(sglang_config(broken), startup_timeout_s=600)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    srv = SGLangServer(sglang_config(tiny_dirs["llama"]))
    yield srv
    srv.close()


@pytest.mark.slow
def test_server_greedy_and_logprobs_equal_transformers(server, tiny_dirs):
    model = load_hf(tiny_dirs["llama"])
    for sample, prompt in zip(server.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10)), PROMPTS):
        assert sample.token_ids == hf.greedy(model, prompt, 10, EOS_TOKEN_ID)
        want = hf.token_logprobs(model, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=LOGPROB_ATOL, rtol=0)
        assert sample.weight_version == 0


@pytest.mark.slow
def test_server_update_from_disk_bumps_version_and_refuses_bad_names(server, tiny_dirs):
    new_weights = random_state_dict(tiny_dirs["llama"], seed=3)
    with pytest.raises(WeightUpdateError, match="gate_up_proj.weight' is not a parameter"):
        server.update_weights([("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(256, 64))], version=5)
    server.update_weights(new_weights.items(), version=2)
    model = load_hf(tiny_dirs["llama"])
    hf.load_state_dict(model, new_weights)
    for sample, prompt in zip(server.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10)), PROMPTS):
        assert sample.token_ids == hf.greedy(model, prompt, 10, EOS_TOKEN_ID)
        assert sample.weight_version == 2


@pytest.mark.slow
def test_server_killed_mid_request_is_a_clear_error_and_restart_works(server):
    killer = threading.Timer(0.5, server.kill)
    killer.start()
    started = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"server process \(pid \d+\) died with code -9"):
        server.generate([[5, 6, 7]] * 16, SamplingParams(temperature=1.0, max_new_tokens=200), n=4)
    killer.join()
    assert time.monotonic() - started < 60
    assert not server.health()
    server.start()
    assert server.health()
    assert server.weight_version == 0  # a restarted server serves the checkpoint on disk again
    assert len(server.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))) == 2
