"""The built-in arithmetic task: correct answers, disjoint deterministic splits, balanced ops."""
import pytest

from megatron_fp8rl.data.arithmetic import arithmetic_records, problem_universe


def test_answers_are_correct():
    for record in arithmetic_records("train", 60, ops=("add", "sub", "mul"), seed=1):
        question = record.messages[-1]["content"]
        expression = question.removeprefix("What is ").split("?")[0]
        assert str(eval(expression)) == record.answer, question  # noqa: S307 (our own digits)


def test_splits_disjoint_and_cover_universe():
    ops = ("add", "sub", "mul")
    train = {r.id for r in problem_universe(ops, "train")}
    evals = {r.id for r in problem_universe(ops, "eval")}
    assert not train & evals
    assert len(train) + len(evals) == 8100 + 8100 + 81
    assert 0.15 < len(evals) / (len(train) + len(evals)) < 0.25


def test_deterministic_and_seeded():
    a = arithmetic_records("eval", 200, seed=0)
    assert a == arithmetic_records("eval", 200, seed=0)
    assert a != arithmetic_records("eval", 200, seed=1)
    assert len({r.id for r in a}) == 200


def test_operations_interleaved():
    ids = [r.id.split(":")[0] for r in arithmetic_records("train", 10, ops=("add", "mul"))]
    assert ids == ["add", "mul"] * 5


def test_bad_input():
    with pytest.raises(ValueError, match=r"unknown arithmetic operations \['div'\]"):
        arithmetic_records("train", 4, ops=("div",))
    with pytest.raises(ValueError, match="unknown split 'test'"):
        arithmetic_records("test", 4)
    with pytest.raises(ValueError, match="mul has only 18"):
        arithmetic_records("eval", 100, ops=("mul",))


def test_small_operation_exhausts_then_others_fill():
    ids = [r.id.split(":")[0] for r in arithmetic_records("eval", 200, ops=("add", "mul"))]
    assert ids.count("mul") == 18 and ids.count("add") == 182
    assert ids[:4] == ["add", "mul", "add", "mul"]
