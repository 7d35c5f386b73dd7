"""The report generator on tensorboard logs written here with SummaryWriter (fast, no training):
every figure is a real PNG, tables hold the logged numbers, FP8 heatmaps only for FP8 runs,
bad run directories fail with a clear error. Rendering is the cost (~5 s a report on a 2-core
box), so the module renders one report, through the CLI; the verdict cases read `verdict()`,
the function that writes that section, without plotting."""
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from megatron_fp8rl.cli import main
from megatron_fp8rl.report.logs import ReportError, load_run
from megatron_fp8rl.report.markdown import final_figures, verdict
from megatron_fp8rl.report.plots import fp8_layer_matrix
from tests.helpers.png import assert_png

LAYERS = [f"module.decoder.layers.{i}.mlp.linear_fc1" for i in (0, 1, 2, 10)]
RATIO_NAMES = ("min", "p01", "p10", "p50", "p90", "p99", "max")


def write_fake_run(run_dir: Path, *, steps: int, fp8: bool, mismatch: float) -> None:
    """A run directory as `megatron-fp8rl train` leaves it: config.yaml and tb/ scalars."""
    run_dir.mkdir(parents=True)
    config = {"model": {"fp8": "calibrated" if fp8 else "none"}, "rollout": {"fp8": "none"},
              "algorithm": {"correction": "tis"}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    writer = SummaryWriter(str(run_dir / "tb"))
    writer.add_scalar("eval/accuracy", 0.1, 0)
    for step in range(1, steps + 1):
        scalars = {"reward/mean": 0.1 * step, "reward/accuracy": 0.05 * step, "train/entropy": 2.0 - 0.1 * step,
                   "train/mismatch_abs_logprob_diff_mean": mismatch * step,
                   "train/mismatch_abs_logprob_diff_max": 4 * mismatch * step,
                   "train/mismatch_k3_kl": mismatch ** 2, "train/clip_frac_high": 0.01 * step,
                   "train/clip_frac_low": 0.0, "train/tis_clip_frac": 0.002, "train/ratio_min": 0.9,
                   "train/ratio_mean": 1.0, "train/ratio_max": 1.1}
        for index, name in enumerate(RATIO_NAMES):
            scalars[f"train/mismatch_ratio_{name}"] = math.exp(mismatch * (index - 3))
        if fp8:
            for layer_index, layer in enumerate(LAYERS):
                for role in ("input", "weight", "grad_output"):
                    scalars[f"fp8/{layer}.{role}/saturated_fraction"] = 0.001 * layer_index * step
                    scalars[f"fp8/{layer}.{role}/underflow_fraction"] = 0.01
                    scalars[f"fp8/{layer}.{role}/bound"] = 3.0
            scalars["fp8/input/saturated_fraction_mean"] = 0.0042
            scalars.update({"noise/clip_noise_only_frac": 0.05, "noise/clip_policy_only_frac": 0.01,
                            "noise/clip_both_frac": 0.002, "clip/low": 0.8 - 0.01 * step, "clip/high": 1.3,
                            "clip/neg_overclip_before": 0.05, "clip/neg_overclip_after": 0.01,
                            "noise/train_forward_abs_delta_mean": 0.0})
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
    writer.add_scalar("eval/accuracy", 0.3, steps)
    writer.close()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_fake_run(root / "bf16", steps=4, fp8=False, mismatch=1e-3)
    write_fake_run(root / "fp8", steps=4, fp8=True, mismatch=0.1)
    return root / "bf16", root / "fp8"


@pytest.fixture(scope="module")
def cli_report(two_runs, tmp_path_factory) -> Path:
    """`megatron-fp8rl report bf16 fp8 --out <dir>`; returns the markdown's path."""
    out = tmp_path_factory.mktemp("report")
    assert main(["report", str(two_runs[0]), str(two_runs[1]), "--out", str(out)]) == 0
    return out / "report.md"


def test_cli_report_writes_every_plot_and_the_markdown(cli_report):
    out, report = cli_report.parent, cli_report
    expected = {"reward", "entropy", "mismatch", "k3_kl", "ratio", "clip_fractions", "clip_attribution", "fp8_fp8",
                "calibrated_clipping", "training_forward_noise"}
    pngs = {p.stem for p in out.glob("*.png")}
    assert pngs == expected  # no heatmap for the run without an FP8 trainer
    for name in expected:
        assert_png(out / f"{name}.png")
    text = report.read_text()
    embedded = set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text))
    assert embedded == {f"{name}.png" for name in expected}
    for table in re.findall(r"(?:^\|.*\n)+", text, re.M):  # every row has the header's columns
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert len(widths) == 1, table
    # the final-figures table holds the logged numbers: mean |Δlogp| of the FP8 run is
    # 0.1 * mean(1..4) = 0.25, its final reward 0.4
    fp8_row = next(line for line in text.splitlines() if line.startswith("| fp8 |") and "0.25" in line)
    assert "calibrated" in fp8_row
    assert "| 0.4 |" in next(line for line in text.splitlines() if line.startswith("| fp8 |"))
    assert "## Verdict" in text


