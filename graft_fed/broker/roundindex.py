"""The broker's per-round index in memory: k per node and prompt, and who published.

Matching, complementarity and "has this node published" used to re-read (and JSON-decode)
every node's summaries of the round from the state under the broker's lock: a profile of
the 64-node load put a third of the broker's CPU in the complementarity counts alone
(issue 13). The index holds, per round, one small integer array per node (k for each of
the round's prompt columns, MISSING where the node has no group), filled as publishes are
acknowledged (after the state made them durable) and rebuilt from the durable state on a
miss, so a restarted broker answers the same. First write wins, as in the state.

It holds at most `keep` rounds (the most recently used); an evicted round is rebuilt from
the state when asked for again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import numpy as np

from graft_fed.broker.matching import MISSING
from graft_fed.broker.state import SummaryHead


class RoundBook:
    """One round: its prompt columns and each node's k per column."""

    def __init__(self, round: int) -> None:
        self.round = round
        self.cols: dict[str, int] = {}
        self.pids: list[str] = []
        self._rows: dict[str, np.ndarray] = {}
        self.version = 0
        self._counts: tuple[int, np.ndarray, np.ndarray] | None = None
        self._compl: tuple[int, dict[str, tuple[int, int]]] | None = None
        # bundle digests attached to the round's summaries: node -> prompt id -> digest
        self.digests: dict[str, dict[str, str]] = {}
        self.digest_version = 0  # bumped by every attached digest (answers cached on it)
        # (prompt ids, their columns) of the last publish: nodes of a round mostly publish the
        # same prompts in the same order, so the next one's columns are one list comparison
        self._last: tuple[list[str], np.ndarray] | None = None

    def set_digest(self, node_id: str, prompt_id: str, digest: str) -> None:
        if prompt_id not in self.cols or node_id not in self._rows:
            return
        per = self.digests.setdefault(node_id, {})
        if per.get(prompt_id) != digest:
            per[prompt_id] = digest
            self.digest_version += 1

    @property
    def nodes(self) -> set[str]:
        return set(self._rows)

    def add(self, node_id: str, items: Iterable[tuple[str, int]]) -> int:
        """Record the node's (prompt id, k) groups; a group already held keeps its first k.
        Returns how many were new."""
        pids, ks = [], []
        for pid, k in items:
            pids.append(pid)
            ks.append(k)
        return self.add_columns(node_id, pids, np.asarray(ks, dtype=np.int16))

    def add_columns(self, node_id: str, pids: Sequence[str], ks: np.ndarray) -> int:
        """`add` for a publish's prompt ids and k as an array (one pass in C for the ids the
        round already has columns for)."""
        if self._last is not None and self._last[0] == pids:  # the prompts of the last publish, in its order
            c = self._last[1]
        else:
            cols = list(map(self.cols.get, pids))
            if None in cols:
                for i, col in enumerate(cols):
                    if col is None:
                        col = self.cols.get(pids[i])
                        if col is None:
                            col = self.cols[pids[i]] = len(self.pids)
                            self.pids.append(pids[i])
                        cols[i] = col
            c = np.asarray(cols, dtype=np.int64)
            self._last = (list(pids), c)
        row = self._rows.get(node_id)
        if row is None or row.size < len(self.pids):
            grown = np.full(max(len(self.pids), 2 * (0 if row is None else row.size)), MISSING, dtype=np.int16)
            if row is not None:
                grown[:row.size] = row
            row = self._rows[node_id] = grown
        if not c.size:
            return 0
        new = row[c] == MISSING
        row[c[new]] = np.asarray(ks).astype(np.int16)[new]
        self.version += 1
        return int(new.sum())

    def row(self, node_id: str) -> np.ndarray | None:
        """The node's k per column (a view; MISSING where it has no group)."""
        r = self._rows.get(node_id)
        return None if r is None else r[:len(self.pids)]

    def matrix(self, nodes: Sequence[str]) -> np.ndarray:
        """(len(nodes), columns) k, MISSING where a node has no group."""
        out = np.full((len(nodes), len(self.pids)), MISSING, dtype=np.int16)
        for i, node in enumerate(nodes):
            r = self._rows.get(node)
            if r is not None:
                w = min(r.size, len(self.pids))
                out[i, :w] = r[:w]
        return out

    def counts(self, n: int, m: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per column: how many nodes hold an informative group, and how many solved the
        prompt at least once (k >= 1). Cached until the next publish. `m`: the caller's
        `matrix(sorted(nodes))` of this version, when it has built it already."""
        if self._counts is None or self._counts[0] != self.version:
            if m is None:
                m = self.matrix(sorted(self._rows))
            self._counts = (self.version, ((m > 0) & (m < n)).sum(axis=0), (m >= 1).sum(axis=0))
        return self._counts[1], self._counts[2]

    def complementarity_all(self, n: int) -> dict[str, tuple[int, int]]:
        """Every node's complementarity within this round: (how many of its all-fail columns
        another node holds an informative group for, how many another node solved at least
        once), all nodes at once on the k matrix. Cached until the next publish. A node's own
        group at its all-fail column has k = 0 and counts in neither, so the round's counts
        are the other nodes'."""
        if self._compl is None or self._compl[0] != self.version:
            nodes = sorted(self._rows)
            m = self.matrix(nodes)
            informative, solved = self.counts(n, m)
            fails = m == 0
            cands = (fails & (informative > 0)).sum(axis=1)
            by_peers = (fails & (solved > 0)).sum(axis=1)
            self._compl = (self.version, {node: (int(c), int(s)) for node, c, s in
                                          zip(nodes, cands.tolist(), by_peers.tolist())})
        return self._compl[1]


