"""TE's delayed-scaling semantics on hand-worked cases (TE's own code is compared in
tests/models/test_te_recipe.py): scale formula, history window, roll, first use, checkpoints."""
import math

import pytest
import torch

from megatron_fp8rl.fp8.quantize import FP32_MAX, scale_from_bound
from megatron_fp8rl.fp8.scaling import (
    DelayedScalingState,
    all_reduce_max_,
    bound_from_history,
    roll_amax_history_,
)

SCALE_TABLE = [  # bound, old scale, fp8_max, margin -> expected scale
    (1.0, 3.0, 448.0, 0, 448.0),
    (1.0, 3.0, 448.0, 1, 224.0),
    (2.0, 3.0, 57344.0, 3, 3584.0),
    (448.0, 3.0, 448.0, 0, 1.0),
    (0.0, 3.0, 448.0, 0, 3.0),
    (-2.0, 3.0, 448.0, 0, 3.0),
    (math.nan, 3.0, 448.0, 0, 3.0),
    (math.inf, 3.0, 448.0, 0, 3.0),
    (1e-45, 3.0, 448.0, 0, FP32_MAX),
]


@pytest.mark.parametrize("bound,old,fp8_max,margin,expected", SCALE_TABLE)
def test_scale_from_bound_table(bound, old, fp8_max, margin, expected):
    scale = scale_from_bound(torch.tensor(bound), fp8_max, margin, torch.tensor(old))
    assert scale.dtype == torch.float32
    assert scale.item() == pytest.approx(expected, rel=1e-7)
    assert math.isfinite(scale.item())


def test_bound_from_history_algorithms():
    history = torch.tensor([[1.0, 5.0], [4.0, 2.0], [3.0, 0.0]])
    assert torch.equal(bound_from_history(history, "max"), torch.tensor([4.0, 5.0]))
    assert torch.equal(bound_from_history(history, "most_recent"), torch.tensor([1.0, 5.0]))
    history[1, 0] = math.nan
    assert math.isnan(bound_from_history(history, "max")[0].item())
    with pytest.raises(ValueError, match="valid: max, most_recent"):
        bound_from_history(history, "mean")


def test_roll_moves_row0_to_the_end_and_zeroes_it():
    history = torch.tensor([7.0, 1.0, 2.0])
    assert torch.equal(roll_amax_history_(history), torch.tensor([0.0, 2.0, 7.0]))
    single = torch.tensor([7.0])
    assert torch.equal(roll_amax_history_(single), torch.tensor([0.0]))


def test_window_of_three_steps():
    """history 3, 'max': the scale used at step t+1 comes from the max of amaxes t-2..t."""
    state = DelayedScalingState(3)
    assert state.scale.item() == 1.0  # first use runs with scale 1, as in TE
    expected_bounds = {8.0: 8.0, 1.0: 8.0, 2.0: 8.0, 4.0: 4.0, 0.5: 4.0}
    for amax, bound in expected_bounds.items():
        state.record(torch.tensor(amax))
        state.update("max", 448.0, margin=0)
        assert state.scale.item() == pytest.approx(448.0 / bound)


def test_record_keeps_the_step_maximum_and_nan():
    state = DelayedScalingState(2)
    state.record(torch.tensor(3.0))
    state.record(torch.tensor(1.0))
    assert state.amax_history[0].item() == 3.0
    state.record(torch.tensor(math.nan))
    assert math.isnan(state.amax_history[0].item())
    state.update("max", 448.0, 0)
    assert state.scale.item() == 1.0  # NaN never reaches a scale


def test_most_recent_history_one_is_megatrons_default():
    state = DelayedScalingState(1)
    for amax in (2.0, 8.0, 0.0, 4.0):
        state.record(torch.tensor(amax))
        state.update("most_recent", 448.0, 0)
    assert state.scale.item() == pytest.approx(112.0)  # amax 0 kept 448/8, then 448/4


def test_state_dict_roundtrip_and_length_check():
    state = DelayedScalingState(4)
    state.record(torch.tensor(2.0))
    state.update("max", 448.0, 1)
    restored = DelayedScalingState(4)
    restored.load_state_dict(state.state_dict())
    assert torch.equal(restored.scale, state.scale)
    assert torch.equal(restored.amax_history, state.amax_history)
    with pytest.raises(ValueError, match=r"layer.input.amax_history: expected shape \(8,\), found \(4,\)"):
        DelayedScalingState(8).load_state_dict(state.state_dict(), "layer.input")


def test_all_reduce_is_a_no_op_without_a_process_group():
    values = torch.tensor([1.0, 2.0])
    assert all_reduce_max_(values) is values
    assert torch.equal(values, torch.tensor([1.0, 2.0]))


def test_history_length_must_be_positive():
    with pytest.raises(ValueError, match="history length must be >= 1, found 0"):
        DelayedScalingState(0)


@pytest.mark.multiprocess
def test_amax_all_reduce_over_a_process_group():
    """Starts 2 torchrun processes on gloo (tests/fp8/workers/amax_reduction.py)."""
    from pathlib import Path

    from tests.helpers.processes import run_torchrun

    output = run_torchrun(Path(__file__).parent / "workers" / "amax_reduction.py", 2, timeout=300)
    assert "rank 0 OK" in output and "rank 1 OK" in output
