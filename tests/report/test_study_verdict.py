"""The verdict across the study's regimes (report/study_verdict.py) on hand-made run figures: each
target is met or not exactly when its definition says, the remedies pool their paired tests over
regimes, and an arm's kind comes from its overrides."""
import math

import pytest

from megatron_fp8rl.report.study_figures import RunFigures
from megatron_fp8rl.report.study_verdict import (
    ALIGNED_FIX, ArmKind, arm_kind, recommended_line, remedy_lines, side_by_side, target_lines, write_verdict,
)
from megatron_fp8rl.rl.metrics import paired_eval_change

N = 40
"""Held-out problems per run."""
FP8 = ArmKind(fp8=True, probe=False, aligned_float32=True)
PLAIN = ArmKind(fp8=False, probe=False, aligned_float32=False)
KINDS = {"bf16": PLAIN, "float32": PLAIN, "groupwise32": FP8, "groupwise32_gate": FP8,
         "tensorwise": ArmKind(fp8=True, probe=False, aligned_float32=False),
         "groupwise32_low_lr": ArmKind(fp8=True, probe=True, aligned_float32=True)}


def _run(arm: str, seed: int, correct: int, overclip: float = 0.05, mismatch: float = 0.0, step_s: float = 10.0,
         shift: int = 0) -> RunFigures:
    """A run right on `correct` of N problems: a window of them starting at problem `shift`."""
    eval_final = [int(shift <= i < shift + correct) for i in range(N)]
    values = {"accuracy": correct / N, "overclip": overclip, "mismatch_max": mismatch, "step_s": step_s}
    return RunFigures(arm, str(seed), values, {}, eval_final, started=ALIGNED_FIX[1] + 3600)


def _arm(arm: str, corrects: list[int], **kwargs) -> list[RunFigures]:
    return [_run(arm, seed, correct, **kwargs) for seed, correct in enumerate(corrects, 1)]


def _regime(default: list[int], bf16: list[int] = (20, 22, 24), **extra) -> dict[str, list[RunFigures]]:
    return {"bf16": _arm("bf16", list(bf16), overclip=math.nan), "float32": _arm("float32", [22, 24, 26], overclip=math.nan),
            "groupwise32": _arm("groupwise32", default), **extra}


def test_the_moderate_target_holds_only_when_the_default_stands_with_bf16_in_every_moderate_regime():
    inside = _regime([21, 22, 23])  # inside bf16's 0.50-0.60 at every seed, few problems apart: p > 0.05
    lines = target_lines({"moderate2": inside, "moderate4": inside}, KINDS, "groupwise32", "bf16")
    assert lines[0].startswith("- **Moderate target**") and lines[0].endswith("**Met.**")
    assert "moderate2: 0.550 [0.525, 0.575] (seeds 1, 2, 3), inside bf16's range 0.550 [0.500, 0.600]" in lines[0]
    below = _regime([10, 12, 14])  # below the range and behind on the same problems
    lines = target_lines({"moderate2": inside, "moderate4": below}, KINDS, "groupwise32", "bf16")
    assert lines[0].endswith("**Not met.**") and "moderate4: 0.300 [0.250, 0.350] (seeds 1, 2, 3), below" in lines[0]


def test_the_harsh_target_counts_fp8_arms_of_the_same_job_only_and_names_the_closest_when_none_meets_it():
    harsh = _regime([2, 3, 4], float32=_arm("float32", [30, 30, 30], overclip=math.nan),
                    tensorwise=_arm("tensorwise", [8, 10]),
                    groupwise32_low_lr=_arm("groupwise32_low_lr", [30, 31]))  # a probe: changes the job
    line = next(line for line in target_lines({"harsh": harsh}, KINDS, "groupwise32", "bf16")
                if line.startswith("- **Harsh target**"))
    assert "**not met**" in line and "the highest median, tensorwise 0.225 [0.200, 0.250] (seeds 1, 2)" in line
    harsh["groupwise32_gate"] = _arm("groupwise32_gate", [21, 22, 23])
    line = next(line for line in target_lines({"harsh": harsh}, KINDS, "groupwise32", "bf16")
                if line.startswith("- **Harsh target**"))
    assert "**met** by groupwise32_gate (inside bf16's range" in line and "tensorwise" not in line


