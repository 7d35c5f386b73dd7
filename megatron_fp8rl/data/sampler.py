"""Resumable prompt sampling: epochs of seeded shuffles, with a position that checkpoints.

Owns: `PromptSampler`. Must not import: convert, rollout, trainer, cli.
"""
from __future__ import annotations

import random
from typing import Sequence

from megatron_fp8rl.data.records import PromptRecord


class PromptSampler:
    """Yields batches of records: each epoch is a fresh shuffle seeded by (seed, epoch).

    `state_dict()` / `load_state_dict()` capture the position so a resumed run continues with
    exactly the prompts an uninterrupted run would have drawn.
    """

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int = 0):
        if batch_size < 1 or batch_size > len(records):
            raise ValueError(f"batch_size {batch_size} must be in [1, {len(records)}] (dataset size)")
        self.records, self.batch_size, self.seed = list(records), batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptRecord]:
        """The next `batch_size` records (a batch never straddles two epochs)."""
        if self.index + self.batch_size > len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffle(self.epoch)
        batch = [self.records[i] for i in self._order[self.index:self.index + self.batch_size]]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position to resume from."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "dataset_size": len(self.records)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; refuses a different dataset or seed."""
        if state["dataset_size"] != len(self.records) or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for {state['dataset_size']} records with seed "
                             f"{state['seed']}, this sampler has {len(self.records)} with seed {self.seed}")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)
