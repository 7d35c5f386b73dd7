"""The equivalence analysis of a study's runs (study/equivalence.py): it runs with no run committed
(every row "no runs yet", the costs from the study's own table), each arm's cost from its definition
equals the one from its real run config, and finished runs give the verdict."""
import dataclasses

import pytest

from megatron_fp8rl.rl.step_cost import dotted, step_passes, step_shape
from megatron_fp8rl.study.arms import REGIMES, post_hoc_equivalence
from megatron_fp8rl.study.equivalence import arm_cost, regime_section
from megatron_fp8rl.study.runner import main
from tests.helpers.study_runs import arm_config, correct_first, write_finished_run

REGIME = REGIMES["equivalence"]


def _config(arm):
    return arm_config([f"{k}={v}" for k, v in REGIME.sizes.items()] + ["model.hf_path=m", *arm.overrides], REGIME.common)


def test_each_arms_cost_from_the_study_table_is_the_one_its_run_config_gives():
    for arm in REGIME.arms:
        from_config = step_shape(dotted(dataclasses.asdict(_config(arm))))
        cost = arm_cost(REGIME, arm, {})
        assert cost.passes == step_passes(from_config) and cost.gemm == from_config.gemm, arm.name


def test_the_command_runs_with_no_run_committed(tmp_path, capsys):
    assert main(["--regime", "equivalence", "--report-only", "--study-dir", str(tmp_path / "moderate4")]) == 0
    text = (tmp_path / "equivalence.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| groupwise32")]
    assert len(rows) == 6 and all("| 0 | no runs yet |" in row and "| not shown |" in row for row in rows)
    gate = next(row for row in rows if row.startswith("| groupwise32_gate |"))
    assert "+1.75 fwd, +0.00 bwd (+43.8%) | 1.21 / 1.10 / 0.96 |" in gate  # (2M - 1)/M at M = 4
    remedy = next(row for row in rows if row.startswith("| groupwise32_gate_every9 |"))
    assert "+0.19 fwd, +0.00 bwd (+4.9%) | 0.82 / 0.72 / 0.57 |" in remedy  # (2M - 1)/(9M): within 5%
    assert "Pre-registered" in text and "Margin ±5 points; Holm over the 6 comparisons" in text
    assert "| groupwise32_gate | float32 | 0 | no runs yet |" in capsys.readouterr().out


def test_finished_runs_give_the_verdict_and_their_own_cost(tmp_path):
    study_dir = tmp_path / "moderate4"
    arms = {arm.name: arm for arm in REGIME.arms}
    reference, noise = [300, 320, 280, 310, 290, 305], [8, -8, 5, -5, 9, -9]
    for seed, (count, error) in enumerate(zip(reference, noise), 1):
        for name, correct in (("float32", count), ("groupwise32_gate", count + error), ("groupwise32", count - 40 + error)):
            ran = ["train.mini_batches=2"] if name == "groupwise32_gate" else []  # not the study's 4: its cost shows
            write_finished_run(study_dir / name / f"seed{seed}", correct_first(correct, 500),
                               [f"{k}={v}" for k, v in REGIME.sizes.items()] + list(arms[name].overrides) + ran,
                               REGIME.common)
    heading, text, table = regime_section(REGIME, REGIME.equivalence, study_dir)
    rows = {row.split(" | ")[0].lstrip("| "): row for row in table[2:]}
    assert "| 6 | -8.0 [" in rows["groupwise32"] and "| worse |" in rows["groupwise32"]
    assert "| 6 | +0.0 [" in rows["groupwise32_gate"] and "| equivalent |" in rows["groupwise32_gate"]
    assert "| 0 | no runs yet |" in rows["groupwise32_wide_low"]
    assert "+1.50 fwd" in rows["groupwise32_gate"]  # (2M - 1)/M at the M = 2 its config.yaml says it ran


def test_study_v3_is_reanalysed_against_float32_without_its_probes():
    harsh = post_hoc_equivalence(REGIMES["harsh"])
    arms = [arm for _, arm in harsh.comparisons]
    assert {reference for reference, _ in harsh.comparisons} == {"float32"} and "float32" not in arms
    assert not any(arm.endswith(("_low_lr", "_frozen_norms")) for arm in arms) and "groupwise32_gate" in arms
    assert (harsh.preregistered, harsh.same_problems, harsh.margin) == (False, False, 0.05)


@pytest.mark.parametrize("missing", ["model.dtype", "algorithm.calibration.mode"])
def test_a_study_table_without_a_key_the_cost_reads_is_refused_by_name(missing):
    regime = dataclasses.replace(REGIME, common={k: v for k, v in REGIME.common.items() if k != missing})
    arm = next(arm for arm in regime.arms if arm.name == "bf16_tis")
    if missing == "model.dtype":
        arm = dataclasses.replace(arm, overrides=tuple(o for o in arm.overrides if not o.startswith("model.dtype")))
    with pytest.raises(ValueError, match=rf"run config lacks \['{missing}'\]"):
        arm_cost(regime, arm, {})


def test_a_run_saved_before_the_calibration_keys_were_renamed_is_costed_from_its_old_keys(tmp_path):
    """Study v2's runs (results/stability) saved algorithm.clip_calibration and friends (config/renamed.py)."""
    run = tmp_path / "seed1"
    run.mkdir()
    (run / "config.yaml").write_text(
        "model: {fp8: tensorwise, dtype: float32}\ntrain: {mini_batches: 2}\n"
        "algorithm: {old_policy: decoupled, clip_calibration: shadow, clip_calibration_every: 1, noise_correction: false}\n")
    arm = next(arm for arm in REGIMES["harsh"].arms if arm.name == "tensorwise_cc")
    cost = arm_cost(REGIMES["harsh"], arm, {"1": run})
    assert (cost.passes.shadow, cost.passes.recompute, cost.gemm) == (1.0, 1.0, "fp8")
