"""The stability study's report from run directories written the way `train` writes them
(tensorboard scalars, eval_correct.json): the verdict, the paired tests against the reference arm,
the table, the PNGs. (Each run's own figures: test_study_figures.py.)"""
import math

import pytest
from torch.utils.tensorboard import SummaryWriter

from megatron_fp8rl.report.study_figures import arm_figures, run_figures
from megatron_fp8rl.report.study_report import verdict_lines, write_study_report
from megatron_fp8rl.rl.metrics import paired_eval_change
from tests.helpers.png import assert_png
from tests.helpers.study_runs import run_scalars, write_run


def _mismatch(value, steps=8):
    return {"train/mismatch_abs_logprob_diff_mean": [value] * steps}


@pytest.fixture
def study(tmp_path):
    ref_eval = [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]
    bad_eval = [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]  # 3 lost against the reference
    runs = {
        "bf16": {"1": write_run(tmp_path / "r1", run_scalars(), {0: [0] * 10, 8: ref_eval}),
                 "2": write_run(tmp_path / "r2", run_scalars(), {0: [0] * 10, 8: ref_eval})},
        "tensorwise": {"1": write_run(tmp_path / "t1", run_scalars([0.05] * 8, entropy_end=2.0, no_number=0.3), {8: bad_eval}),
                       "2": write_run(tmp_path / "t2", run_scalars([0.03] * 8, entropy_end=1.8, no_number=0.3), {8: bad_eval})},
        "tensorwise_cc": {"1": write_run(tmp_path / "c1", {**run_scalars([0.002] * 8), "clip/low_at_limit": [1.0] * 6 + [0.0] * 2,
                                                     "clip/high_at_limit": [0.0] * 8}, {8: ref_eval})},
    }
    return tmp_path, runs


def test_verdict_names_the_overclipping_arm_and_the_paired_tests(study):
    _, runs = study
    arms = arm_figures(runs)
    lines = "\n".join(verdict_lines(arms, "bf16"))
    assert "tensorwise over-clip" in lines and "tensorwise_cc over-clip" not in lines
    assert "entropy surges" in lines and "output garbles" in lines  # drift 1.9 > 1.5; +30 points no-number
    assert "over-clipping from step 1, entropy surge from step 4" in lines  # entropy 1.0 at steps 1-3
    assert "diagnostic 4.0% [3.0%, 5.0%] -> 0.2% (with bounds calibrated on the same step: 0.1%)" in lines
    assert "L at a limit on 75.0% of steps, H on 0.0%." in lines
    # CC against the same recipe without it, same seeds (ref_eval against bad_eval: 3 gained, none lost)
    plain = paired_eval_change([bool(c) for c in [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]], [bool(c) for c in [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]])
    assert f"vs tensorwise on the same problems: seed 1: 3 gained / 0 lost, p = {plain['mcnemar_p']:.2g}; L at" in lines
    expected = paired_eval_change([bool(c) for c in [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]], [bool(c) for c in [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]])
    assert f"seed 1: 0 gained / 0 lost, p = {expected['mcnemar_p']:.2g}" in lines


def test_report_writes_markdown_and_figures(study):
    tmp_path, runs = study
    report = write_study_report(runs, tmp_path / "report", "bf16", "preamble", {"bf16/seed1": 600.0})
    text = report.read_text()
    assert "## Verdict" in text and "| tensorwise | 2 | 4.0% [3.0%, 5.0%]" in text
    assert "+0/−3 p=0.25" in text  # tensorwise vs bf16, each seed: 3 problems lost
    assert "all: +0/−6 p=0.031" in text  # both seeds' problems in one test: 2 x 0.5^6
    assert "| tensorwise_cc | 1 |" in text and "all:" not in text.split("| tensorwise_cc |")[1]  # one seed
    assert "10.0 min" in text
    for name in ("curves.png", "accuracy.png"):
        assert_png(tmp_path / "report" / name)


