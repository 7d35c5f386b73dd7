"""The actor's in-memory weight stream, which every weight sync uses, equals the checkpoint round
trip it replaces (save_weights + hf_tensors): the same HF names in the same order and bit-equal
tensors. TP = PP = 1 in this process (gloo), for a float32 and a calibrated FP8 trainer, on a tiny
random Llama (its gated MLP is saved through Megatron's swiglu factory), converted once per module
in this process: the property is the actor's weight stream, not the conversion, whose subprocess
path the torchrun train tests run. At TP/PP/DP layouts under torchrun (4 processes, gloo), with
dist_checkpointing and transformers models made to raise while the stream runs (tests/workers/actor_weights.py)."""
import json
from pathlib import Path

import pytest
import torch

from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.fp8_observation import calibration_forward
from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig
from megatron_fp8rl.trainer.config import ModelConfig, TrainConfig
from megatron_fp8rl.trainer.objective import Objective
from tests.helpers.megatron_models import converted_tiny_llama
from tests.helpers.processes import run_torchrun
from tests.helpers.tiny_hf import save_tiny_hf

WORKER = Path(__file__).resolve().parents[1] / "workers" / "actor_weights.py"


@pytest.fixture(scope="module")
def converted(megatron_tp1, tmp_path_factory):
    """(HF folder, its torch_dist conversion) of a tiny random Llama."""
    root = tmp_path_factory.mktemp("actor_weights")
    return converted_tiny_llama(root / "hf", root / "init"), root / "init"


@pytest.mark.parametrize("fp8", ["none", "calibrated"])
def test_in_memory_weights_equal_the_checkpoint_round_trip(megatron_tp1, converted, tmp_path, fp8):
    model, init = converted
    actor = MegatronActor(init, ModelConfig(hf_path=str(model), fp8=fp8), TrainConfig(),
                          Objective(AlgorithmConfig(), max_response_length=8))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained weights: neither side may fall back to the converted start
        for param in actor.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    disk = list(actor.publisher.hf_tensors(actor.save_weights(tmp_path / "sync")))
    memory = list(actor.publisher.hf_tensors_in_memory())
    assert [name for name, _ in memory] == [name for name, _ in disk]
    assert len(disk) == 3 + 2 * 9  # embeddings, final norm, lm_head; 9 per layer
    for (name, ours), (_, theirs) in zip(memory, disk):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
        assert ours.device == actor.publisher.device() == torch.device("cpu"), name  # CPU tier: gloo, no GPU


@pytest.mark.multiprocess
def test_in_memory_weights_gather_every_layout_without_a_checkpoint(megatron_tp1, tmp_path):
    """TP2, PP2, TP2xPP2 and DP4 (TP=PP=1 on 4 ranks): rank 0's stream equals the round trip, the
    other ranks yield nothing, and neither dist_checkpointing (save, load) nor a transformers model
    runs. Llama with tied embeddings (PP puts a copy of the embedding on the last stage) and Qwen3
    (q/k norms, untied)."""
    archs = ("llama", "qwen3")
    for arch in archs:
        save_tiny_hf(arch, tmp_path / arch / "hf", dtype=torch.float32)
    layouts = ("tp2pp1", "tp1pp2", "tp2pp2", "tp1pp1")
    run_torchrun(WORKER, 4, "--workdir", str(tmp_path), "--layouts", *layouts, "--archs", *archs)
    for arch in archs:
        counts = {json.loads((tmp_path / arch / f"result_{tag}.json").read_text())["tensors"] for tag in layouts}
        assert len(counts) == 1 and counts.pop() > 0, (arch, counts)


@pytest.mark.parametrize("fp8, rollout_fp8, static", [("none", "none", False), ("none", "per_tensor", True),
                                                      ("none", "blockwise", False), ("calibrated", "aligned", False)])
def test_rollout_snapshot_layout_is_what_its_stream_makes(megatron_tp1, converted, fp8, rollout_fp8, static):
    """The layout an engine checks before it sends a byte (names, shapes, dtypes; from meta
    tensors) is, entry for entry, what the gathered and quantized stream then makes."""
    model, init = converted
    actor = MegatronActor(init, ModelConfig(hf_path=str(model), fp8=fp8), TrainConfig(),
                          Objective(AlgorithmConfig(), max_response_length=8),
                          serving=plan_for(RolloutFp8(rollout_fp8), fp8))
    bounds = calibration_forward(actor, [[3, 4, 5, 6]])  # the recipe's input bounds (aligned's scales)
    seen = {}

    def consume(snapshot):
        seen["layout"] = list(snapshot.layout)
        seen["made"] = [(name, tuple(t.shape), t.dtype) for name, t in snapshot if t.device == actor.publisher.device()]

    actor.publisher.publish(consume, input_bounds=bounds if static else None)
    assert seen["layout"] == seen["made"]
    dtypes = {dtype for _, _, dtype in seen["made"]}
    assert (torch.float8_e4m3fn in dtypes) == (rollout_fp8 != "none")
    assert any(name.endswith("input_scale") for name, _, _ in seen["made"]) == (static or rollout_fp8 == "aligned")
