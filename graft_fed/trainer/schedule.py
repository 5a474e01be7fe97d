"""Deterministic prompt schedule: batch r is a function of (prompts, seed, r) alone.

Every epoch is a fresh permutation seeded by (seed, epoch), cut into full batches; the
few prompts left over at the end of an epoch's permutation are skipped for that epoch
(different ones each epoch), so a batch never holds the same prompt twice. Two runs (or
two federation nodes) holding the same prompt set and seed therefore see the same
prompts at the same round, and resuming needs only the batch counter.
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
        if len(self.prompts) < batch_size:
            raise DataError(f"the training set has {len(self.prompts)} prompts but a step needs {batch_size} "
                            "distinct ones: lower algorithm.prompts_per_step or add data")
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = len(self.prompts) // batch_size
        self.cursor = 0  # batches drawn so far
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def batch(self, index: int) -> list[Prompt]:
        epoch, k = divmod(index, self.batches_per_epoch)
        perm = self._permutation(epoch)
        return [self.prompts[i] for i in perm[k * self.batch_size:(k + 1) * self.batch_size]]

    def next_batch(self) -> list[Prompt]:
        out = self.batch(self.cursor)
        self.cursor += 1
        return out

    @property
    def epoch(self) -> float:
        return self.cursor / self.batches_per_epoch