def test_reward_collapse_is_named_without_any_entropy_surge(tmp_path):
    """An arm whose answers run to the token limit and stop scoring (the study's tensorwise seed 1
    did: no entropy surge, no non-numeric output, reward 0.26 -> 0) is a failure the verdict names."""
    falling = [0.4, 0.3, 0.3, 0.2, 0.2, 0.1, 0.1, 0.1, 0.0, 0.0]  # first 5: 0.28, last 5: 0.06
    steady = [0.3] * 10
    runs = {"bf16": {"1": write_run(tmp_path / "r", run_scalars(steps=10, reward=steady), {10: [1, 0]})},
            "tensorwise": {"1": write_run(tmp_path / "t", run_scalars([0.05] * 10, steps=10, reward=falling, truncated=0.9),
                                     {10: [0, 0]})}}
    arms = arm_figures(runs)
    figures = arms["tensorwise"][0].values
    assert figures["reward_first"] == pytest.approx(0.28) and figures["reward"] == pytest.approx(0.06)
    assert figures["truncated"] == pytest.approx(0.9) and figures["collapsed"] == 1.0
    assert arms["bf16"][0].values["collapsed"] == 0.0
    lines = "\n".join(verdict_lines(arms, "bf16"))
    assert "**Reward collapse**" in lines and "tensorwise (1 of 1 seeds)" in lines and "bf16 (" not in lines
    assert "no entropy surge" in lines  # the collapse is not an entropy surge
    report = write_study_report(runs, tmp_path / "report", "bf16", "preamble").read_text()
    assert "| tensorwise | 1 | 5.0% | n/a | 1.0% | n/a | 1.000 → 1.000 | 0.0% | 0.0% | 10.0 | 90.0% | 0.280 → 0.060 |" in report


def test_report_shows_what_each_arm_writes_at_the_end(tmp_path):
    writer = SummaryWriter(str(tmp_path / "t" / "tb"))
    for step, text in ((1, "reward 1, stop: '42'"), (2, "reward 0, length: '4 4 4 4'\n\nreward 0, length: '5 5'")):
        writer.add_scalar("reward/mean", 0.5, step)
        writer.add_text("samples/responses", text, step)
    writer.close()
    runs = {"tensorwise": {"1": tmp_path / "t"}}
    assert run_figures(tmp_path / "t", "tensorwise", "1").last_responses[0] == 2
    report = write_study_report(runs, tmp_path / "report", "bf16", "preamble").read_text()
    section = report.split("## What each arm writes at the end")[1]
    assert "**tensorwise** (seed 1, step 2):" in section and "reward 0, length: '4 4 4 4'\n" in section
    assert "reward 1, stop" not in section


def test_diagnostic_pooled_over_negative_values_weights_each_step_by_its_count(tmp_path):
    """A step whose share is of 3 A<0 values weighs 3/93 of the pooled figure, not half of it; a run
    logged without clip/neg_values has no pooled figure."""
    scalars = run_scalars([0.0, 1 / 3] + [math.nan] * 6)
    scalars["clip/neg_values"] = [90.0, 3.0] + [0.0] * 6
    run = run_figures(write_run(tmp_path / "t", scalars, {8: [1, 0]}), "tensorwise", "1")
    assert run.values["overclip"] == pytest.approx(1 / 6)  # mean over the 2 measured steps
    assert run.values["overclip_pooled"] == pytest.approx(1 / 93) and run.values["neg_values"] == 93
    old = run_figures(write_run(tmp_path / "o", run_scalars([0.05] * 8), {8: [1, 0]}), "tensorwise", "1")
    assert math.isnan(old.values["overclip_pooled"])
    runs = {"tensorwise": {"1": tmp_path / "t"}, "tensorwise_cc": {"1": tmp_path / "o"}}
    report = write_study_report(runs, tmp_path / "report", "bf16", "preamble").read_text()
    assert "| tensorwise | 1 | 16.7% | 1.1% (93) |" in report and "| tensorwise_cc | 1 | 5.0% | n/a |" in report
    assert "tensorwise 16.7% (pooled over its A<0 values: 1.1%)" in report


