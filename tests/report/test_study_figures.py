"""Each run's figures from its directory (report/study_figures.py): what `run_figures` reads from the
logs `train` writes, and the seed statistics built on them (the spread, the paired tests pooled over
seeds, where an arm stands against the reference's seed range)."""
import math
import time

import pytest

from megatron_fp8rl.report.study_figures import (
    RunFigures, fmt_spread, pooled_test, run_figures, seed_pairs, spread, standing,
)
from megatron_fp8rl.rl.metrics import paired_eval_change
from tests.helpers.study_runs import run_scalars, write_run


def test_run_figures_read_the_logs(tmp_path):
    run = write_run(tmp_path / "t", run_scalars([0.05] * 8, entropy_end=2.0, no_number=0.3), {8: [1] + [0] * 9})
    figures = run_figures(run, "tensorwise", "1")
    assert figures.values["overclip"] == pytest.approx(0.05)
    assert figures.values["entropy_first"] == 1.0 and figures.values["entropy_drift"] == pytest.approx(2.0)
    assert figures.values["no_number"] == pytest.approx(0.3) and figures.values["accuracy"] == pytest.approx(0.1)
    bf16 = write_run(tmp_path / "b", run_scalars(), {0: [0] * 10, 8: [1] * 10})
    assert math.isnan(run_figures(bf16, "bf16", "1").values["overclip"])  # no FP8 ratio


def test_a_runs_step_time_sums_its_phases_and_its_start_comes_from_its_event_file(tmp_path):
    """s/step: rollout + advantages + recompute + train + sync of each step (evals apart), averaged over
    steps; `started`: the unix time tensorboard wrote into the event file's name when the run began."""
    before = time.time()
    phases = {"time/rollout_s": [10.0, 12.0], "time/advantages_s": [0.0, 0.0], "time/recompute_s": [4.0, 4.0],
              "time/train_s": [20.0, 30.0], "time/sync_s": [1.0, 1.0], "time/eval_s": [99.0, 99.0]}
    figures = run_figures(write_run(tmp_path / "r", {**run_scalars(steps=2), **phases}, {0: [0, 1], 2: [1, 1]}), "a", "1")
    assert figures.values["step_s"] == pytest.approx((35.0 + 47.0) / 2)
    assert before - 1 <= figures.started <= time.time()
    assert math.isnan(run_figures(write_run(tmp_path / "s", run_scalars(steps=2), {0: [0, 1]}), "a", "1").values["step_s"])


def _figures(arm: str, seed: str, correct: list[int]) -> RunFigures:
    return RunFigures(arm, seed, {"accuracy": sum(correct) / len(correct)}, {}, correct)


def test_the_pooled_test_is_one_mcnemar_over_every_shared_seeds_problems():
    """Seeds are paired by name; a seed the reference lacks, or one scored on other problems, is left
    out; the pooled test concatenates the pairs' problems, each run against its own seed's reference."""
    arms = {"bf16": [_figures("bf16", "1", [1, 0, 0, 0]), _figures("bf16", "2", [1, 1, 0, 0])],
            "fp8": [_figures("fp8", "1", [1, 1, 1, 0]), _figures("fp8", "2", [0, 1, 1, 1]),
                    _figures("fp8", "3", [1, 1, 1, 1])]}
    arms["fp8"].append(_figures("fp8", "2b", [1] * 6))
    pairs = seed_pairs(arms, "bf16", "fp8")
    assert [(ref.seed, run.seed) for ref, run in pairs] == [("1", "1"), ("2", "2")]
    assert pooled_test(pairs) == paired_eval_change([True, False, False, False, True, True, False, False],
                                                    [True, True, True, False, False, True, True, True])
    assert pooled_test(pairs)["gained"] == 4 and pooled_test(pairs)["lost"] == 1
    arms["bf16"].append(_figures("bf16", "3", [1] * 5))  # seed 3 on 5 problems, the arm's on 4
    assert [run.seed for _, run in seed_pairs(arms, "bf16", "fp8")] == ["1", "2"]


@pytest.mark.parametrize("median, test, expected", [
    (0.40, {"mcnemar_p": 0.9, "gained": 3, "lost": 3}, ("below", "short")),
    (0.55, None, ("inside", "short")),
    (0.55, {"mcnemar_p": 0.3, "gained": 2, "lost": 5}, ("inside", "matches")),
    (0.55, {"mcnemar_p": 0.01, "gained": 2, "lost": 12}, ("inside", "short")),
    (0.55, {"mcnemar_p": 0.01, "gained": 12, "lost": 2}, ("inside", "ahead")),
    (0.70, {"mcnemar_p": 0.01, "gained": 12, "lost": 2}, ("above", "beats")),
    (0.70, {"mcnemar_p": 0.5, "gained": 6, "lost": 4}, ("above", "matches")),
])
def test_standing_against_the_reference_seed_range(median, test, expected):
    """The match rule: below the reference's [min, max] is short whatever the test says; inside or
    above, p > 0.05 matches, a significant gain is ahead (inside) or beats (above), a significant
    loss is short."""
    assert standing(median, (0.5, 0.45, 0.6), test) == expected


def test_spread_and_its_text_skip_missing_values():
    assert spread([0.3, math.nan, 0.1, 0.2]) == (0.2, 0.1, 0.3)
    assert all(math.isnan(v) for v in spread([math.nan]))
    assert fmt_spread((0.2, 0.1, 0.3)) == "0.200 [0.100, 0.300]"
    assert fmt_spread((0.05, 0.05, 0.05), percent=True) == "5.0%"
    assert fmt_spread((math.nan,) * 3) == "n/a"