def test_final_figures_numbers(two_runs):
    figures = final_figures(load_run(two_runs[1]))
    assert figures["steps"] == 4
    assert figures["reward_final"] == pytest.approx(0.4)
    assert figures["abs_logprob_diff_mean"] == pytest.approx(0.25)
    assert figures["eval_accuracy"] == "0.1 → 0.3"
    assert figures["entropy_max_over_first"] == pytest.approx(1.0)
    assert figures["ratio_p99_mean"] == pytest.approx(math.exp(0.2), rel=1e-6)
    assert figures["fp8_input_saturated_mean"] == pytest.approx(0.0042)
    assert final_figures(load_run(two_runs[0]))["fp8_input_saturated_mean"] is None


def test_fp8_heatmap_rows_follow_layer_order(two_runs):
    layers, steps, matrix = fp8_layer_matrix(load_run(two_runs[1]), "input", "saturated_fraction")
    assert layers == LAYERS  # layer 10 after layer 2 (numeric order, not string order)
    assert list(steps) == [1, 2, 3, 4]
    np.testing.assert_allclose(matrix[3], [0.003 * s for s in (1, 2, 3, 4)], rtol=1e-6)


def test_bad_run_directories_name_the_path(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"empty: no tensorboard logs"):
        load_run(tmp_path / "empty")


def write_curve_run(run_dir: Path, *, model_fp8: str, rollout_fp8: str, accuracy: dict, entropy: list,
                    mismatch: float, eval_size: int = 100) -> None:
    run_dir.mkdir(parents=True)
    config = {"model": {"fp8": model_fp8}, "rollout": {"fp8": rollout_fp8},
              "algorithm": {"correction": "none"}, "data": {"eval_size": eval_size}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    writer = SummaryWriter(str(run_dir / "tb"))
    for step, value in accuracy.items():
        writer.add_scalar("eval/accuracy", value, step)
    for step, value in enumerate(entropy, start=1):
        writer.add_scalar("reward/mean", 0.1, step)
        writer.add_scalar("train/entropy", value, step)
        writer.add_scalar("train/mismatch_abs_logprob_diff_mean", mismatch, step)
    writer.close()


def test_verdict_compares_runs_at_the_last_common_step(tmp_path):
    # "long" is best at step 6, but only steps <= 4 are comparable: there "steady" leads
    write_curve_run(tmp_path / "steady", model_fp8="none", rollout_fp8="none", accuracy={0: 0.2, 2: 0.3, 4: 0.4},
                    entropy=[1.0, 1.05, 0.95, 1.1], mismatch=0.01)
    write_curve_run(tmp_path / "long", model_fp8="calibrated", rollout_fp8="aligned",
                    accuracy={0: 0.2, 2: 0.35, 4: 0.3, 6: 0.9}, entropy=[1.0, 1.02, 0.99, 1.01, 3.0, 3.0],
                    mismatch=0.015)
    write_curve_run(tmp_path / "surging", model_fp8="te_delayed", rollout_fp8="blockwise",
                    accuracy={0: 0.2, 4: 0.1}, entropy=[1.0, 1.5, 2.0, 1.2], mismatch=0.2)
    text = "\n".join(verdict([load_run(tmp_path / n) for n in ("steady", "long", "surging")]))
    assert text.startswith("## Verdict") and "Compared at step 4" in text
    assert "Highest held-out greedy accuracy: `steady` (0.400; all: steady 0.400, long 0.300, surging 0.100)" in text
    # drift: long max(|.02|,|-.01|,|.01|)/1 = 0.02 (its step-5 surge is past step 4); steady 0.1; surging 1.0
    assert "Smallest entropy drift" in text and "`long` (0.020; all: long 0.020, steady 0.100, surging 1.000)" in text
    assert "none/none 0.01 (1.00x), calibrated/aligned 0.015 (1.50x), te_delayed/blockwise 0.2 (20.00x)" in text
    se = math.sqrt(np.mean([0.4, 0.3, 0.1]) * (1 - np.mean([0.4, 0.3, 0.1])) / 100)
    assert f"binomial standard error of {se:.3f}" in text


def test_entropy_drift_counts_a_collapse_as_drift(tmp_path):
    from megatron_fp8rl.report.markdown import entropy_drift

    write_curve_run(tmp_path / "collapsing", model_fp8="none", rollout_fp8="none", accuracy={0: 0.2},
                    entropy=[2.0, 1.6, 0.8, 0.5, 4.0], mismatch=0.01)
    run = load_run(tmp_path / "collapsing")
    assert entropy_drift(run, 4) == pytest.approx(0.75)  # |0.5 - 2.0| / 2.0; step 5 is past 4
    assert entropy_drift(run, 5) == pytest.approx(1.0)


def test_no_verdict_for_a_single_run(two_runs):
    assert verdict([load_run(two_runs[0])]) == []
