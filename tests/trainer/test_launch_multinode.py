"""examples/launch_multinode.sh as two torchrun agents on 127.0.0.1 (NNODES=2, NODE_RANK 0 and 1,
c10d rendezvous hosted by node 0), one trainer process each: a short RL run on a tiny random Llama
with TP=2 spanning the two "nodes" (colocated SGLang engine beside global rank 0), and one with
DP=2 whose rollouts come from a disaggregated SGLang server started beforehand, as on a rollout
node, and fed over a gloo weight-update group (rollout.weight_transfer=distributed).

Processes per test: 2 torchrun agents + 2 trainer workers, plus SGLang (TP=2 run: an in-process
engine with 2 children on global rank 0; DP=2 run: 1 server process + 2 children, started here).
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import requests

from megatron_fp8rl.compat.tcp_store import free_port
from tests.helpers.processes import REPO, kill_marked
from tests.helpers.rollout import needs_sglang, sglang_config
from tests.helpers.tiny_models import held_out_prompts
from tests.helpers.train import tb_scalars

SCRIPT = REPO / "examples" / "launch_multinode.sh"
pytestmark = [needs_sglang, pytest.mark.multiprocess, pytest.mark.slow]


def _launch_two_nodes(inputs, run_dir: Path, *overrides: str, timeout: float = 900) -> dict:
    """Both agents of examples/launch_multinode.sh, node 1 first (it must wait for the host);
    asserts both exit 0 and exactly one of them (global rank 0's) prints the run summary."""
    model, prompts = inputs
    marker = uuid.uuid4().hex
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGATRON_FP8RL_TEST_RUN=marker,
               HEAD_NODE="127.0.0.1", NNODES="2", GPUS_PER_NODE="1", RDZV_PORT=str(free_port()),
               RDZV_ID=marker)
    args = [f"model.hf_path={model}", f"data.train={prompts}", f"data.eval={held_out_prompts(prompts)}",
            "data.eval_size=8", "data.reward=tests.trainer.reward_fns:first_word_even",
            "train.steps=2", "rollout.n_samples=4", "data.prompts_per_step=2",
            "rollout.max_new_tokens=6", "train.micro_batch_size=4", "train.eval_every=2",
            "train.lr=1e-3", f"run_dir={run_dir}", *overrides]
    logs, agents = {rank: tempfile.TemporaryFile(mode="w+") for rank in (1, 0)}, {}
    try:
        for rank, log in logs.items():
            agents[rank] = subprocess.Popen(["bash", str(SCRIPT), *args], env=dict(env, NODE_RANK=str(rank)),
                                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                            start_new_session=True)
        codes = _wait_all_or_first_failure(agents, timeout)
    finally:
        kill_marked(marker)
        for agent in agents.values():
            agent.wait()
    outputs = {}
    for rank, log in logs.items():
        log.seek(0)
        outputs[rank] = log.read()
        log.close()
    failed = {rank: codes.get(rank, "nothing: still running when the other node failed")
              for rank in (0, 1) if codes.get(rank) != 0}
    assert not failed, "\n".join(f"node {rank} exited {status}:\n{outputs[rank][-4000:]}"
                                  for rank, status in failed.items())
    summaries = [m.group(0) for out in outputs.values() for m in [re.search(r"^\{.*?^\}", out, re.S | re.M)] if m]
    assert len(summaries) == 1, f"expected one summary (global rank 0), found {len(summaries)}"
    return json.loads(summaries[0])


def _wait_all_or_first_failure(agents: dict[int, subprocess.Popen], timeout: float) -> dict[int, int]:
    """Exit codes of the agents once all have ended, or once one failed (its peer would wait out
    the rendezvous timeout: minutes); a missing code means the agent was still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = {rank: agent.poll() for rank, agent in agents.items() if agent.poll() is not None}
        if len(codes) == len(agents) or any(codes.values()):
            return codes
        time.sleep(1)
    return {rank: agent.poll() for rank, agent in agents.items() if agent.poll() is not None}


def _assert_rollouts_follow_the_trainer(run_dir: Path) -> None:
    """fp32 rollout and fp32 trainer on the same weights agree on logprobs; at step 2 only if
    step 1's update reached the rollout side (lr 1e-3 moves logprobs by far more than 1e-3)."""
    mismatch = tb_scalars(run_dir)["train/mismatch_abs_logprob_diff_mean"]
    assert len(mismatch) == 2 and max(mismatch) < 1e-3, mismatch


def test_two_agents_train_with_tensor_parallel_across_them(tiny_run_inputs, tmp_path):
    summary = _launch_two_nodes(tiny_run_inputs, tmp_path, "model.tensor_parallel=2")
    _assert_rollouts_follow_the_trainer(tmp_path)
    assert summary["hf_output"] == str(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002"]


@pytest.fixture
def rollout_server(tiny_run_inputs):
    """An SGLang server the trainer did not start (the rollout node of a disaggregated job)."""
    from megatron_fp8rl.rollout.sglang_server import SGLangServer

    server = SGLangServer(sglang_config(tiny_run_inputs[0]))
    yield server
    server.close()


def test_two_agents_train_data_parallel_from_a_disaggregated_server(tiny_run_inputs, rollout_server,
                                                                     tmp_path):
    _launch_two_nodes(tiny_run_inputs, tmp_path, "rollout.mode=disaggregated",
                      f"rollout.server_url={rollout_server.url}", "rollout.weight_transfer=distributed",
                      "rollout.bucket_mb=1")
    _assert_rollouts_follow_the_trainer(tmp_path)
    info = requests.get(f"{rollout_server.url}/model_info", timeout=30).json()
    assert info["weight_version"] == "2", info
