"""Groups matched per (source, receiver) over every stored round, as one dense matrix.

Status, /metrics and the live page report how many groups each source gave each receiver.
The broker used to keep that as a Counter keyed by (source, receiver) string tuples and to
update it with a Counter built per matched round. At 256 nodes the distinct pairs kept
arriving through a whole 30-minute run (15,700 after 13 s, 29,000 after 300 s, 33,500 after
30 minutes, of 65,280), each about 128 bytes of Python objects, and every /metrics scrape
copied the Counter and built a dict per pair, twice (issue 13). Here a node is a row and a
column of an int64 matrix over the nodes seen (broker/grid.py): 8 bytes a pair whether it
exchanged or not, 0.5 MiB at 256 nodes, 8 MiB at 1,000, and a matched round adds its
matches with one np.unique.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from graft_fed.broker.grid import PairGrid


@dataclass(frozen=True)
class ExchangeView:
    """A copy of the pairs that exchanged at least one group: `names[source[i]]` gave
    `names[receiver[i]]` `groups[i]` groups, in no particular order (`items` sorts them;
    the totals and `/metrics` past its limit need no order)."""

    names: list[str]
    source: np.ndarray
    receiver: np.ndarray
    groups: np.ndarray

    def __len__(self) -> int:
        return len(self.groups)

    def items(self) -> Iterator[tuple[tuple[str, str], int]]:
        """((source, receiver), groups), sorted by source name, then receiver name."""
        names = self.names
        rank = np.empty(len(names), dtype=np.int64)
        rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
        order = np.lexsort((rank[self.receiver], rank[self.source]))
        for s, r, g in zip(self.source[order].tolist(), self.receiver[order].tolist(), self.groups[order].tolist()):
            yield (names[s], names[r]), g

    def as_dict(self) -> dict[tuple[str, str], int]:
        return dict(self.items())

    def among(self, names: Iterable[str]) -> dict[tuple[str, str], int]:
        """The pairs whose source and receiver are both in `names`."""
        wanted = set(names)
        inside = np.array([n in wanted for n in self.names], dtype=bool)
        keep = inside[self.source] & inside[self.receiver] if len(self.names) else np.zeros(0, dtype=bool)
        names_ = self.names
        return {(names_[s], names_[r]): g for s, r, g in
                zip(self.source[keep].tolist(), self.receiver[keep].tolist(), self.groups[keep].tolist())}

    def given(self) -> dict[str, int]:
        """Groups each node gave to peers (nodes that gave none are left out)."""
        return self._sum(self.source)

    def received(self) -> dict[str, int]:
        """Groups matched to each node from peers (nodes that received none are left out)."""
        return self._sum(self.receiver)

    def _sum(self, side: np.ndarray) -> dict[str, int]:
        totals = np.bincount(side, weights=self.groups, minlength=len(self.names)).astype(np.int64)
        return {self.names[i]: int(totals[i]) for i in np.flatnonzero(totals)}


class Exchange:
    """The matrix; not thread-safe (the matcher holds its lock around every call)."""

    def __init__(self) -> None:
        self._grid = PairGrid({"groups": np.int64})
        self._rounds: set[int] = set()  # the rounds whose match sets are counted

    def add_set(self, round: int, nodes: Sequence[str], source: np.ndarray, receiver: np.ndarray) -> None:
        """Count a round's match set once, however often it is added: a count built from the
        state may already hold a round that matching then adds as it finishes."""
        if round in self._rounds:
            return
        self._rounds.add(round)
        self.add_positions(nodes, source, receiver)

    def add_positions(self, nodes: Sequence[str], source: np.ndarray, receiver: np.ndarray) -> None:
        """Count one match per i, from nodes[source[i]] to nodes[receiver[i]] (a match set's
        columns: positions into its own list of nodes)."""
        if len(source) == 0:
            return
        at = self._grid.positions(nodes)
        m = self._grid.m["groups"]
        cap = m.shape[0]
        flat = at[np.asarray(source, dtype=np.int64)] * cap + at[np.asarray(receiver, dtype=np.int64)]
        cells, counts = np.unique(flat, return_counts=True)
        m.reshape(-1)[cells] += counts

    def add_pairs(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Count one match per (source, receiver) given (matches stored as rows)."""
        pairs = list(pairs)
        if not pairs:
            return
        names = sorted({x for p in pairs for x in p})
        pos = {name: i for i, name in enumerate(names)}
        self.add_positions(names, np.array([pos[s] for s, _ in pairs], dtype=np.int64),
                           np.array([pos[r] for _, r in pairs], dtype=np.int64))

    def view(self) -> ExchangeView:
        m = self._grid.used("groups")
        src, dst = np.nonzero(m)
        return ExchangeView(names=list(self._grid.names), source=src, receiver=dst, groups=m[src, dst].copy())
