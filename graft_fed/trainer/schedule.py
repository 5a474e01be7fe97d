"""Deterministic prompt schedule: batch r is a function of (prompts, seed, r) alone.

Every epoch is a fresh permutation seeded by (seed, epoch); batches are consecutive
slices of the concatenated epochs. Two runs (or two federation nodes) holding the same
prompt set and seed therefore see the same prompts at the same round, and resuming needs
only the cursor.
"""

from __future__ import annotations

import random
from typing import Sequence

from graft_fed.data.prompts import Prompt
from graft_fed.errors import DataError


class PromptSchedule:
    def __init__(self, prompts: Sequence[Prompt], batch_size: int, seed: int) -> None:
        if not prompts:
            raise DataError("the training prompt set is empty; check data.source, data.split and data.families")
        # Sort by id so the order the rows were read in does not matter.
        self.prompts = sorted(prompts, key=lambda p: p.id)
        self.batch_size = batch_size
        self.seed = seed
        self.cursor = 0  # index into the infinite concatenation of epoch permutations
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def at(self, position: int) -> Prompt:
        epoch, offset = divmod(position, len(self.prompts))
        return self.prompts[self._permutation(epoch)[offset]]

    def next_batch(self) -> list[Prompt]:
        batch = [self.at(self.cursor + i) for i in range(self.batch_size)]
        self.cursor += self.batch_size
        return batch

    @property
    def epoch(self) -> float:
        return self.cursor / len(self.prompts)