def test_verdict_says_which_arms_match_the_reference_and_what_a_remedy_changes_against_plain_cc(study):
    """Issue 44's verdict: an arm matches bf16 when its median final accuracy is not below bf16's
    seed range and the paired McNemar has p > 0.05; a `<arm>_cc_<rule>` remedy is set against `<arm>_cc`
    on the same seeds."""
    tmp_path, runs = study
    runs["tensorwise_cc_noise"] = {"1": write_run(tmp_path / "n1", {**run_scalars([0.001] * 8), "clip/low_at_limit": [0.0] * 8,
                                                               "clip/high_at_limit": [0.0] * 8},
                                             {8: [1, 0, 1, 0, 1, 0, 1, 0, 1, 1]})}
    arms = arm_figures(runs)
    lines = verdict_lines(arms, "bf16")
    match = next(line for line in lines if line.startswith("- **Which arms match bf16**"))
    lost3 = paired_eval_change([bool(c) for c in [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]] * 2,
                               [bool(c) for c in [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]] * 2)["mcnemar_p"]
    assert "range 0.400 and paired McNemar p > 0.05, pooled over seeds): tensorwise_cc, tensorwise_cc_noise." in match
    assert f"tensorwise 0.100 (below, p = {lost3:.2g}, +0/-6)" in match  # pooled over its two seeds
    assert "tensorwise_cc_noise 0.600 (above, p = 0.5, +2/-0)" in match
    assert "tensorwise_cc 0.400 (inside, p = 1, +0/-0)" in match
    assert "Which beat it" not in match  # p 0.5: above the range but not shown better
    remedy = next(line for line in lines if "tensorwise_cc_noise (CC with the noise rule) against tensorwise_cc" in line)
    assert "diagnostic 0.2% -> 0.1%; accuracy 0.400 -> 0.600" in remedy
    assert "vs tensorwise_cc on the same problems: seed 1: 2 gained / 0 lost" in remedy
    assert "L at a limit on 0.0% of steps" in remedy and "(plain CC L at a limit on 75.0% of steps" in remedy


def test_a_run_that_never_updated_is_excluded_and_named(study):
    """train/grad_norm 0 on every step: the model never moved (the bf16 shadow defect), so the run
    is left out of every figure and the verdict names it; a run with one non-zero step stays."""
    tmp_path, runs = study
    runs["bf16"]["3"] = write_run(tmp_path / "r3", {**run_scalars(), "train/grad_norm": [0.0] * 8}, {0: [0] * 10, 8: [1] * 10})
    runs["bf16"]["4"] = write_run(tmp_path / "r4", {**run_scalars(), "train/grad_norm": [0.0] * 7 + [0.5]}, {0: [0] * 10, 8: [0] * 10})
    text = write_study_report(runs, tmp_path / "report", "bf16", "preamble").read_text()
    assert "- **Excluded**: bf16/seed3: train/grad_norm was 0 on every step" in text
    assert "| bf16 | 3 |" in text  # seeds 1, 2 and 4: seed 3 is in no figure


def test_an_arm_significantly_better_than_the_reference_is_said_to_beat_it(study):
    """Above the reference's seed range with a paired p <= 0.05 in its favour: not a 'match' (the
    two differ), but not a failure either; the verdict says it beats the reference. The same p
    against it (more lost) is neither."""
    tmp_path, runs = study
    good, ref_eval = [1] * 10, [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]  # 6 gained against the reference per seed
    runs["better"] = {seed: write_run(tmp_path / f"b{seed}", run_scalars([0.001] * 8), {8: good}) for seed in ("1", "2")}
    runs["worse"] = {seed: write_run(tmp_path / f"w{seed}", run_scalars([0.001] * 8), {8: [0] * 10}) for seed in ("1", "2")}
    arms = arm_figures(runs)
    match = next(line for line in verdict_lines(arms, "bf16") if line.startswith("- **Which arms match bf16**"))
    p = paired_eval_change([bool(c) for c in ref_eval] * 2, [True] * 20)["mcnemar_p"]
    assert p <= 0.05
    assert "Which beat it (median above that range, paired p <= 0.05 with more problems gained than lost): better." in match
    assert f"better 1.000 (above, p = {p:.2g}, +12/-0)" in match and "worse 0.000 (below" in match
    assert "pooled over seeds): tensorwise_cc. Which beat" in match  # better is not in the match list


