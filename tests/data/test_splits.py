"""Which prompts a run trains on and which it holds out: dataset specs, and the check that a
held-out problem is never a training prompt."""
import json

import pytest

from megatron_fp8rl.data.arithmetic import arithmetic_records
from megatron_fp8rl.data.records import DatasetError, PromptRecord
from megatron_fp8rl.data.splits import SHOWN_OVERLAPS, check_disjoint, load_records


def _record(content: str, id: str) -> PromptRecord:
    return PromptRecord(messages=({"role": "user", "content": content},), answer="1", id=id)


def test_builtin_spec_draws_the_arithmetic_split_and_a_file_spec_reads_every_row(tmp_path):
    assert load_records("builtin:arithmetic", "eval", 30, ("add", "mul"), 5) == arithmetic_records(
        "eval", 30, ops=("add", "mul"), seed=5)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    assert [r.answer for r in load_records(str(path), "eval", 1, ("add",), 0)] == ["0", "1", "2"]
    with pytest.raises(DatasetError, match=r"unknown built-in dataset 'builtin:gsm8k'; available: builtin:arithmetic"):
        load_records("builtin:gsm8k", "train", 4, ("add",), 0)


def test_disjoint_sets_pass_and_the_builtin_splits_never_meet():
    check_disjoint([_record("a", "t1")], [_record("b", "e1")], "train.jsonl", "eval.jsonl")
    ops = ("add", "sub", "mul", "mul2")
    check_disjoint(arithmetic_records("train", 8000, ops=ops, seed=1), arithmetic_records("eval", 2000, ops=ops),
                   "builtin:arithmetic", "builtin:arithmetic")


def test_overlap_is_refused_naming_each_shared_problem_and_both_files():
    train = [_record("What is 2+3?", "train.jsonl:1"), _record("What is 4*5?", "train.jsonl:2")]
    held_out = [_record("What is 9+9?", "eval.jsonl:1"), _record("What is 4*5?", "eval.jsonl:2")]
    with pytest.raises(DatasetError) as error:
        check_disjoint(train, held_out, "train.jsonl", "eval.jsonl")
    assert str(error.value).startswith(
        "1 of 2 held-out problems (data.eval=eval.jsonl) are also training prompts (data.train=train.jsonl): "
        "eval.jsonl:2 (training train.jsonl:2): 'What is 4*5?';")


def test_the_same_words_in_another_role_are_another_prompt():
    system = PromptRecord(messages=({"role": "system", "content": "x"}, {"role": "user", "content": "q"}),
                          answer="1", id="s")
    check_disjoint([system], [_record("q", "u")], "a", "b")


def test_many_overlaps_name_the_first_ones_and_count_the_rest():
    shared = [_record(f"q{i}", f"id{i}") for i in range(SHOWN_OVERLAPS + 3)]
    with pytest.raises(DatasetError, match=rf"^{SHOWN_OVERLAPS + 3} of {SHOWN_OVERLAPS + 3} held-out .* and 3 more;"):
        check_disjoint(shared, shared, "f.jsonl", "f.jsonl")
