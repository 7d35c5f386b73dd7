"""The scale / scaling-state kernel (fp8/triton_scaling.py) under Triton's interpreter: its scales
equal fp8/quantize.py's `scale_from_bound` and its history updates fp8/scaling.py's
`DelayedScalingState` bit for bit on edge bounds (0, NaN, inf, a bound whose scale overflows);
the two launches around an amax-reduction collective give what one launch gives, with the
collective's values folded in, and over a real 2-rank gloo group the device quantizers end every
call where the CPU ones do; every mode compiles for sm90 (the GPU code path)."""
import pytest
import torch

from megatron_fp8rl.fp8 import triton_scaling as ts
from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.quantize import scale_from_bound
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling
from megatron_fp8rl.fp8.scaling import DelayedScalingState

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]
EDGE_BOUNDS = [0.0, float("inf"), 1e-44, 2.5e-3, 3.0, 448.0, 6.0e4]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(-1).view(torch.int32)


def _state(history, scale) -> DelayedScalingState:
    state = DelayedScalingState(len(history))
    state.amax_history, state.scale = torch.tensor(history, dtype=torch.float32), torch.tensor(scale)
    return state


def _same_state(a: DelayedScalingState, b: DelayedScalingState) -> bool:
    return torch.equal(_bits(a.amax_history), _bits(b.amax_history)) and torch.equal(_bits(a.scale), _bits(b.scale))


