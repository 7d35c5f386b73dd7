"""Which prompts a run trains on and which it holds out.

Owns: `load_records` (a dataset spec -> prompt records: the built-in arithmetic task's draw, or a
prompt file) and `check_disjoint` (no held-out problem is a training prompt). Must not import:
convert, rollout, trainer, cli.
"""
from __future__ import annotations

from megatron_fp8rl.data.arithmetic import arithmetic_records
from megatron_fp8rl.data.records import DatasetError, DatasetSchema, PromptRecord, load_prompt_file

BUILTIN_ARITHMETIC = "builtin:arithmetic"
"""The spec of the built-in arithmetic task (data/arithmetic.py)."""


def load_records(spec: str, split: str, count: int, ops: tuple[str, ...], seed: int,
                 schema: DatasetSchema = DatasetSchema()) -> list[PromptRecord]:
    """`count` problems of the built-in arithmetic task's `split` (operations `ops`) drawn with
    `seed`, or every record of the prompt file `spec` (split, count and seed do not apply)."""
    if spec == BUILTIN_ARITHMETIC:
        return arithmetic_records(split, count, ops=ops, seed=seed)
    if spec.startswith("builtin:"):
        raise DatasetError(f"unknown built-in dataset {spec!r}; available: {BUILTIN_ARITHMETIC}")
    return load_prompt_file(spec, schema)


SHOWN_OVERLAPS = 10
"""Overlapping problems named in `check_disjoint`'s error (the count is always given)."""


def _prompt_key(record: PromptRecord) -> tuple[tuple[str, str], ...]:
    """What the model is shown: the chat's (role, content) turns."""
    return tuple((turn["role"], turn["content"]) for turn in record.messages)


def check_disjoint(train: list[PromptRecord], held_out: list[PromptRecord], train_spec: str,
                   held_out_spec: str) -> None:
    """DatasetError naming the held-out problems whose prompt (the same chat) is also a training
    prompt: held-out accuracy on them would measure recall of trained answers."""
    trained = {_prompt_key(record): record for record in train}
    shared = [(record, trained[_prompt_key(record)]) for record in held_out if _prompt_key(record) in trained]
    if not shared:
        return
    named = "; ".join(f"{held.id} (training {seen.id}): {held.messages[-1]['content']!r}"
                      for held, seen in shared[:SHOWN_OVERLAPS])
    more = f"; and {len(shared) - SHOWN_OVERLAPS} more" if len(shared) > SHOWN_OVERLAPS else ""
    raise DatasetError(f"{len(shared)} of {len(held_out)} held-out problems (data.eval={held_out_spec}) are also "
                       f"training prompts (data.train={train_spec}): {named}{more}; hold out problems the "
                       f"run does not train on (builtin:arithmetic's eval split never meets its train split)")