def test_an_arm_inside_the_reference_range_but_ahead_on_the_same_problems_is_named_as_ahead(study):
    """Median inside the reference's seed range while the pooled paired test is in its favour
    (p <= 0.05): not a match (the two differ) and not a win by the range, so neither list holds it;
    the verdict names it as ahead instead of leaving it out of both."""
    tmp_path, runs = study
    runs["bf16"] = {"1": write_run(tmp_path / "r1", run_scalars(), {8: [1, 1] + [0] * 8}),
                    "2": write_run(tmp_path / "r2", run_scalars(), {8: [1] * 9 + [0]})}  # range [0.2, 0.9]
    runs["ahead"] = {"1": write_run(tmp_path / "a1", run_scalars([0.001] * 8), {8: [1] * 8 + [0] * 2}),  # +6/-0
                     "2": write_run(tmp_path / "a2", run_scalars([0.001] * 8), {8: [1] * 9 + [0]})}  # +0/-0
    match = next(line for line in verdict_lines(arm_figures(runs), "bf16")
                 if line.startswith("- **Which arms match bf16**"))
    assert "ahead 0.850 [0.800, 0.900] (inside, p = 0.031, +6/-0)" in match
    assert ("Which are inside that range and ahead of it on the same problems (paired p <= 0.05, "
            "more gained than lost): ahead.") in match
    assert "pooled over seeds): tensorwise_cc." in match and "Which beat it" not in match


def test_every_arm_is_also_compared_with_the_float32_reference(study):
    """A second reference (float32: no FP8, no bf16) gets its own "which arms match" line and table
    column, so an arm that beats bf16 can be told from a bf16 reference that falls short of full
    precision; without float32 runs neither appears."""
    tmp_path, runs = study
    without = write_study_report(runs, tmp_path / "without", "bf16", "preamble", also_against=("float32",)).read_text()
    assert "match float32" not in without and "paired vs float32" not in without
    good = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]  # bf16 gets 4 of 10 (ref_eval): 4 more here, none fewer
    runs["float32"] = {seed: write_run(tmp_path / f"f{seed}", run_scalars(), {8: good}) for seed in ("1", "2")}
    text = write_study_report(runs, tmp_path / "with", "bf16", "preamble", also_against=("float32",)).read_text()
    match = next(line for line in text.splitlines() if line.startswith("- **Which arms match float32**"))
    p_bf16 = paired_eval_change([bool(c) for c in good] * 2, [bool(c) for c in [1, 0, 1, 0, 1, 0, 1, 0, 0, 0]] * 2)
    assert f"bf16 0.400 (below, p = {p_bf16['mcnemar_p']:.2g}, +0/-8)" in match
    assert "float32 0.800 (above" in next(line for line in text.splitlines() if line.startswith("- **Which arms match bf16**"))
    assert "| paired vs bf16 | paired vs float32 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| tensorwise |"))
    assert row.endswith("all: +0/−6 p=0.031 | +0/−7 p=0.016, +0/−7 p=0.016, all: +0/−14 p=0.00012 |")  # 2 x 0.5^7, 2 x 0.5^14


def test_the_fp8_noise_quantile_is_each_runs_median_over_steps(tmp_path):
    """noise_q01: the median over steps of clip/fp8_noise_q0.01 per run, its spread over seeds in
    the table's 'FP8 noise q0.01' column; n/a for an arm that did not log it (bf16)."""
    evals = {0: [0] * 10, 8: [1] * 5 + [0] * 5}
    noisy = [{**run_scalars([0.05] * 8), "clip/fp8_noise_q0.01": [-0.3] * 3 + [-0.6] * 5},
             {**run_scalars([0.05] * 8), "clip/fp8_noise_q0.01": [-0.2] * 5 + [-0.9] * 3}]
    runs = {"bf16": {"1": write_run(tmp_path / "b1", run_scalars(), evals), "2": write_run(tmp_path / "b2", run_scalars(), evals)},
            "groupwise32": {str(seed): write_run(tmp_path / f"g{seed}", scalars, evals)
                            for seed, scalars in enumerate(noisy, 1)}}
    assert run_figures(runs["groupwise32"]["1"], "groupwise32", "1").values["noise_q01"] == pytest.approx(-0.6)
    assert run_figures(runs["groupwise32"]["2"], "groupwise32", "2").values["noise_q01"] == pytest.approx(-0.2)
    text = write_study_report(runs, tmp_path / "report", "bf16", "preamble").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| arm |")).split(" | ")
    column = header.index("FP8 noise q0.01")
    row = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert row["| groupwise32"][column] == "-0.400 [-0.600, -0.200]"
    assert row["| bf16"][column] == "n/a"


