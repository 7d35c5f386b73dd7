"""bench/clip_rules.py: the replay of a run's recorded calibrations, on records written here the
way the trainer writes them (calibration/step_<k>.safetensors, config.yaml)."""
import pytest
import torch
import yaml
from safetensors.torch import save_file

from bench import clip_rules as bench
from megatron_fp8rl.rl.calibrated_clipping import ClipBounds, ClipLimits, clip_diagnostic


def _run(path, steps, smoothing=0.0):
    """A run directory with `steps` records of heavy-tailed FP8 noise (α = 0: the shadow clips no
    A<0 value), the configured interval [0.8, 1.28] and the default limits."""
    (path / "calibration").mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {
        "clip": {"low": 0.2, "high": 0.28},
        "calibration": {"smoothing": smoothing, "limits": {"low_min": 0.5, "low_max": 0.95, "high_min": 1.05,
                                                           "high_max": 1.5}}}}))
    generator = torch.Generator().manual_seed(len(str(path)))
    for step in range(1, steps + 1):
        adv = torch.where(torch.rand(2000, generator=generator) < 0.5, -1.0, 1.0).double()
        shadow = (1 + 0.03 * torch.randn(2000, generator=generator)).double()
        noise = 0.1 * torch.randn(2000, generator=generator).double()
        noise[::200] = -1.0  # 0.5% of the values far below
        save_file({"ratio": shadow * torch.exp(noise), "shadow_ratio": shadow, "advantages": adv},
                  str(path / "calibration" / f"step_{step:05d}.safetensors"))
    return path


def test_plain_bounds_score_what_the_diagnostic_counts_on_every_step_but_the_first(tmp_path):
    run = _run(tmp_path / "moderate2" / "groupwise32" / "seed1", 4)
    configured, limits, smoothing = bench.run_settings(run)
    assert configured == ClipBounds(0.8, 1.28) and limits == ClipLimits() and smoothing == 0.0
    values = bench.records(run)
    score = bench.replay(values, None, configured, limits, smoothing)
    expected = [clip_diagnostic(v["ratio"], v["shadow_ratio"], v["advantages"], configured, configured)
                for v in values[1:]]
    negatives = [int((v["advantages"] < 0).sum()) for v in values[1:]]
    assert score.negatives == sum(negatives) and score.lows == [0.8] * 3
    assert score.over == sum(round(d["neg_overclip"] * n) for d, n in zip(expected, negatives))
    assert score.over / score.negatives > 0.01  # the tail and N(0, 0.1) below log 0.8: plain FP8 over-clips


def test_the_rules_differ_as_designed_on_heavy_tailed_noise(tmp_path):
    """The quantile rule at α = 0 sits at its floor; the budget rule calibrates inside the limits
    and over-clips within about its budget out of sample; the noise rule lies between."""
    run = _run(tmp_path / "moderate2" / "groupwise32" / "seed1", 5)
    configured, limits, smoothing = bench.run_settings(run)
    values = bench.records(run)
    quantile = bench.replay(values, bench.RULES["quantile"], configured, limits, smoothing)
    budget = bench.replay(values, bench.RULES["budget τ=0.01"], configured, limits, smoothing)
    noise = bench.replay(values, bench.RULES["noise δ=0.01"], configured, limits, smoothing)
    assert quantile.lows == [0.5] * 4 and quantile.at_limit == 4
    floor = bench.replay(values, bench.RULES["floor"], configured, limits, smoothing)
    assert floor.lows == [0.5] * 4 and floor.over == quantile.over  # the quantile rule there: no better than the floor
    assert budget.at_limit == 0 and all(0.5 < low < 0.8 for low in budget.lows)
    assert budget.over / budget.negatives <= 0.015
    assert noise.lows[0] < budget.lows[0]


def test_the_bench_prints_one_row_per_arm_and_rule_and_refuses_a_tree_without_records(tmp_path, capsys):
    for seed in (1, 2):
        _run(tmp_path / "moderate2" / "groupwise32" / f"seed{seed}", 3)
    assert bench.main([str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| moderate2/groupwise32 |")]
    assert len(rows) == len(bench.RULES) and all(row.split(" | ")[1] == "2" for row in rows)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no calibration records"):
        bench.main([str(tmp_path / "empty")])
