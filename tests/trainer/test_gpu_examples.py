"""The GPU example configs say which tier and precision they run and what is not exact there, follow
the recommendation for a bf16 trainer, and build their run plan: every key validated, the inputs
checked and the plan printed, without starting anything (no processes, no model)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.fp8.serving import RolloutFp8
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.start import check_inputs, plan_lines
from tests.helpers.train import GPU_EXAMPLES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BF16_TRAINER_RECIPE = "groupwise32"
"""The FP8 recipe docs/fp8.md and docs/stability.md recommend (1x32 groups)."""


def header(example: str) -> str:
    """The example's opening comment block, one string."""
    lines = (EXAMPLES / example).read_text().splitlines()
    return " ".join(line.lstrip("# ") for line in lines[:next(i for i, l in enumerate(lines) if not l.startswith("#"))])


@pytest.fixture
def inputs(tmp_path: Path) -> list[str]:
    """Overrides pointing the example at a placeholder HF folder and prompt file that exist."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}],
                                   "reward_model": {"ground_truth": "2"}, "extra_info": {"index": "a"}}) + "\n")
    return [f"model.hf_path={tmp_path / 'hf'}", f"data.train={prompts}", f"data.eval={prompts}"]


@pytest.mark.parametrize("example", sorted(GPU_EXAMPLES))
def test_a_gpu_example_states_its_tier_and_precision(example):
    cfg = load_config(RunConfig, EXAMPLES / example, ["model.hf_path=/x"])
    text = header(example)
    assert "Tier: GPU" in text and "Precision:" in text, example
    assert ("bf16 trainer" in text) == (cfg.model.dtype == "bfloat16"), example
    assert f"({cfg.model.fp8}," in text, f"{example}: its header does not name model.fp8={cfg.model.fp8}"
    assert "quantize identically" not in text, f"{example}: a bf16 trainer's rollouts are not exact"


@pytest.mark.parametrize("example", sorted(GPU_EXAMPLES))
def test_a_bf16_trainer_example_runs_the_recommended_recipe_and_corrects_the_mismatch(example):
    cfg = load_config(RunConfig, EXAMPLES / example, ["model.hf_path=/x"])
    assert cfg.model.dtype == "bfloat16", f"{example}: the GPU examples run Megatron bf16 mixed precision"
    assert cfg.model.fp8 == BF16_TRAINER_RECIPE, example
    assert cfg.algorithm.correction != "none", f"{example}: rollout and trainer logprobs differ on a bf16 trainer"


@pytest.mark.parametrize("example", sorted(GPU_EXAMPLES))
def test_a_gpu_example_builds_its_run_plan(example, inputs):
    cfg = load_config(RunConfig, EXAMPLES / example, inputs)
    check_inputs(cfg)
    plan = cfg.fp8_plan
    if plan.rollout is RolloutFp8.ALIGNED:
        assert plan.row_group == 32 and plan.trainer_gemm == "batch_invariant", plan
    lines = plan_lines(cfg, train_size=1, eval_size=1)
    assert f"trainer FP8 {BF16_TRAINER_RECIPE}, rollout FP8 {cfg.rollout.fp8}" in lines[0]
    assert f"{cfg.train.steps} x {cfg.data.prompts_per_step} prompts x {cfg.rollout.n_samples} samples" in lines[2]


def test_an_example_naming_a_missing_file_is_refused_before_it_starts(inputs):
    cfg = load_config(RunConfig, EXAMPLES / "qwen3_8b_dapo_fp8.yaml", [*inputs, "data.eval=/nowhere/eval.parquet"])
    with pytest.raises(FileNotFoundError, match="data.eval=/nowhere/eval.parquet: file does not exist"):
        check_inputs(cfg)
