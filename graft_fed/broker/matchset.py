"""One synchronous round's matches as arrays, stored as one blob.

A round of 64 nodes x 4,096 prompts has some 80,000 matches. Writing them as one SQLite row
each, and reading them back per receiver to build its answer, took seconds after the last
publish (issue 13). A `MatchSet` holds the round's participants, its prompt columns and
four int32 arrays (receiver, column, source: participant indices and column numbers; and
the source group's k), sorted by (receiver, prompt id) - the order `BrokerState.matches` lists them in. It is
written once, in one transaction, and read back whole after a restart; the broker answers
from it in memory.

The encoding (`to_bytes`, `from_bytes`): the magic b"GFM2", a 4-byte little-endian length,
a JSON header {"round", "nodes", "pids", "count", "w"}, then the four arrays as
little-endian signed integers, each in the narrowest width that holds it ("w": bytes per
value of each, 1, 2, 4 or 8; at 64 x 4,096 a round is stored in 5 bytes a match instead of
16, and SQLite's insert costs by the byte). Sets stored before (b"GFM1": all four int32)
still decode. It imports neither the generated protobuf code nor a state implementation:
both state backends and the handlers use it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from graft_fed.broker.state import MatchRow
from graft_fed.federation.summaryblock import INT_DTYPES, int_width

MAGIC = b"GFM2"
_MAGIC_V1 = b"GFM1"  # every array int32 (sets stored before the narrow widths)


_ORDERS: "OrderedDict[tuple[str, ...], np.ndarray]" = OrderedDict()  # the last few prompt-id orders
_ORDERS_LOCK = threading.Lock()


COLUMN_GRID_CELLS = 1 << 26  # up to this many (node, prompt) cells, columns_by_source marks a grid (64 MiB)


def pid_order(pids: Sequence[str]) -> np.ndarray:
    """The column numbers of `pids` in prompt-id order, remembered for the last few lists (a
    synchronous round's columns are the same list round after round). Read-only."""
    key = tuple(pids)
    with _ORDERS_LOCK:
        order = _ORDERS.get(key)
        if order is not None:
            _ORDERS.move_to_end(key)
            return order
    order = np.array(sorted(range(len(key)), key=key.__getitem__), dtype=np.int64)
    order.flags.writeable = False
    with _ORDERS_LOCK:
        _ORDERS[key] = order
        while len(_ORDERS) > 4:
            _ORDERS.popitem(last=False)
    return order


def _row_keys(receiver: np.ndarray, col: np.ndarray, pids: Sequence[str]) -> np.ndarray:
    """One int64 per row that orders rows as a match set holds them: by receiver, then by
    the column's place in prompt-id order (equal keys: the same receiver and prompt)."""
    order = pid_order(pids)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return receiver.astype(np.int64) * max(1, len(pids)) + rank[col]


def _in_id_order(pids: Sequence[str]) -> bool:
    ids = list(pids)
    return all(map(str.__lt__, ids, ids[1:]))


class MatchSetError(ValueError):
    """A stored match set that does not decode (a damaged state file)."""


class MatchSet:
    def __init__(self, round: int, nodes: Sequence[str], pids: Sequence[str], receiver: np.ndarray,
                 col: np.ndarray, source: np.ndarray, k: np.ndarray) -> None:
        self.round = int(round)
        self.nodes = list(nodes)
        self.pids = list(pids)
        self.receiver = np.ascontiguousarray(receiver, dtype=np.int32)
        self.col = np.ascontiguousarray(col, dtype=np.int32)
        self.source = np.ascontiguousarray(source, dtype=np.int32)
        self.k = np.ascontiguousarray(k, dtype=np.int32)
        self._pos = {n: i for i, n in enumerate(self.nodes)}
        # receiver i's matches are [start[i], start[i + 1]) (rows are sorted by receiver)
        self._start = np.searchsorted(self.receiver, np.arange(len(self.nodes) + 1)).astype(np.int64)

    @classmethod
    def from_choice(cls, round: int, nodes: Sequence[str], pids: Sequence[str], k: np.ndarray,
                    chosen: Sequence[tuple[np.ndarray, np.ndarray]]) -> "MatchSet":
        """From broker.matching.select_sources_arrays' result (per receiver index:
        (columns, source indices)) on the (N, P) matrix `k`; rows sorted by (receiver,
        prompt id). Columns that are in prompt-id order already (the matcher's) are taken as
        they come; otherwise the rows are sorted once by (receiver, a column's place in
        prompt-id order). A receiver given one prompt twice is a ValueError."""
        empty = np.zeros(0, dtype=np.int32)
        sizes = [len(c) for c, _ in chosen]
        if not sum(sizes):
            return cls(round, nodes, pids, empty, empty, empty, empty)
        if all(len(c) < 2 or bool((np.diff(c) > 0).all()) for c, _ in chosen) and _in_id_order(pids):
            # columns already in prompt-id order (the matcher sorts a round's columns before
            # it selects), each receiver's ascending: the rows are in order as they come
            rows = np.repeat(np.arange(len(chosen), dtype=np.int32), sizes)
            col = np.concatenate([np.asarray(c, dtype=np.int64) for c, _ in chosen])
            src = np.concatenate([np.asarray(s_, dtype=np.int64) for _, s_ in chosen])
            return cls(round, nodes, pids, rows, col, src, np.asarray(k)[src, col])
        recv = np.repeat(np.arange(len(chosen), dtype=np.int64), sizes)
        col = np.concatenate([np.asarray(c, dtype=np.int64) for c, _ in chosen])
        src = np.concatenate([np.asarray(s_, dtype=np.int64) for _, s_ in chosen])
        key = _row_keys(recv, col, pids)
        order = np.argsort(key, kind="stable")
        if bool((np.diff(key[order]) == 0).any()):
            raise ValueError("a receiver's prompt was chosen twice")
        col, src = col[order], src[order]
        return cls(round, nodes, pids, recv[order], col, src, np.asarray(k)[src, col])

    def __len__(self) -> int:
        return int(self.receiver.size)

    def index(self, node: str) -> int | None:
        return self._pos.get(node)

    def for_receiver(self, node: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(columns, source indices, k) of the receiver's matches, in prompt-id order."""
        i = self._pos.get(node)
        if i is None:
            empty = np.zeros(0, dtype=np.int32)
            return empty, empty, empty
        lo, hi = int(self._start[i]), int(self._start[i + 1])
        return self.col[lo:hi], self.source[lo:hi], self.k[lo:hi]

    def columns_by_source(self, receivers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For a mask over the nodes, (starts, columns): source j's distinct prompt columns
        among the matches whose receiver is in the mask are columns[starts[j]:starts[j + 1]],
        ascending."""
        width = max(1, len(self.pids))
        rows = np.asarray(receivers, dtype=bool)[self.receiver]
        if len(self.nodes) * width <= COLUMN_GRID_CELLS:
            # a mark per (source, column) and its marks in row-major order: the same sorted
            # keys as np.unique's, without sorting a round's matches (at 64 x 4,096, 80,000 of
            # them: 15-30 ms in the first answer of every round while nodes reported)
            grid = np.zeros((len(self.nodes), width), dtype=bool)
            grid[self.source[rows], self.col[rows]] = True
            src, cols = np.nonzero(grid)
            starts = np.searchsorted(src, np.arange(len(self.nodes) + 1))
            return starts, cols.astype(np.int64)
        key = np.unique(self.source[rows].astype(np.int64) * width + self.col[rows])
        starts = np.searchsorted(key, np.arange(len(self.nodes) + 1, dtype=np.int64) * width)
        return starts, key % width

    def rows(self, receiver: str | None = None, source: str | None = None) -> list[MatchRow]:
        """MatchRows (source_round = round), in (receiver, prompt id) order."""
        if receiver is not None:
            i = self._pos.get(receiver)
            if i is None:
                return []
            sel = np.arange(int(self._start[i]), int(self._start[i + 1]))
        else:
            sel = np.arange(len(self))
        if source is not None:
            j = self._pos.get(source)
            if j is None:
                return []
            sel = sel[self.source[sel] == j]
        nodes, pids, r = self.nodes, self.pids, self.round
        return [MatchRow(round=r, receiver=nodes[a], prompt_id=pids[c], source=nodes[s], source_round=r)
                for a, c, s in zip(self.receiver[sel].tolist(), self.col[sel].tolist(), self.source[sel].tolist())]

    def offered(self, receiver: str) -> set[tuple[str, str]]:
        """The receiver's (source, prompt id) pairs: what `rows(receiver=...)` holds, without
        a MatchRow each (a report of a thousand groups is checked against them)."""
        i = self._pos.get(receiver)
        if i is None:
            return set()
        sel = slice(int(self._start[i]), int(self._start[i + 1]))
        nodes, pids = self.nodes, self.pids
        return set(zip([nodes[s] for s in self.source[sel].tolist()], [pids[c] for c in self.col[sel].tolist()]))

    def to_bytes(self) -> bytes:
        arrays = (self.receiver, self.col, self.source, self.k)
        widths = [int_width(a) for a in arrays]
        header = json.dumps({"round": self.round, "nodes": self.nodes, "pids": self.pids, "count": len(self),
                             "w": widths}, separators=(",", ":")).encode("utf-8")
        return b"".join([MAGIC, len(header).to_bytes(4, "little"), header,
                         *(a.astype(INT_DTYPES[w]).tobytes() for a, w in zip(arrays, widths))])

    @classmethod
    def from_bytes(cls, data: bytes) -> "MatchSet":
        try:
            if data[:4] not in (MAGIC, _MAGIC_V1):
                raise ValueError("bad magic")
            size = int.from_bytes(data[4:8], "little")
            head = json.loads(data[8:8 + size].decode("utf-8"))
            if not isinstance(head, dict):
                raise ValueError("its header is not an object")
            count, round_ = head["count"], head["round"]
            if type(count) is not int or count < 0 or type(round_) is not int:
                raise ValueError(f"count {count!r} and round {round_!r} must be integers, count >= 0")
            widths = head["w"] if data[:4] == MAGIC else [4, 4, 4, 4]
            if (not isinstance(widths, list) or len(widths) != 4
                    or any(type(w) is not int or w not in INT_DTYPES for w in widths)):
                raise ValueError(f"widths {widths!r} are not four of 1, 2, 4, 8")
            body = memoryview(data)[8 + size:]
            if len(body) != sum(widths) * count:
                raise ValueError(f"{len(body)} bytes of arrays for {count} matches")
            nodes, pids = head["nodes"], head["pids"]
            for name, ids in (("node", nodes), ("prompt", pids)):
                if not isinstance(ids, list) or not all(type(x) is str for x in ids):
                    raise ValueError(f"its {name} ids are not a list of strings")
                if len(set(ids)) != len(ids):
                    raise ValueError(f"its {name} ids repeat")
            arrays, at = [], 0
            for w in widths:
                arrays.append(np.frombuffer(body[at:at + w * count], dtype=INT_DTYPES[w]).astype(np.int64))
                at += w * count
            receiver, col, source, k = arrays
            for a, hi in ((receiver, len(nodes)), (col, len(pids)), (source, len(nodes))):
                if a.size and (int(a.min()) < 0 or int(a.max()) >= hi):
                    raise ValueError("it refers to nodes or prompts it does not hold")
            if k.size and (int(k.min()) < -2**31 or int(k.max()) >= 2**31):
                raise ValueError("a k outside int32")
            if count > 1:
                key = _row_keys(receiver, col, pids)
                if bool((key[1:] <= key[:-1]).any()):
                    raise ValueError("its matches are not in (receiver, prompt id) order, each once")
            out = cls(round_, nodes, pids, *arrays)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError, RecursionError) as exc:
            raise MatchSetError(f"a stored match set does not decode ({exc})") from None
        return out