def test_the_gate_arm_is_compared_with_its_plain_and_cc_arms(tmp_path):
    """A `<recipe>_gate` arm gets its own verdict line: the diagnostic of its decisions (0), what its
    FP8 ratio would have over-clipped (clip/neg_overclip_fp8), accuracy and the paired tests against
    the plain and the CC arm on the same seeds."""
    plain_eval, better = [1] * 4 + [0] * 6, [1] * 8 + [0] * 2
    runs = {"bf16": {"1": write_run(tmp_path / "b1", run_scalars(), {0: [0] * 10, 8: plain_eval})},
            "groupwise32": {"1": write_run(tmp_path / "p1", run_scalars([0.08] * 8), {8: plain_eval})},
            "groupwise32_cc": {"1": write_run(tmp_path / "c1", run_scalars([0.02] * 8), {8: plain_eval})},
            "groupwise32_gate": {"1": write_run(tmp_path / "g1", {**run_scalars([0.0] * 8), "clip/neg_overclip_fp8": [0.06] * 8},
                                           {8: better})}}
    lines = "\n".join(verdict_lines(arm_figures(runs), "bf16"))
    line = next(x for x in lines.splitlines() if x.startswith("- **groupwise32_gate"))
    assert "diagnostic 8.0% -> 0.0% (its FP8 ratio would have over-clipped 6.0%); accuracy 0.400 -> 0.800" in line
    assert "seed 1: 4 gained / 0 lost" in line.split("against groupwise32_cc")[0]
    assert "against groupwise32_cc (accuracy 0.400, diagnostic 2.0%) vs groupwise32_cc on the same problems: seed 1: 4 gained / 0 lost" in line


def test_the_recipe_on_a_bf16_trainer_is_compared_with_the_recipe_on_float32(tmp_path):
    """A `<recipe>_bf16` arm (the FP8 recipe on a bf16 trainer) gets a verdict line against
    `<recipe>` on the same seeds: diagnostic, mismatch (the reference's beside it), length limit,
    accuracy, paired test; `bf16` itself and a `bf16_*` probe arm are no such arm."""
    plain_eval, better = [1] * 2 + [0] * 8, [1] * 7 + [0] * 3
    runs = {"bf16": {"1": write_run(tmp_path / "b1", {**run_scalars(), **_mismatch(0.01)}, {0: [0] * 10, 8: better})},
            "bf16_low_lr": {"1": write_run(tmp_path / "b2", run_scalars(), {0: [0] * 10, 8: better})},
            "groupwise32": {"1": write_run(tmp_path / "p1", {**run_scalars([0.05] * 8, truncated=0.9), **_mismatch(0.0)},
                                      {8: plain_eval})},
            "groupwise32_bf16": {"1": write_run(tmp_path / "f1", {**run_scalars([0.03] * 8, truncated=0.1), **_mismatch(0.04)},
                                           {8: better})}}
    lines = [x for x in verdict_lines(arm_figures(runs), "bf16") if "on a bf16 trainer" in x]
    assert len(lines) == 1 and lines[0].startswith("- **groupwise32_bf16 (the same FP8 recipe on a bf16 trainer")
    assert ("diagnostic 5.0% -> 3.0% (its shadow is the bf16 forward); rollout/trainer mismatch 0.0000 -> 0.0400 "
            "(mean |Δ log p| a token; bf16 0.0100); cut at the length limit 90.0% -> 10.0%; accuracy 0.200 -> 0.700; "
            "vs groupwise32 on the same problems: seed 1: 5 gained / 0 lost") in lines[0]


