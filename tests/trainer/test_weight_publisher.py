"""Where the weight publisher assembles the rollout snapshot (issue 43 item 6): on the weights' own
CUDA device when they travel over NCCL, so the engine flattens the buckets there and hands them over
as CUDA IPC handles; on the CPU for the CPU tier (gloo); any pairing that would copy through the
other side's memory is refused by name, never taken silently. The CPU tier's bytes are
tests/trainer/test_actor_weights.py's (bit-equal to the checkpoint round trip, on the CPU)."""
import pytest
import torch

from megatron_fp8rl.trainer.weight_publisher import assembly_device


@pytest.mark.parametrize("index", [0, 3])
def test_cuda_weights_over_nccl_are_assembled_on_their_gpu(index):
    device = torch.device("cuda", index)
    assert assembly_device(device, "nccl") == device


def test_cpu_weights_over_gloo_are_assembled_on_the_cpu():
    assert assembly_device(torch.device("cpu"), "gloo") == torch.device("cpu")


@pytest.mark.parametrize("weights, backend, through", [("cuda:0", "gloo", "host"), ("cpu", "nccl", "device")])
def test_a_pairing_that_would_round_trip_is_refused_by_name(weights, backend, through):
    with pytest.raises(ValueError, match=rf"on {weights} .*'{backend}'.*through {through} memory"):
        assembly_device(torch.device(weights), backend)

