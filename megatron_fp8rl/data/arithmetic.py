"""The built-in arithmetic task: generated problems with deterministic train/eval splits.

Owns: the problem universe (2-digit addition and subtraction, 1-digit multiplication, 2-digit by
1-digit multiplication), the split rule and the prompt wording. Must not import: convert, rollout, trainer, cli.

Split rule: a problem belongs to `eval` when the first byte of sha256("a op b") is < 256 *
EVAL_FRACTION, so the two splits never share a problem, whatever seed or size is asked for.
"""
from __future__ import annotations

import hashlib
import random

from megatron_fp8rl.data.records import PromptRecord

# op -> (sign, left operands, right operands, result, also asked with the operands swapped)
OPERATIONS = {
    "add": ("+", range(10, 100), range(10, 100), lambda a, b: a + b, False),
    "sub": ("-", range(10, 100), range(10, 100), lambda a, b: a - b, False),
    "mul": ("*", range(1, 10), range(1, 10), lambda a, b: a * b, False),
    # 2-digit by 1-digit products, both orders (1,440 problems, 317 held out): with `mul` the CPU
    # demo's task. SmolLM2-135M-Instruct, 24 new tokens (`python tools/probe_arithmetic.py
    # .cache/smollm2 --ops mul2,add --problems 128 --samples 2`): mul2 greedy 0.22, temperature-1
    # samples 0.031; add 0.15 / 0.020; mul (32 problems) 0.66 / 0.18. Rewards are sparse either
    # way; mul2 is a little easier than add and leaves > 200 held-out problems beside mul.
    "mul2": ("*", range(10, 100), range(2, 10), lambda a, b: a * b, True),
}
SPLITS = ("train", "eval")
EVAL_FRACTION = 0.2
PROMPT = "What is {a}{sign}{b}? Answer with the number only."


def _is_eval(text: str) -> bool:
    return hashlib.sha256(text.encode()).digest()[0] < 256 * EVAL_FRACTION


def problem_universe(ops: tuple[str, ...], split: str) -> list[PromptRecord]:
    """Every problem of `ops` in `split`, in a fixed order."""
    unknown = [op for op in ops if op not in OPERATIONS]
    if unknown or not ops:
        raise ValueError(f"unknown arithmetic operations {unknown}; choose from {sorted(OPERATIONS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
    records = []
    for op in ops:
        sign, left, right, result, both_orders = OPERATIONS[op]
        pairs = [(a, b) for a in left for b in right]
        if both_orders:
            pairs += [(b, a) for a, b in pairs]
        for a, b in pairs:
            text = f"{a}{sign}{b}"
            if _is_eval(text) == (split == "eval"):
                records.append(PromptRecord(
                    messages=({"role": "user", "content": PROMPT.format(a=a, sign=sign, b=b)},),
                    answer=str(result(a, b)), id=f"{op}:{text}"))
    return records


def arithmetic_records(split: str, count: int, ops: tuple[str, ...] = ("add", "mul"),
                       seed: int = 0) -> list[PromptRecord]:
    """`count` problems of `split`, drawn with `seed`, operations interleaved round-robin.

    Each operation contributes an equal share while it has problems left (so the 81 one-digit
    products are not drowned by 8,100 additions), then the others fill the rest; within an
    operation problems are drawn without replacement.
    """
    queues = {op: problem_universe((op,), split) for op in ops}
    total = sum(len(q) for q in queues.values())
    if count > total:
        raise ValueError(f"asked for {count} {split} problems but {'+'.join(ops)} has only {total}")
    rng = random.Random(seed)
    for records in queues.values():
        rng.shuffle(records)
        records.reverse()  # pop() from the end takes the shuffled order front to back
    chosen: list[PromptRecord] = []
    while len(chosen) < count:
        for op in ops:
            if queues[op] and len(chosen) < count:
                chosen.append(queues[op].pop())
    return chosen