def test_the_mismatch_target_fails_on_any_step_of_any_aligned_float32_run():
    regime = _regime([21, 22, 23], groupwise32_gate=_arm("groupwise32_gate", [21, 22, 23]),
                     tensorwise=_arm("tensorwise", [20, 20], mismatch=0.2))  # not aligned: not counted
    line = target_lines({"moderate2": regime}, KINDS, "groupwise32", "bf16")[-1]
    assert line.endswith("**Met.**") and "groupwise32 (3 runs, moderate2): 0" in line and "tensorwise" not in line
    regime["groupwise32_gate"][1].values["mismatch_max"] = 9e-6
    line = target_lines({"moderate2": regime}, KINDS, "groupwise32", "bf16")[-1]
    assert line.endswith("**Not met** by groupwise32_gate.") and "groupwise32_gate (3 runs, moderate2): up to 9e-06" in line
    regime["groupwise32_gate"][1].started = ALIGNED_FIX[1] - 60  # trained before the fix: reported apart
    line = target_lines({"moderate2": regime}, KINDS, "groupwise32", "bf16")[-1]
    assert "groupwise32_gate (2 runs, moderate2): 0. **Met.** Runs trained before a195390" in line
    assert line.endswith("groupwise32_gate (1 run, moderate2): up to 9e-06.")


def test_a_remedy_is_tested_per_regime_and_pooled_over_every_regimes_pairs():
    a = _regime([20, 20], groupwise32_gate=_arm("groupwise32_gate", [24, 24]))  # +4 per seed
    b = _regime([20, 20], groupwise32_gate=_arm("groupwise32_gate", [20, 20], shift=2))  # +2/-2 per seed
    line, = remedy_lines({"moderate2": a, "moderate4": b}, (("groupwise32", "groupwise32_gate"),))
    # one McNemar over the four seed pairs' problems together: +4/-0 twice, +2/-2 twice
    pooled = paired_eval_change([bool(c) for r in a["groupwise32"] + b["groupwise32"] for c in r.eval_final],
                                [bool(c) for r in a["groupwise32_gate"] + b["groupwise32_gate"] for c in r.eval_final])
    assert (pooled["gained"], pooled["lost"]) == (12.0, 4.0)
    assert f"all regimes: +12/−4, p = {pooled['mcnemar_p']:.2g}." in line
    assert line.startswith("- **groupwise32_gate against groupwise32**, same seeds: moderate2 0.600 against 0.500, +8/−0")


def test_the_recommended_arms_stand_with_both_references_and_keep_the_diagnostic_under_one_percent():
    regime = _regime([14, 15, 16], groupwise32_gate=_arm("groupwise32_gate", [22, 24, 26], overclip=0.0),
                     tensorwise=_arm("tensorwise", [22, 24], overclip=0.08))
    line = recommended_line({"moderate2": regime, "moderate4": regime}, KINDS, ("bf16", "float32"))
    assert line.endswith(": groupwise32_gate.")
    regime["groupwise32_gate"][0].values["overclip"] = 0.2  # two of three seeds over: the median is 20%
    regime["groupwise32_gate"][1].values["overclip"] = 0.2
    assert recommended_line({"moderate2": regime}, KINDS, ("bf16", "float32")).endswith(": none.")


def test_the_side_by_side_table_lists_references_first_and_leaves_probes_out():
    regime = _regime([21, 22, 23], groupwise32_low_lr=_arm("groupwise32_low_lr", [30, 30]))
    rows = side_by_side({"harsh": regime, "moderate2": regime}, KINDS, ("bf16", "float32"))
    arms = [row.split(" | ")[0].lstrip("| ") for row in rows[2:]]
    assert arms == ["bf16", "bf16", "float32", "float32", "groupwise32", "groupwise32"]
    # bf16 vs float32: float32 is right on 2 more problems at each of 3 seeds: +0/-6, p = 2 / 2^6
    assert rows[2] == "| bf16 | harsh | 3 | 0.550 [0.500, 0.600] | — | +0/−6, p = 0.031 | n/a | 10 |"


@pytest.mark.parametrize("overrides, kind", [
    (("model.fp8=groupwise32", "rollout.fp8=aligned"), ArmKind(True, False, True)),
    (("model.dtype=bfloat16", "model.fp8=groupwise32", "rollout.fp8=aligned"), ArmKind(True, False, False)),
    (("model.dtype=bfloat16", "model.fp8=none", "rollout.fp8=blockwise"), ArmKind(True, False, False)),
    (("model.fp8=none", "rollout.fp8=none", "train.lr=1e-5"), ArmKind(False, True, False)),
])
def test_an_arms_kind_follows_from_its_overrides(overrides, kind):
    assert arm_kind(overrides, ("train.lr=1e-5", "train.norm_lr_mult=0")) == kind


def test_the_verdict_file_holds_every_section(tmp_path):
    regime = _regime([21, 22, 23], groupwise32_gate=_arm("groupwise32_gate", [22, 24, 26], overclip=0.0))
    out = write_verdict({"moderate2": regime, "moderate4": regime}, KINDS, tmp_path / "v" / "verdict.md",
                        "groupwise32", ("bf16", "float32"), (("groupwise32", "groupwise32_gate"),), "Preamble.")
    text = out.read_text()
    for heading in ("## The issue's targets", "## Remedies against what they remedy", "## Every arm of the original jobs"):
        assert heading in text
    assert "Preamble." in text and "- **Moderate target**" in text and "| groupwise32_gate | moderate4 | 3 |" in text
