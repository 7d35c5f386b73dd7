"""The stability study's runner and the report on a short real run: a tiny random Llama, 2 RL
steps, the real SGLang engine and Megatron actor, two arms (a float32 trainer; the study's
tensorwise FP8 arm, whose shadow forwards measure the diagnostic every step). The study report,
every per-run plot, the per-layer FP8 heatmap of the FP8 run, and the markdown come out.

Starts torchrun twice, one after the other: 1 worker each, which starts one SGLang engine
(2 more processes).
"""
import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_fp8rl.study.runner import main as stability_main
from tests.helpers.png import assert_png
from tests.helpers.tiny_models import build_tiny_rl_inputs, held_out_prompts

SETTINGS = ("exact", "tensorwise")
FIGURES = ("reward", "entropy", "mismatch", "k3_kl", "ratio", "clip_fractions")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    model, prompts = build_tiny_rl_inputs(root)
    code = stability_main([
        "--quick", "--study-dir", str(root / "study"), "--model", str(model),
        "--settings", ",".join(SETTINGS),
        "--add", "exact:model.fp8=none,rollout.fp8=none", "--seeds", "1",
        "--set", f"data.train={prompts}", "--set", f"data.eval={held_out_prompts(prompts)}",
        "--set", "data.reward=tests.trainer.reward_fns:first_word_even", "--set", "train.lr=1e-3",
        "--timeout", "900"])
    assert code == 0
    return root / "study"


def _scalars(run_dir):
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_study_writes_every_plot_and_the_report(study):
    out = study / "report" / "runs"
    written = {p.stem for p in out.glob("*.png")}
    assert {*FIGURES, "fp8_tensorwise", "calibrated_clipping"} <= written  # (more with noise/ tags)
    assert "fp8_exact" not in written  # no heatmap for the float32 trainer
    for name in written:
        assert_png(out / f"{name}.png")
    text = (out / "report.md").read_text()
    assert set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)) == {f"{n}.png" for n in written}
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "tensorwise" in rows["tensorwise"] and "none" in rows["exact"]
    assert set(json.loads((study / "timings.json").read_text())) == {f"{s}/seed1" for s in SETTINGS}
    study_text = (study / "report" / "report.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in study_text.splitlines() if line.startswith("| ")}
    assert rows["exact"][3].strip() == "n/a"  # no FP8 ratio, no diagnostic
    # the tensorwise arm's shadow forwards ran every step (its diagnostic is NaN, so not logged, on
    # a step whose calibrated mini-batch has no negative-advantage token)
    assert _scalars(study / "tensorwise" / "seed1")["clip/calibrations"] == [1.0, 2.0]
    for name in ("curves", "accuracy"):
        assert_png(study / "report" / f"{name}.png")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_run_logs_the_ratio_quantiles_the_report_plots(study):
    exact, fp8 = _scalars(study / "exact" / "seed1"), _scalars(study / "tensorwise" / "seed1")
    for scalars in (exact, fp8):
        assert len(scalars["train/mismatch_ratio_p50"]) == 2
        for step in range(2):
            values = [scalars[f"train/mismatch_ratio_{q}"][step] for q in ("min", "p10", "p50", "p90", "max")]
            assert values == sorted(values)
    # float32 trainer and rollout agree: every token's ratio is 1 to within 1e-3
    assert all(abs(v - 1) < 1e-3 for q in ("min", "max") for v in exact[f"train/mismatch_ratio_{q}"])
    # the FP8 trainer's noise widens the ratio distribution
    assert max(fp8["train/mismatch_ratio_max"]) - min(fp8["train/mismatch_ratio_min"]) > 1e-3
    assert any(tag.endswith("linear_fc1.input/saturated_fraction") for tag in fp8)


def test_finished_runs_keep_their_logs_not_the_weight_folders(study):
    """The study removes what the report never reads (study/runner.py BULKY) once a run finished."""
    from megatron_fp8rl.study.runner import BULKY

    run = study / "tensorwise" / "seed1"
    assert (run / "summary.json").is_file() and (run / "tb").is_dir() and (run / "eval_correct.json").is_file()
    assert not [name for name in BULKY if (run / name).exists()], sorted(p.name for p in run.iterdir())
