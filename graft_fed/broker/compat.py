"""The compatibility counts per (source, receiver) in memory: what matching, quarantine,
status and the live page read, kept equal to the state's `compat` table.

Receivers report on the groups they were given (broker/reports.py), and the state folds
each report into its pair's row (state_rows.fold_compat). Every matched round (twice: the
estimates and quarantine), every report (the rejected total), every status and /metrics
scrape used to read the whole table from the state: N^2 rows at N nodes once they have
exchanged, read and turned into Python objects under the broker's lock. At 256 nodes that
made a report wait seconds (issue 13). Here the table is read from the state once, on first
use, and each report's pairs are read back after the state has folded it: the state stays
the one definition of the fold, and this copy holds exactly its numbers, as matrices over
the nodes seen (broker/grid.py: 41 bytes a pair, at most 41 MiB at 1,000 nodes).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from graft_fed.broker.exchange import ExchangeView
from graft_fed.broker.grid import PairGrid
from graft_fed.broker.quarantine import quarantined_sources
from graft_fed.broker.state import CompatRow


@dataclass(frozen=True)
class CompatView:
    """A copy of the pairs that have a row: `names[source[i]]` -> `names[receiver[i]]`, in no
    particular order, with the row's fields as arrays."""

    names: list[str]
    source: np.ndarray
    receiver: np.ndarray
    groups: np.ndarray
    mean_s: np.ndarray
    admitted: np.ndarray
    rejected: np.ndarray
    undelivered: np.ndarray

    @property
    def reported(self) -> np.ndarray:
        """Groups the receiver reported on, rejected ones included (a rejected report counts
        only in `rejected`, core.exchange.CompatEstimate)."""
        return self.groups + self.rejected


_DTYPES = {"present": np.bool_, "groups": np.int64, "rejected": np.int64, "mean_s": np.float64,
           "admitted": np.float64, "undelivered": np.int64}


