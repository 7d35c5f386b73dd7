"""Which evals a run makes on how many held-out problems (all at the start and the end,
data.eval_interim_size in between), their per-problem record and the paired metrics."""
import json

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.rl.metrics import paired_eval_change
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.evaluation import EVAL_RECORD, eval_count, eval_due, eval_metrics, record_eval


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["model.hf_path=/x", "train.steps=10", "train.eval_every=4", *overrides])


def test_evals_run_at_the_start_every_eval_every_steps_and_after_the_last():
    assert [step for step in range(11) if eval_due(_cfg(), step)] == [0, 4, 8, 10]
    assert not any(eval_due(_cfg("train.eval_every=0"), step) for step in range(11))


def test_start_and_end_evals_score_every_problem_and_interim_ones_the_first_n():
    cfg = _cfg("data.eval_interim_size=100")
    assert {step: eval_count(cfg, step) for step in (0, 4, 8, 10)} == {0: 500, 4: 100, 8: 100, 10: 500}
    assert {eval_count(_cfg(), step) for step in (0, 4, 8, 10)} == {500}


def test_an_interim_eval_is_paired_with_the_start_evals_first_problems():
    start = [True, False, False, True, False, True]
    interim = [True, True, False]
    metrics = eval_metrics(interim, start)
    assert metrics["eval/accuracy"] == 2 / 3
    # problem 1 gained, none lost: the pairing is with start[:3], not the whole start list
    assert (metrics["eval/gained"], metrics["eval/lost"]) == (1, 0)
    assert metrics["eval/mcnemar_p"] == paired_eval_change(start[:3], interim)["mcnemar_p"]
    assert eval_metrics(interim, None) == {"eval/accuracy": 2 / 3}


def test_each_eval_adds_its_per_problem_results_to_the_record(tmp_path):
    record_eval(tmp_path, 0, [True, False, True])
    record_eval(tmp_path, 4, [False])
    assert json.loads((tmp_path / EVAL_RECORD).read_text()) == {"0": [1, 0, 1], "4": [0]}
    assert not list(tmp_path.glob("*.partial"))
