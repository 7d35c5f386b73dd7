"""Aligned FP8 rollouts stay bit-identical to the trainer's recompute when SGLang's radix cache
holds other prompts (issue #44): an eval before every step leaves its prompts' prefixes cached, so
the next rollouts' prefill runs as an extend over a prefix computed in another call; samples of one
prompt share its prefix; a prompt repeats within the batch and between eval and training. The
logged rollout-vs-recompute mismatch must be exactly 0 on every step.

1 torchrun process + SGLang's 2; a tiny random Llama.
"""
import json
import random
from pathlib import Path

import pytest

from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.train import CLI, tb_scalars
from tests.helpers.processes import run_torchrun


def _shared_prefix_prompts(path: Path, rows: int, seed: int, repeat_of: list[dict] = ()) -> list[dict]:
    """JSONL of prompts that share an 8-word prefix and differ in a 1-6 word tail (so in length),
    plus the rows of `repeat_of` (prompts that also occur in another file)."""
    r = random.Random(seed)
    prefix = " ".join(f"w{r.randint(3, 127)}" for _ in range(8))
    records = [dict(row) for row in repeat_of]
    while len(records) < rows:
        tail = " ".join(f"w{r.randint(3, 127)}" for _ in range(r.randint(1, 6)))
        records.append({"prompt": f"{prefix} {tail}", "answer": "w4"})
    path.write_text("".join(json.dumps(row) + "\n" for row in records))
    return records


def write_inputs(root: Path) -> tuple[Path, Path, Path]:
    """(model, train JSONL, eval JSONL): the train file repeats its first prompt, the eval file
    holds two training prompts and six of its own with the same prefix."""
    model = build_tiny_model("llama", root / "model")
    train = _shared_prefix_prompts(root / "train.jsonl", 16, 0)
    train_path = root / "train.jsonl"
    train_path.write_text("".join(json.dumps(row) + "\n" for row in [train[0], *train[:15]]))
    _shared_prefix_prompts(root / "eval.jsonl", 8, 0, repeat_of=train[:2])
    return model, train_path, root / "eval.jsonl"


@pytest.mark.multiprocess
def test_aligned_mismatch_is_exactly_zero_after_an_eval(tmp_path):
    model, train, evals = write_inputs(tmp_path)
    run_torchrun(CLI, 1, "train", f"model.hf_path={model}", f"data.train={train}", f"data.eval={evals}",
                 "data.eval_size=8", "data.reward=tests.trainer.reward_fns:first_word_even", "train.steps=2",
                 "rollout.n_samples=4", "data.prompts_per_step=2", "rollout.max_new_tokens=6",
                 "train.micro_batch_size=4", "train.mini_batches=2", "train.eval_every=1", "train.lr=1e-3",
                 "model.fp8=groupwise32", "rollout.fp8=aligned", "algorithm.name=grpo",
                 "algorithm.dynamic_sampling=false", "algorithm.old_policy=decoupled",
                 f"run_dir={tmp_path / 'run'}", timeout=900)
    mismatch = tb_scalars(tmp_path / "run")["train/mismatch_abs_logprob_diff_mean"]
    print(f"mismatch per step: {mismatch}")
    assert mismatch == [0.0, 0.0]