def test_an_arm_with_tis_is_compared_with_the_same_arm_without_it(tmp_path):
    """A `<arm>_tis` arm gets a verdict line against `<arm>` on the same seeds (the mismatch, the
    length limit, accuracy, the paired test, pooled over seeds); `bf16_fp8block_tis`, whose base arm
    the study does not run, gets none."""
    plain_eval, better = [1] * 3 + [0] * 7, [1] * 6 + [0] * 4
    runs = {"bf16": {s: write_run(tmp_path / f"b{s}", {**run_scalars(), **_mismatch(0.01 * int(s))}, {0: [0] * 10, 8: better})
                     for s in "12"},
            "bf16_fp8block_tis": {"1": write_run(tmp_path / "t1", run_scalars(), {8: better})},
            "groupwise32_bf16": {s: write_run(tmp_path / f"p{s}", {**run_scalars(truncated=0.5), **_mismatch(0.06)},
                                         {8: plain_eval}) for s in "12"},
            "groupwise32_bf16_tis": {s: write_run(tmp_path / f"c{s}", {**run_scalars(truncated=0.25), **_mismatch(0.02)},
                                             {8: better}) for s in "12"}}
    lines = [x for x in verdict_lines(arm_figures(runs), "bf16") if "with TIS against" in x]
    assert len(lines) == 1 and lines[0].startswith("- **groupwise32_bf16_tis (groupwise32_bf16 with TIS against the "
                                                   "rollout/trainer mismatch) against groupwise32_bf16, same seeds**")
    assert ("mismatch 0.0600 -> 0.0200 (mean |Δ log p| a token; bf16 0.0150 [0.0100, 0.0200]); cut at the length limit 50.0% -> 25.0%; "
            "accuracy 0.300 -> 0.600; vs groupwise32_bf16 on the same problems:") in lines[0]
    assert "all seeds: 6 gained / 0 lost" in lines[0]


def test_a_probe_is_compared_with_the_references_that_have_the_same_change(tmp_path):
    """Arms that share a change with a reference arm (`bf16_low_lr`, `float32_low_lr`,
    `groupwise32_low_lr`) form a probe: one verdict line compares each of its arms with the probe's
    references on the same seeds, and a remedy (`groupwise32_gate_low_lr`) with its recipe's plain
    arm under the same change; an arm whose suffix no other arm shares (bf16_fp8block_tis) is no probe."""
    ten = {"low": [1] * 3 + [0] * 7, "mid": [1] * 6 + [0] * 4, "high": [1] * 9 + [0], "top": [1] * 10}
    runs = {name: {"1": write_run(tmp_path / name, run_scalars([0.01] * 8), {0: [0] * 10, 8: ten[level]})}
            for name, level in (("bf16", "mid"), ("float32", "low"), ("groupwise32", "low"), ("bf16_fp8block_tis", "mid"),
                                ("groupwise32_gate", "low"), ("bf16_low_lr", "mid"), ("float32_low_lr", "high"),
                                ("groupwise32_low_lr", "high"), ("groupwise32_gate_low_lr", "top"))}
    lines = verdict_lines(arm_figures(runs), "bf16", ("float32",))
    probes = [line for line in lines if line.startswith("- **Probe")]
    assert len(probes) == 1 and probes[0].startswith("- **Probe `_low_lr`")
    line = probes[0]
    assert ("groupwise32_low_lr 0.900: vs bf16_low_lr on the same problems: seed 1: 3 gained / 0 lost, p = 0.25 "
            "(bf16_low_lr 0.600); vs float32_low_lr on the same problems: seed 1: 0 gained / 0 lost") in line
    assert "float32_low_lr 0.900: vs bf16_low_lr on the same problems: seed 1: 3 gained / 0 lost" in line
    assert "bf16_low_lr 0.600:" not in line  # the probe's first reference is not compared with itself
    gate = line.split("groupwise32_gate_low_lr 1.000: ")[1]
    assert gate.startswith("vs bf16_low_lr on the same problems: seed 1: 4 gained / 0 lost")
    assert gate.endswith("vs groupwise32_low_lr on the same problems: seed 1: 1 gained / 0 lost, p = 1 (groupwise32_low_lr 0.900).")
    assert line.count("vs groupwise32_low_lr on") == 1  # the plain arm is no remedy of itself
    del runs["bf16"], runs["float32"]  # a partial report (`--settings`): the references' own arms absent
    line = next(line for line in verdict_lines(arm_figures(runs), "bf16", ("float32",)) if line.startswith("- **Probe"))
    assert "groupwise32_low_lr 0.900: vs bf16_low_lr on the same problems: seed 1: 3 gained / 0 lost" in line
    del runs["bf16_low_lr"], runs["float32_low_lr"]
    assert not [line for line in verdict_lines(arm_figures(runs), "bf16", ("float32",)) if line.startswith("- **Probe")]