@pytest.mark.parametrize("bound", EDGE_BOUNDS)
@pytest.mark.parametrize("fmt,margin", [(E4M3, 0), (E4M3, 1), (E5M2, 3)])
def test_current_and_weight_scales_equal_scale_from_bound(bound, fmt, margin):
    partial = torch.tensor([[bound * 0.5, bound], [bound, bound * 0.25]])  # the amax pass: finite maxima, no NaN
    counts = torch.full((5,), 7, dtype=torch.int64)
    out = ts.current_scale(partial, fmt, margin, counts)
    expected = scale_from_bound(partial.amax(), fmt.max, margin)
    assert torch.equal(_bits(out["scale"]), _bits(expected)) and torch.equal(counts, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(_bits(out["scale_inv"]), _bits(expected.reciprocal()))
    device, cpu = _state([1.0, 5.0, 0.0], 0.75), _state([1.0, 5.0, 0.0], 0.75)
    out = ts.calibrated_weight_scale(partial, device, fmt, margin, counts)
    bound_t = partial.amax()
    scale = scale_from_bound(bound_t, fmt.max, margin, cpu.scale)  # quantizer.CalibratedQuantizer, weights
    cpu.record(bound_t)
    cpu.amax_history.copy_(torch.roll(cpu.amax_history, -1, 0))
    cpu.amax_history[0] = 0.0
    cpu.scale = scale
    assert torch.equal(_bits(out["scale"]), _bits(scale)) and _same_state(device, cpu)
    assert torch.equal(_bits(out["bound"]), _bits(bound_t.reshape(1)))


@pytest.mark.parametrize("amax", [0.0, 3.0, float("inf"), float("nan")])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history", [[2.0], [0.5, 9.0, float("nan"), 1.0], [4.0, 0.0, 0.0, 1.5, 0.0]])
def test_delayed_update_equals_the_te_semantics_of_scaling_py(amax, algo, history):
    nan = amax != amax
    partial = torch.tensor([0.0 if nan else amax, 1.0])  # the quantize pass leaves NaN out of its amax
    counts = torch.tensor([0, 0, 0, int(nan), int(nan)], dtype=torch.int64)
    device, cpu = _state(history, 0.5), _state(history, 0.5)
    out = ts.delayed_update(partial, counts, device, E4M3, 1, algo == "most_recent")
    cpu.record(torch.tensor(float("nan")) if nan else partial.amax())
    cpu.update(algo, E4M3.max, 1, reduce=False)
    assert _same_state(device, cpu)
    assert torch.equal(_bits(out["scale_inv"]), _bits(torch.tensor(0.5).reciprocal()))


def _calibrated_oracle(partial, overflow, numel, state, spec, fmt):
    """quantizer.CalibratedQuantizer.quantize's activation branch on given bound and overflow count."""
    bound, fraction = partial.amax(), overflow.sum().float() / numel
    no_bound = ((state.amax_history.amax() <= 0) & (state.scale == 1.0)).float()
    recalibrate = (no_bound > 0) | (fraction > spec.overflow_tolerance)
    scale = torch.where(recalibrate, scale_from_bound(bound, fmt.max, spec.margin, state.scale), state.scale)
    state.record(bound)
    state.update("max", fmt.max, spec.margin, reduce=False)
    return scale, recalibrate


@pytest.mark.parametrize("overflow_count", [0, 1, 5])
@pytest.mark.parametrize("history,scale",
                         [([0.0, 0.0], 1.0), ([0.0], 60.0), ([3.0, 0.0], 60.0), ([float("nan"), 2.0], 1.0)])
def test_calibrated_decision_equals_the_quantizer(overflow_count, history, scale):
    spec = CalibratedDelayedScaling(overflow_tolerance=0.01, amax_history_len=len(history))
    partial, overflow = torch.tensor([2.0, 7.5, 1.0]), torch.tensor([overflow_count, 0], dtype=torch.int32)
    device, cpu = _state(history, scale), _state(history, scale)
    out = ts.calibrated_scale(partial, overflow, 200, device, E4M3, spec, torch.empty(5, dtype=torch.int64))
    expected, recalibrate = _calibrated_oracle(partial, overflow, 200, cpu, spec, E4M3)
    assert torch.equal(_bits(out["scale"]), _bits(expected)) and bool(out["recalibrated"]) == bool(recalibrate)
    assert _same_state(device, cpu)


def test_two_launches_around_the_collective_fold_in_what_other_ranks_recorded():
    """reduce: what an all-reduce MAX with another rank's values does to the shared tensor."""
    def other_rank(values):
        shared.append(values.clone())
        values.copy_(torch.maximum(values, torch.full_like(values, 40.0)))

    shared = []
    device = _state([1.0, 2.0, 0.0], 0.5)
    ts.delayed_update(torch.tensor([3.0]), torch.zeros(5, dtype=torch.int64), device, E4M3, 0, False, other_rank)
    one_rank = _state([40.0, 2.0, 0.0], 0.5)  # as if this rank had recorded the other rank's amax itself
    ts.delayed_update(torch.tensor([3.0]), torch.zeros(5, dtype=torch.int64), one_rank, E4M3, 0, False)
    assert _same_state(device, one_rank) and torch.equal(shared[0], torch.tensor([3.0]))
    shared.clear()
    device, one_rank = _state([0.0, 0.0], 1.0), _state([0.0, 0.0], 1.0)
    out = ts.calibrated_weight_scale(torch.tensor([3.0]), device, E4M3, 0, torch.empty(5, dtype=torch.int64),
                                     other_rank)
    alone = ts.calibrated_weight_scale(torch.tensor([40.0]), one_rank, E4M3, 0, torch.empty(5, dtype=torch.int64))
    assert torch.equal(out["scale"], alone["scale"]) and _same_state(device, one_rank)
    assert shared[0].shape == (1,)
    shared.clear()
    spec = CalibratedDelayedScaling(amax_history_len=2)
    device, one_rank = _state([0.0, 0.0], 1.0), _state([0.0, 0.0], 1.0)
    out = ts.calibrated_scale(torch.tensor([3.0]), torch.zeros(1, dtype=torch.int32), 10, device, E4M3, spec,
                              torch.empty(5, dtype=torch.int64), other_rank)
    alone = ts.calibrated_scale(torch.tensor([40.0]), torch.zeros(1, dtype=torch.int32), 10, one_rank, E4M3, spec,
                                torch.empty(5, dtype=torch.int64))
    assert torch.equal(out["scale"], alone["scale"]) and _same_state(device, one_rank)
    assert shared[0].shape == (3,)  # bound, overflow fraction, no-bound flag


@pytest.mark.parametrize("mode", list(ts.MODES))
@pytest.mark.parametrize("phases", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("most_recent", [False, True])
def test_gpu_code_path_of_the_scaling_kernel_compiles_for_sm90(monkeypatch, mode, phases, most_recent):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pointers = {"partial_ptr": "*fp32", "overflow_ptr": "*i32", "history_ptr": "*fp32", "state_scale_ptr": "*fp32",
                "vec_ptr": "*fp32", "counts_ptr": "*i64", "scale_ptr": "*fp32", "scale_inv_ptr": "*fp32",
                "new_state_scale_ptr": "*fp32", "flag_ptr": "*i1"}
    signature = {**pointers, **dict.fromkeys(("P", "P_OVER", "numel", "L"), "i32")}
    constants = dict(FMAX=448.0, MARGIN_MUL=0.5, TOLERANCE=0.0, MODE=ts.MODES[mode], MOST_RECENT=most_recent,
                     PRE=phases[0], POST=phases[1], BLOCK_P=1024, BLOCK_L=1024)
    signature.update(dict.fromkeys(constants, "constexpr"))
    ptx = compile(ASTSource(ts._kernel(False), signature, constants), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".entry" in ptx


@pytest.mark.multiprocess
def test_the_device_quantizers_reduce_over_a_process_group_as_the_cpu_ones_do():
    """Starts 2 torchrun processes on gloo (tests/fp8/workers/device_amax_reduction.py)."""
    from pathlib import Path

    from tests.helpers.processes import run_torchrun

    output = run_torchrun(Path(__file__).parent / "workers" / "device_amax_reduction.py", 2, timeout=600)
    assert "rank 0 OK" in output and "rank 1 OK" in output
