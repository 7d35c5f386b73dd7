"""bench/ratio_noise.py on a very small GPT: the float32 trainer's ratio is its shadow's (0 by
construction), plain groupwise32's later mini-batches carry FP8 noise, and an arm that holds θ_old's
weight scales changes no weight code through a scale move. One process (gloo)."""
import argparse

import pytest
import torch

from bench import ratio_noise as bench

ARGS = argparse.Namespace(layers=1, hidden=64, ffn=128, vocab=128, batch=16, seq=12, response=4, mini_batches=2,
                          steps=1, lr=1e-3)


@pytest.fixture(scope="module")
def found(megatron_tp1):
    workload = bench.TinyGpt(ARGS)
    return {arm: bench.run_arm(workload, arm, 1, ARGS) for arm in ("groupwise32", "frozen", "float32")}


def test_the_float32_trainer_shows_no_ratio_noise(found):
    assert found["float32"]["dlogr"] == [0.0] and found["float32"]["overclip"] == [0.0]
    assert found["float32"]["moved"][0] > 0  # the policy did move: the zero is not for want of an update


def test_fp8_ratios_of_a_later_mini_batch_differ_from_the_shadows(found):
    assert found["groupwise32"]["dlogr"][0] > 0 and found["groupwise32"]["quant"][0] > 0
    assert 0 < found["groupwise32"]["codes"][0] < 1


def test_the_arms_start_from_the_same_weights_and_batch(found):
    assert found["frozen"]["quant"] == found["groupwise32"]["quant"]  # θ_old: held scales are the live ones


def test_boundary_share_counts_ties_that_power_of_two_scales_keep():
    """A group with max 1.0 and 1.0625: power-of-two scale 256 puts 1.0625 at 272, halfway between the
    E4M3 values 256 and 288 (a tie); the fp32 scale 448 puts it at 476, inside (464, 480)."""
    weight = torch.zeros(2, 32)
    weight[:, 0], weight[:, 1] = 1.0, 1.0625
    assert bench.boundary_share(weight, scale_pow2=True) == 1 / 32
    assert bench.boundary_share(weight, scale_pow2=False) == 0.0
