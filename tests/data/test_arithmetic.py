"""The built-in arithmetic task: correct answers, disjoint deterministic splits, balanced ops."""
import pytest

from megatron_fp8rl.data.arithmetic import arithmetic_records, problem_universe


def test_answers_are_correct():
    for record in arithmetic_records("train", 80, ops=("add", "sub", "mul", "mul2"), seed=1):
        question = record.messages[-1]["content"]
        expression = question.removeprefix("What is ").split("?")[0]
        assert str(eval(expression)) == record.answer, question  # noqa: S307 (our own digits)


def test_splits_disjoint_and_cover_universe():
    ops = ("add", "sub", "mul", "mul2")
    train = {r.id for r in problem_universe(ops, "train")}
    evals = {r.id for r in problem_universe(ops, "eval")}
    assert not train & evals
    assert len(train) + len(evals) == 8100 + 8100 + 81 + 2 * 90 * 8
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


def test_mul2_has_both_orders_and_enough_held_out_problems():
    universe = {r.messages[-1]["content"].removeprefix("What is ").split("?")[0]
                for split in ("train", "eval") for r in problem_universe(("mul2",), split)}
    assert {"37*4", "4*37", "10*2", "2*10", "99*9", "9*99"} <= universe
    assert "1*37" not in universe and "37*10" not in universe
    # the demo evaluates 200 held-out problems of mul + mul2 (issue #7: >= 200)
    ids = [r.id.split(":")[0] for r in arithmetic_records("eval", 200, ops=("mul", "mul2"))]
    assert ids.count("mul") == 18 and ids.count("mul2") == 182