class RoundIndex:
    """Books of the most recent rounds, rebuilt from `load(round)` (the state's summary
    heads of that round) on a miss. Thread-safe: one lock, held for short array work."""

    def __init__(self, n: int, load: Callable[[int], Sequence[SummaryHead]], keep: int = 16) -> None:
        self.n = n
        self._load = load
        self.keep = max(2, keep)
        self._books: OrderedDict[int, RoundBook] = OrderedDict()
        self.lock = threading.RLock()
        #: how often the index was cleared (retention): a writer that read the state before a
        #: clear must not put what it read back into the rebuilt books (`set_digest`'s `since`)
        self.generation = 0

    def book(self, round: int) -> RoundBook:
        with self.lock:
            book = self._books.get(round)
            if book is None:
                book = RoundBook(round)
                per_node: dict[str, list[tuple[str, int]]] = {}
                digests = []
                for h in self._load(round):
                    per_node.setdefault(h.node_id, []).append((h.prompt_id, h.k))
                    if h.bundle_digest:
                        digests.append((h.node_id, h.prompt_id, h.bundle_digest))
                for node, items in per_node.items():
                    book.add(node, items)
                for node, pid, digest in digests:
                    book.set_digest(node, pid, digest)
                self._books[round] = book
                while len(self._books) > self.keep:
                    self._books.popitem(last=False)
            else:
                self._books.move_to_end(round)
            return book

    def open(self, round: int) -> None:
        """A round the state holds nothing of yet (its row was just written): an empty book,
        unless the round has one."""
        with self.lock:
            if round not in self._books:
                self._books[round] = RoundBook(round)
                while len(self._books) > self.keep:
                    self._books.popitem(last=False)

    def add(self, round: int, node_id: str, items: Iterable[tuple[str, int]]) -> None:
        """Record groups that the state has made durable (after the write returned)."""
        with self.lock:
            self.book(round).add(node_id, items)

    def add_columns(self, round: int, node_id: str, pids: Sequence[str], ks: np.ndarray) -> None:
        """`add` for one publish as columns."""
        with self.lock:
            self.book(round).add_columns(node_id, pids, ks)

    def set_digest(self, round: int, node_id: str, prompt_id: str, digest: str, since: int | None = None) -> None:
        """Record a bundle attached to a summary the state holds (after the write returned).
        With `since` (the generation read before the write): when the index was cleared
        meanwhile, the round's book is read again from the state instead,
        which says whether the digest survived the retention that cleared it (a book
        rebuilt between the clear and the write would lack it; writing it into the book
        could give back a digest retention dropped)."""
        with self.lock:
            if since is None or since == self.generation:
                self.book(round).set_digest(node_id, prompt_id, digest)
                return
            old = self._books.pop(round, None)
            if old is not None:  # read again now; answers cached on the old book's version are stale
                fresh = self.book(round)
                fresh.digest_version = max(fresh.digest_version, old.digest_version + 1)

    def published(self, round: int) -> set[str]:
        with self.lock:
            return self.book(round).nodes

    def published_count(self, round: int) -> int:
        return len(self._present(round)._rows)

    def has_published(self, round: int, node_id: str) -> bool:
        return node_id in self._present(round)._rows

    def _present(self, round: int) -> RoundBook:
        """The round's book for the two reads above, which every GetMatches makes when it
        arrives and when it is woken, and readiness after every publish: a thousand woken
        long-polls each taking the lock, which the answers being built take again and again,
        queued for seconds behind them (issue 13, twentieth pass). A book present is read
        without the lock (a dict lookup the interpreter makes whole; a publisher once in a
        book stays in it); a missing one is loaded under it."""
        book = self._books.get(round)
        if book is None:
            with self.lock:
                book = self.book(round)
        return book

    def forget(self, round: int) -> None:
        """Forget one round's book; the next read rebuilds it from the state."""
        with self.lock:
            self._books.pop(round, None)

    def clear(self) -> None:
        """Forget every book (after retention pruned the state); rebuilt on demand."""
        with self.lock:
            self._books.clear()
            self.generation += 1

    def kn(self, round: int) -> tuple[list[str], list[str], np.ndarray]:
        """(participants sorted, prompt ids of the columns, k matrix) of one round."""
        with self.lock:
            book = self.book(round)
            nodes = sorted(book.nodes)
            return nodes, list(book.pids), book.matrix(nodes)

    def fails(self, receiver: str, round: int) -> list[str]:
        """The prompts the receiver failed entirely in `round`, in column order."""
        with self.lock:
            book = self.book(round)
            row = book.row(receiver)
            if row is None:
                return []
            return [book.pids[c] for c in np.flatnonzero(row == 0).tolist()]

    def complementarity(self, receiver: str, round: int, min_round: int) -> tuple[int, int]:
        """core.exchange.complementarity over the other nodes' groups of rounds
        [min_round, round]: (how many of the receiver's all-fail prompts of `round` have an
        informative peer group, how many some peer solved at least once)."""
        with self.lock:
            home = self.book(round)
            if min_round == round:  # the receiver's round alone (synchronous mode): every receiver at once
                return home.complementarity_all(self.n).get(receiver, (0, 0))
            row = home.row(receiver)
            own_cols = np.flatnonzero(row == 0) if row is not None else np.zeros(0, dtype=np.int64)
            if not own_cols.size:
                return 0, 0
            fails: list[str] | None = None  # prompt ids, looked up only in other rounds' books
            informative = np.zeros(own_cols.size, dtype=bool)
            solved = np.zeros(own_cols.size, dtype=bool)
            for r in range(max(min_round, round - self.keep + 1), round + 1):
                book = self.book(r)
                if not book.pids:
                    continue
                if book is home:  # the receiver's own round: its failed columns are the columns
                    cols = own_cols
                else:
                    if fails is None:
                        fails = [home.pids[c] for c in own_cols.tolist()]
                    cols = np.fromiter((book.cols.get(p, -1) for p in fails), dtype=np.int64, count=len(fails))
                have = cols >= 0
                if not have.any():
                    continue
                inf_count, pos_count = book.counts(self.n)
                c = cols[have]
                inf_c, pos_c = inf_count[c].copy(), pos_count[c].copy()
                own = book.row(receiver)
                if own is not None:  # the receiver's own groups (other rounds) are not a peer's
                    k = own[c]
                    inf_c -= ((k > 0) & (k < self.n)).astype(inf_c.dtype)
                    pos_c -= (k >= 1).astype(pos_c.dtype)
                informative[have] |= inf_c > 0
                solved[have] |= pos_c > 0
            return int(informative.sum()), int(solved.sum())