class CompatTable:
    """Thread-safe; loads the state's rows on first use (`read_all`)."""

    def __init__(self, read_all: Callable[[], list[CompatRow]]) -> None:
        self._read_all = read_all
        self._lock = threading.Lock()
        self._grid: PairGrid | None = None
        self._version = 0
        self._rejected = self._undelivered = self._pairs = 0  # totals over the pairs, kept as rows come in
        self._quarantine: tuple[tuple, set[str]] | None = None

    def _loaded(self) -> PairGrid:
        if self._grid is None:
            # built aside and kept only whole: a failed read (or fill) leaves the table
            # unloaded, and the next use reads again
            grid = PairGrid(_DTYPES)
            totals = self._fill(grid, self._read_all())
            self._grid = grid
            self._rejected, self._undelivered, self._pairs = totals
            self._version += 1
        return self._grid

    @staticmethod
    def _fill(grid: PairGrid, rows: Iterable[CompatRow]) -> tuple[int, int, int]:
        """Write the rows (distinct pairs) into the grid; returns the change in the rejected
        and undelivered totals and in the number of pairs."""
        rows = list(rows)
        if not rows:
            return 0, 0, 0
        at = grid.positions([x for c in rows for x in (c.source, c.receiver)]).reshape(-1, 2)
        s, r = at[:, 0], at[:, 1]
        m = grid.m
        had = m["present"][s, r]
        rejected, undelivered = int(m["rejected"][s, r][had].sum()), int(m["undelivered"][s, r][had].sum())
        m["present"][s, r] = True
        m["groups"][s, r] = [c.groups for c in rows]
        m["rejected"][s, r] = [c.rejected for c in rows]
        m["undelivered"][s, r] = [c.undelivered for c in rows]
        m["mean_s"][s, r] = [c.mean_s for c in rows]
        m["admitted"][s, r] = [c.admitted_fraction for c in rows]
        return (sum(c.rejected for c in rows) - rejected, sum(c.undelivered for c in rows) - undelivered,
                int((~had).sum()))

    def update(self, rows: Iterable[CompatRow]) -> None:
        """Take these rows as the state now holds them (a report's pairs, read back after
        the state folded it). Nothing to do before the first load, which reads them all; an
        update that fails half way drops the copy (read whole on its next use)."""
        with self._lock:
            if self._grid is None:
                return
            try:
                rejected, undelivered, pairs = self._fill(self._grid, rows)
            except BaseException:
                self._drop()
                raise
            self._rejected += rejected
            self._undelivered += undelivered
            self._pairs += pairs
            self._version += 1

    def forget(self) -> None:
        """Drop the copy: the next use reads every row from the state again."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        self._grid = None
        self._rejected = self._undelivered = self._pairs = 0
        self._version += 1
        self._quarantine = None

    def loaded_rejected_total(self) -> int | None:
        """`rejected_total` when the copy is loaded, else None (without reading the state)."""
        with self._lock:
            return None if self._grid is None else self._rejected

    def totals(self) -> tuple[int, int, int]:
        """(pairs with a row, groups rejected, groups reported undelivered) over every pair,
        without copying the table (a million pairs at 1,000 nodes)."""
        with self._lock:
            self._loaded()
            return self._pairs, self._rejected, self._undelivered

    def rejected_total(self) -> int:
        """Groups rejected over every pair (each report counted once, as in the state)."""
        with self._lock:
            self._loaded()
            return self._rejected

    def estimates(self, nodes: Sequence[str]) -> np.ndarray:
        """(len(nodes), len(nodes)) float64: est[i, j], what matching ranks nodes[i] by as a
        source for nodes[j] (core.exchange.source_rank's first key): the pair's mean s where
        it has reports of groups it did not reject, +inf where it has none (unexplored),
        -inf for a NaN mean (it never wins)."""
        with self._lock:
            grid = self._loaded()
            at = grid.known(nodes)
            est = np.full((len(nodes), len(nodes)), math.inf)
            inside = np.flatnonzero(at >= 0)
            if inside.size:
                ix = np.ix_(at[inside], at[inside])
                known = grid.m["present"][ix] & (grid.m["groups"][ix] > 0)
                mean = grid.m["mean_s"][ix]
                est[np.ix_(inside, inside)] = np.where(known, np.where(np.isnan(mean), -math.inf, mean), math.inf)
            return est

    def of_receiver(self, receiver: str) -> dict[str, float]:
        """Source -> the pair's mean s, for the sources `receiver` reported groups of that it
        did not reject (what a single receiver's matching ranks by)."""
        with self._lock:
            grid = self._loaded()
            at = grid.known([receiver])[0]
            if at < 0:
                return {}
            known = grid.used("present")[:, at] & (grid.used("groups")[:, at] > 0)
            names, mean = grid.names, grid.m["mean_s"]
            return {names[i]: float(mean[i, at]) for i in np.flatnonzero(known)}

    def view(self, among: Iterable[str] | None = None) -> CompatView:
        """The pairs that have a row; with `among`, those whose source and receiver are both in it."""
        with self._lock:
            grid = self._loaded()
            present = grid.used("present")
            if among is not None:
                wanted = set(among)
                inside = np.array([x in wanted for x in grid.names], dtype=bool)
                present = present & inside[:, None] & inside[None, :]
            s, r = np.nonzero(present)
            m = grid.m
            return CompatView(names=list(grid.names), source=s, receiver=r, groups=m["groups"][s, r],
                              mean_s=m["mean_s"][s, r], admitted=m["admitted"][s, r], rejected=m["rejected"][s, r],
                              undelivered=m["undelivered"][s, r])

    def rows(self, among: Iterable[str] | None = None) -> list[CompatRow]:
        """The pairs' rows by (source, receiver), as `BrokerState.compat()` lists them; with
        `among`, only the pairs whose source and receiver are both in it."""
        v = self.view(among)
        names = v.names
        out = [CompatRow(source=names[i], receiver=names[j], groups=g, mean_s=ms, admitted_fraction=af, rejected=rj,
                         undelivered=u)
               for i, j, g, ms, af, rj, u in zip(v.source.tolist(), v.receiver.tolist(), v.groups.tolist(),
                                                 v.mean_s.tolist(), v.admitted.tolist(), v.rejected.tolist(),
                                                 v.undelivered.tolist())]
        out.sort(key=lambda c: (c.source, c.receiver))
        return out

    def quarantined(self, rate: float, min_reports: int, min_receivers: int,
                    trusted: Callable[[str], bool] = lambda _: False) -> set[str]:
        """broker/quarantine.py's rule on the counts; computed once per change of them (and
        of the rule's settings), `trusted` applied on every call (the allowlist may change)."""
        key = (rate, min_reports, min_receivers)
        with self._lock:
            grid = self._loaded()
            cached = self._quarantine
            if cached is None or cached[0] != (self._version, *key):
                present = grid.used("present")
                rejected = np.where(present, grid.used("rejected"), 0)
                # the groups received: those reported undelivered weigh in the pair's mean s
                # (as 0) but not in the rate, which a lying source could otherwise dilute by
                # withholding as many groups as it lies about
                reported = np.where(present, grid.used("groups") - grid.used("undelivered"), 0) + rejected
                cached = ((self._version, *key), quarantined_sources(grid.names, reported, rejected, *key))
                self._quarantine = cached
        return {s for s in cached[1] if not trusted(s)}


def pair_rows(exchange: ExchangeView, compat: CompatView, max_pairs: int | None = None) -> tuple[list[dict], int]:
    """The (source, receiver) pairs that exchanged a group or have a compatibility row, as
    the status lists them (by source, then receiver: groups, mean_s, admitted_fraction,
    rejected, reported, undelivered; NaN means and 0 counts where a pair has no row), and
    how many there are.
    With `max_pairs`, only that many: those with the most groups, ties by name. Computed on
    the arrays; only the pairs listed become Python objects (a million pairs at 1,000 nodes
    took 4 s as dicts, 2 s of it under the broker's lock, issue 13)."""
    names = sorted(set(exchange.names) | set(compat.names))
    rank = {name: i for i, name in enumerate(names)}
    width = max(1, len(names))

    def codes(view_names: list[str], source: np.ndarray, receiver: np.ndarray) -> np.ndarray:
        at = np.fromiter((rank[x] for x in view_names), dtype=np.int64, count=len(view_names))
        return at[source] * width + at[receiver] if len(source) else np.zeros(0, dtype=np.int64)

    ex_codes = codes(exchange.names, exchange.source, exchange.receiver)
    cx_codes = codes(compat.names, compat.source, compat.receiver)
    keys = np.union1d(ex_codes, cx_codes)  # sorted: by source name, then receiver name
    total = int(keys.size)
    groups = np.zeros(total, dtype=np.int64)
    groups[np.searchsorted(keys, ex_codes)] = exchange.groups
    if max_pairs is not None and total > max_pairs:
        keep = np.sort(np.argsort(-groups, kind="stable")[:max(0, max_pairs)])  # the most groups; ties by name
        keys, groups = keys[keep], groups[keep]
    order = np.argsort(cx_codes, kind="stable")
    found = np.searchsorted(cx_codes[order], keys)
    found = np.minimum(found, max(0, len(cx_codes) - 1))
    has = (cx_codes[order][found] == keys) if len(cx_codes) else np.zeros(len(keys), dtype=bool)
    at = order[found] if len(cx_codes) else found
    rows, reported = [], compat.reported
    for key, g, h, i in zip(keys.tolist(), groups.tolist(), has.tolist(), at.tolist()):
        rows.append({"source": names[key // width], "receiver": names[key % width], "groups": g,
                     "mean_s": float(compat.mean_s[i]) if h else math.nan,
                     "admitted_fraction": float(compat.admitted[i]) if h else math.nan,
                     "rejected": int(compat.rejected[i]) if h else 0,
                     "reported": int(reported[i]) if h else 0,
                     "undelivered": int(compat.undelivered[i]) if h else 0})
    return rows, total
