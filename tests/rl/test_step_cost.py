"""The step cost model (rl/step_cost.py): the passes each setting adds, hand-worked; the recompute
rule against the trainer's own (trainer/rl_step.py) on real run configs; the projected step time
against the figures issue 61 worked by hand; bad settings refused by name."""
import dataclasses

import pytest

from megatron_fp8rl.rl.step_cost import (
    StepCostError, StepShape, dotted, projected_step_ratio, step_passes, step_shape,
)
from megatron_fp8rl.study.arms import REGIMES
from megatron_fp8rl.trainer.rl_step import _recompute_needed
from tests.helpers.study_runs import arm_config


def _shape(m: int, mode: str = "none", every: int = 1, recompute: bool = True, gemm: str = "fp8") -> StepShape:
    return StepShape(m, mode, every, recompute, gemm)


@pytest.mark.parametrize("m, extra", [(1, 1.0), (2, 1.5), (4, 1.75)])
def test_the_gate_adds_a_shadow_forward_of_every_mini_batch_and_one_per_later_mini_batch(m, extra):
    passes = step_passes(_shape(m, "gate"))
    assert passes.shadow == pytest.approx(extra) and passes.extra_forward == pytest.approx(extra)
    assert passes.extra_backward == 0 and passes.monitor == 0
    assert passes.extra_share == pytest.approx(extra / 4)


def test_calibrated_clipping_pays_two_mini_batch_forwards_per_calibration_and_monitor_only_measures():
    # M = 4, every 20 steps: log pi_old and log pi_theta of one quarter of the batch, once in 20 steps
    assert step_passes(_shape(4, "shadow", every=20)).shadow == pytest.approx(2 / 4 / 20)
    assert step_passes(_shape(1, "shadow", every=1)).shadow == 1.0  # one forward at theta_old serves both
    monitor = step_passes(_shape(4, "monitor", every=1))
    assert (monitor.shadow, monitor.monitor, monitor.extra_forward) == (0.0, 0.5, 0.0)
    plain = step_passes(_shape(4))
    assert (plain.extra_forward, plain.extra_backward, plain.extra_share) == (0.0, 0.0, 0.0)
    assert step_passes(_shape(4, recompute=False)).extra_forward == -1.0  # bypass saves the recompute


@pytest.mark.parametrize("m, gate_every", [(4, 9), (2, 3), (1, 20)])
def test_a_gate_on_one_step_in_k_pays_a_kth_of_the_gates_shadow_forwards(m, gate_every):
    """calibration.gate_every = k: the gated step's (2M - 1)/M shadow forwards once in k steps; the
    equivalence study's remedy (k = 9, M = 4) stays within issue 61's 5% of a plain FP8 step."""
    every = step_passes(StepShape(m, "gate", 1, True, "fp8", gate_every))
    assert every.shadow == pytest.approx((2 * m - 1) / m / gate_every)
    assert every.extra_share == pytest.approx(step_passes(_shape(m, "gate")).extra_share / gate_every)
    if (m, gate_every) == (4, 9):
        assert every.extra_share == pytest.approx(0.0486, abs=5e-5) and every.extra_share <= 0.05
        assert step_passes(StepShape(4, "gate", 1, True, "fp8", 8)).extra_share > 0.05  # 9 is the smallest k
    values = _values(arm_config(["model.hf_path=m", f"train.mini_batches={m}", "model.fp8=groupwise32",
                                 "algorithm.calibration.mode=gate", f"algorithm.calibration.gate_every={gate_every}"]))
    assert step_shape(values).gate_every == gate_every
    del values["algorithm.calibration.gate_every"]  # a config.yaml written before the key: every step gated
    assert step_shape(values).gate_every == 1
    with pytest.raises(StepCostError, match="gate_every .* for mode=gate only, got 9 with mode 'shadow'"):
        StepShape(4, "shadow", 1, True, "fp8", 9)


@pytest.mark.parametrize("m, speedup, expected", [(2, 1.5, 1.04), (4, 1.5, 1.10), (2, 1.9, 0.90), (4, 1.9, 0.96)])
def test_the_projected_gated_step_matches_the_issues_hand_worked_figures(m, speedup, expected):
    """Issue 61: "at s = 1.5 the gated FP8 step costs 1.04x (M = 2) / 1.10x (M = 4) a bf16 step;
    at s = 1.9, 0.90x / 0.96x"."""
    assert projected_step_ratio(step_passes(_shape(m, "gate")), "fp8", speedup) == pytest.approx(expected, abs=0.005)


def test_plain_fp8_and_bf16_steps_project_as_the_model_says():
    plain = step_passes(_shape(4))
    assert projected_step_ratio(plain, "fp8", 1.3) == pytest.approx(1 / 1.3)
    assert projected_step_ratio(plain, "bf16", 1.9) == 1.0  # a bf16 trainer does not get FP8's speed
    monitored = step_passes(_shape(4, "monitor"))
    assert projected_step_ratio(monitored, "fp8", 1.5) == projected_step_ratio(plain, "fp8", 1.5)
    with pytest.raises(StepCostError, match="'float32' trainer is not modelled"):
        projected_step_ratio(plain, "float32", 1.5)
    with pytest.raises(StepCostError, match="speed ratio must be > 0"):
        projected_step_ratio(plain, "fp8", 0)


def _values(cfg) -> dict:
    return dotted(dataclasses.asdict(cfg))


@pytest.mark.parametrize("overrides", [
    ["train.mini_batches=1"], ["train.mini_batches=2"], ["train.mini_batches=1", "model.fp8=groupwise32", "algorithm.calibration.mode=gate"],
    ["train.mini_batches=1", "algorithm.correction=tis", "algorithm.noise.correction=true"],
    ["train.mini_batches=4", "algorithm.old_policy=bypass", "algorithm.correction=none"],
    ["train.mini_batches=1", "model.fp8=groupwise32", "algorithm.calibration.mode=monitor"],
])
def test_the_recompute_rule_is_the_trainers(overrides):
    cfg = arm_config(["model.hf_path=m", *overrides])
    assert step_shape(_values(cfg)).recompute == _recompute_needed(cfg)


def test_every_study_arm_has_a_shape_from_its_real_run_config():
    for regime in REGIMES.values():
        for arm in regime.arms:
            cfg = arm_config([f"{k}={v}" for k, v in regime.sizes.items()] + ["model.hf_path=m", *arm.overrides],
                             regime.common)
            shape = step_shape(_values(cfg))
            assert shape.mini_batches == cfg.train.mini_batches
            assert shape.gemm == ("fp8" if cfg.model.fp8 != "none" else
                                  "bf16" if cfg.model.dtype == "bfloat16" else "float32")


def test_missing_or_bad_settings_are_named():
    values = _values(arm_config(["model.hf_path=m"]))
    del values["algorithm.calibration.every"]
    with pytest.raises(StepCostError, match=r"lacks \['algorithm.calibration.every'\]"):
        step_shape(values)
    with pytest.raises(StepCostError, match="algorithm.calibration.mode 'sometimes'"):
        _shape(2, "sometimes")
    with pytest.raises(StepCostError, match="algorithm.noise.correction: expected true or false, found 'maybe'"):
        step_shape({**_values(arm_config(["model.hf_path=m"])), "algorithm.noise.correction": "maybe"})
    assert step_shape({**_values(arm_config(["model.hf_path=m"])), "algorithm.noise.correction": "true"}).recompute
