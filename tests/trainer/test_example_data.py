"""The GPU examples' prompts: a tiny file in the DAPO-Math-17k layout (verl's RL Parquet: `prompt`
the chat, `reward_model.ground_truth`, `extra_info.index`), as Parquet and as JSONL, read through
the example's own config (its YAML with only the file paths overridden) and the trainer's loader,
and scored by the example's reward (math_verify)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.data.rewards import load_reward_fn
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.start import training_records
from tests.helpers.processes import REPO
from tests.helpers.train import GPU_EXAMPLES

INSTRUCTION = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the answer "
               "to the problem.\n\n{}\n\nRemember to put your answer on its own line after \"Answer:\"")
DAPO_ROWS = [
    {"data_source": "math_dapo", "prompt": [{"content": INSTRUCTION.format(question), "role": "user"}],
     "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": index}}
    for question, answer, index in [("What is 12+22?", "34", "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
                                    ("Simplify 3/6.", "\\frac{1}{2}", "b426d104-244d-4831-a2c4-cd756b61700a")]
]


def _write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("example", sorted(GPU_EXAMPLES))
def test_gpu_example_reads_dapo_math_rows_and_scores_them_with_math_verify(example, suffix, tmp_path):
    prompts = _write(tmp_path / f"dapo{suffix}", DAPO_ROWS)
    cfg = load_config(RunConfig, REPO / "examples" / example,
                      ["model.hf_path=/x", f"data.train={prompts}", f"data.eval={prompts}"])
    records = training_records(cfg)
    assert [r.messages for r in records] == [tuple(row["prompt"]) for row in DAPO_ROWS]
    assert [r.answer for r in records] == ["34", "\\frac{1}{2}"]
    assert [r.id for r in records] == [row["extra_info"]["index"] for row in DAPO_ROWS]
    reward = load_reward_fn(cfg.data.reward)
    assert reward("12 + 22 = 34.\nAnswer: 34", records[0].answer) == 1.0
    assert reward("12 + 22 = 35.\nAnswer: 35", records[0].answer) == 0.0
    assert reward("3/6 = 0.5\nAnswer: $\\frac{1}{2}$", records[1].answer) == 1.0


@pytest.mark.parametrize("example", sorted(GPU_EXAMPLES))
def test_gpu_examples_name_a_dataset_file_and_math_verify(example):
    """Not the built-in arithmetic task: a placeholder path the user replaces, and math_verify."""
    cfg = load_config(RunConfig, REPO / "examples" / example, ["model.hf_path=/x"])
    for spec in (cfg.data.train, cfg.data.eval):
        assert not spec.startswith("builtin:") and spec.endswith((".parquet", ".jsonl")), spec
    assert cfg.data.reward == "math_verify"
