"""How often an HF model answers each built-in arithmetic operation correctly, greedily and
sampled: the numbers behind the CPU demo's choice of task (RL needs some rewarded samples).

Owns: nothing reusable; a command over transformers' generate, the task's problem universe
(data.arithmetic) and the demo's reward (data.rewards.last_number_reward). Must not import:
trainer, rollout (it measures the HF model itself, the independent reference).

    python tools/probe_arithmetic.py .cache/smollm2 --ops add,mul,mul2 --problems 32 --samples 4

Prints, per operation, the fraction of correct greedy answers and of correct samples at each
--temperature, within --max-new-tokens (the demo's 24).
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatron_fp8rl.data.arithmetic import OPERATIONS, problem_universe  # noqa: E402
from megatron_fp8rl.data.rewards import last_number_reward  # noqa: E402


def accuracy(model, tokenizer, records, temperature: float, samples: int, max_new_tokens: int) -> float:
    texts = [tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=False)
             for r in records]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    n = 1 if temperature == 0 else samples
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                         temperature=temperature or None, top_p=None, top_k=None,
                         num_return_sequences=n, pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    gold = [r.answer for r in records for _ in range(n)]
    return sum(last_number_reward(a, g) for a, g in zip(answers, gold)) / len(answers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF checkpoint folder")
    parser.add_argument("--ops", default=",".join(OPERATIONS), help="comma list of operations")
    parser.add_argument("--problems", type=int, default=32, help="train-split problems per operation")
    parser.add_argument("--samples", type=int, default=4, help="samples per problem at temperature > 0")
    parser.add_argument("--temperature", type=float, action="append", default=None,
                        help="sampling temperatures (repeatable; default 1.0)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    temperatures = args.temperature or [1.0]
    for op in args.ops.split(","):
        universe = problem_universe((op,), "train")
        records = random.Random(args.seed).sample(universe, min(args.problems, len(universe)))
        figures = {"greedy": accuracy(model, tokenizer, records, 0.0, 1, args.max_new_tokens)}
        for t in temperatures:
            figures[f"T={t}"] = accuracy(model, tokenizer, records, t, args.samples, args.max_new_tokens)
        print(f"{op}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
