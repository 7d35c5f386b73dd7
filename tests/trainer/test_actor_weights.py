"""The actor's in-memory weight stream (TP = PP = 1), which every weight sync at that layout now
uses, equals the checkpoint round trip it replaces (save_weights + hf_tensors): the same HF names
in the same order and bit-equal tensors, for a float32 and a calibrated FP8 trainer. One process
(gloo), a tiny random Llama (its gated MLP is saved through Megatron's swiglu factory), converted
once per module in this process: the property is the actor's weight stream, not the conversion,
whose subprocess path the torchrun train tests run."""
import json

import pytest
import torch

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.models.hf import build_conversion_target
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.config import AlgorithmConfig, ModelConfig, TrainConfig
from megatron_fp8rl.trainer.objective import Objective
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def converted(megatron_tp1, tmp_path_factory):
    """(HF folder, its torch_dist conversion) of a tiny random Llama."""
    root = tmp_path_factory.mktemp("actor_weights")
    model = build_tiny_model("llama", root / "hf")
    hf_config = json.loads((model / "config.json").read_text())
    convert_hf_to_megatron(model, root / "init", build_conversion_target(hf_config).sharded_state_dict(),
                           progress=False)
    return model, root / "init"


@pytest.mark.parametrize("fp8", ["none", "calibrated"])
def test_in_memory_weights_equal_the_checkpoint_round_trip(megatron_tp1, converted, tmp_path, fp8):
    model, init = converted
    actor = MegatronActor(init, ModelConfig(hf_path=str(model), fp8=fp8), TrainConfig(),
                          Objective(AlgorithmConfig(), max_response_length=8))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained weights: neither side may fall back to the converted start
        for param in actor.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    disk = list(actor.hf_tensors(actor.save_weights(tmp_path / "sync")))
    memory = list(actor.hf_tensors_in_memory())
    assert [name for name, _ in memory] == [name for name, _ in disk]
    assert len(disk) == 3 + 2 * 9  # embeddings, final norm, lm_head; 9 per layer
    for (name, ours), (_, theirs) in zip(memory, disk):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
