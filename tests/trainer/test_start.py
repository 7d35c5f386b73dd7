"""What a run loads before its first step: the held-out problems are fixed whatever train.seed is,
500 of the built-in task by default, and never training prompts (a run refuses files that share
one, naming it)."""
import json

import pytest

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.data.records import DatasetError
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.start import held_out_records, run_records, step_cost_metrics, training_records


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


def test_builtin_held_out_set_is_500_problems_identical_for_every_train_seed():
    first, second = _cfg("train.seed=1"), _cfg("train.seed=2")
    assert first.data.eval_size == 500
    held_out = held_out_records(first)
    assert len(held_out) == 500 and len({r.id for r in held_out}) == 500
    assert held_out == held_out_records(second)
    # the training draw still follows train.seed
    assert [r.id for r in training_records(first)] != [r.id for r in training_records(second)]


def test_held_out_set_follows_data_eval_seed_only():
    assert held_out_records(_cfg("data.eval_seed=7")) != held_out_records(_cfg())
    assert held_out_records(_cfg("data.eval_seed=7", "train.seed=3")) == held_out_records(_cfg("data.eval_seed=7"))


def test_builtin_run_records_are_disjoint():
    train, held_out = run_records(_cfg("data.train_size=6000", "data.arithmetic_ops=[add,sub,mul]"))
    assert len(train) == 6000 and len(held_out) == 500
    assert not {r.messages[-1]["content"] for r in train} & {r.messages[-1]["content"] for r in held_out}


def test_a_held_out_file_sharing_training_prompts_is_refused_naming_them(tmp_path):
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)]
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows[3:]))
    cfg = _cfg(f"data.train={train}", f"data.eval={held_out}")
    with pytest.raises(DatasetError, match=rf"^1 of 3 held-out problems \(data.eval={held_out}\) are also training "
                                           rf"prompts \(data.train={train}\): {held_out}:1 \(training {train}:4\): "
                                           r"'What is 3\+1\?'"):
        run_records(cfg)


def test_too_few_builtin_held_out_problems_name_data_eval_size():
    # mul and mul2 hold 18 + 317 = 335 problems in the eval split, fewer than the default 500
    with pytest.raises(DatasetError, match=r"^data.eval_size=500: asked for 500 eval problems but mul\+mul2 has only"):
        held_out_records(_cfg("data.arithmetic_ops=[mul,mul2]"))


@pytest.mark.parametrize("overrides, extra_forward", [
    ((), -1.0),  # one mini-batch: no recompute, its first forward is at θ_old
    (("train.mini_batches=4",), 0.0),  # plain FP8: recompute + forward + backward
    (("train.mini_batches=4", "model.fp8=groupwise32", "algorithm.calibration.mode=gate"), 1.75),  # (2M - 1)/M shadow forwards
    (("train.mini_batches=2", "model.fp8=groupwise32", "algorithm.calibration.mode=gate"), 1.5),
])
def test_the_logged_step_cost_counts_the_run_configs_extra_forwards(overrides, extra_forward):
    metrics = step_cost_metrics(_cfg(*overrides))
    assert metrics["cost/extra_forward"] == extra_forward
    assert metrics["cost/extra_backward"] == 0.0
    assert metrics["cost/extra_share"] == extra_forward / 4
