"""One publish's summaries as columns, stored as one blob.

A publish of 4,096 summaries used to become 4,096 Python objects four times over and 4,096
SQLite rows with two JSON lists each: about 50 us of interpreter time per summary, when
gRPC moves one in well under a microsecond (issue 13). A `SummaryBlock` holds one node's
summaries of one round as numpy columns; validation runs on the columns, the round index
takes k from them, and the state writes the block as one blob (`to_bytes`). Rows
(`SummaryRow`) are built only where a caller reads them (a bundle checked against its
summary, a report re-checked), from the blob.

Per-response lists may have any length here (the state does not judge them; the broker's
handlers require n of each): `lengths` and `mean_logprobs` are flat arrays with a count per
summary. `digests` (None when all are empty) are the summaries' bundle digests as given:
the state keeps digests apart from the blob (they arrive later, with the bundles).

The encoding: b"GFS2", a 4-byte little-endian length, a JSON header {"node_id", "round",
"prompt_ids", "nl", "nm", "w"}, then little-endian arrays: policy_version, n, k,
reward_mean, reward_std (float64), the count of lengths and of mean log-probs per summary,
the flat lengths, the flat mean log-probs (float64). Each integer column is stored in the
narrowest signed width that holds its values, "w" lists those widths in bytes (1, 2, 4 or
8) in column order: a stored row of 8 responses is about 115 bytes rather than 200, and the
state's write (SQLite's pages, its WAL and the checkpoint's copy) is per byte (issue 13).
Floats keep their bits (-0.0, NaN payloads, subnormals). Blocks stored before, b"GFS1"
(every integer column int64, no "w"), decode as they always did.

Prompt-id lists are interned (`intern_ids`): the nodes of a round publish the same prompts in
the same order, so the broker keeps the lists of the last few publishes and hands every
equal list out as the same object, with a memo (`facts_of`) of what the broker has worked
out about it once (unique, known to the federation, its JSON): per publish, one join and
one dictionary look-up instead of a set, a superset test and a JSON encoding of 4,096
strings (issue 13). An interned list is shared: nothing may change it in place.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import numpy as np

from graft_fed.federation.messages import SummaryRow

MAGIC = b"GFS2"
_MAGIC_V1 = b"GFS1"  # every integer column int64 (blocks stored before the narrow widths)
_I8, _F8 = np.dtype("<i8"), np.dtype("<f8")
INT_DTYPES = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: _I8}
# the stored columns in order: (attribute, integer?)
_COLUMNS = (("policy_version", True), ("n", True), ("k", True), ("reward_mean", False), ("reward_std", False),
            ("n_lengths", True), ("n_logprobs", True), ("lengths", True), ("mean_logprobs", False))


def holds_as_int64(a: np.ndarray) -> bool:
    """Whether an array is of an integer type whose every value int64 holds (a publish's
    unsigned 32-bit columns are kept as they came: widening them cost a copy each, and the
    encoding narrows them again)."""
    return a.dtype.kind in "iu" and np.can_cast(a.dtype, _I8, casting="safe")


def int_width(a: np.ndarray) -> int:
    """The narrowest signed width (bytes) that holds every value of an integer column."""
    if not a.size:
        return 1
    lo, hi = (0 if a.dtype.kind == "u" else int(a.min())), int(a.max())
    for w in (1, 2, 4):
        bound = 1 << (8 * w - 1)
        if -bound <= lo and hi < bound:
            return w
    return 8


class SummaryBlockError(ValueError):
    """A stored block that does not decode (a damaged state file)."""


class _Interned:
    __slots__ = ("ids", "facts")

    def __init__(self, ids: list[str]) -> None:
        self.ids, self.facts = ids, {}


_INTERN_KEEP = 8
_interned: OrderedDict[str, _Interned] = OrderedDict()  # the ids joined by NUL -> the list
_interned_by_id: dict[int, _Interned] = {}
_intern_lock = threading.Lock()


def intern_ids(pids: list[str]) -> list[str]:
    """`pids`, or the equal list (the same object) that one of the last few calls returned.
    A list that is not all strings, or with an id holding NUL, is returned as it is."""
    try:
        key = "\x00".join(pids)
    except TypeError:
        return pids
    if key.count("\x00") != len(pids) - 1:  # empty, or an id with NUL in it: the key would be ambiguous
        return pids
    with _intern_lock:
        got = _interned.get(key)
        if got is not None:
            _interned.move_to_end(key)
            return got.ids
        entry = _interned[key] = _interned_by_id[id(pids)] = _Interned(pids)
        while len(_interned) > _INTERN_KEEP:
            _, old = _interned.popitem(last=False)
            del _interned_by_id[id(old.ids)]
        return entry.ids


def facts_of(pids: Any) -> dict | None:
    """The memo of an interned list (None for any other list): what callers worked out about
    it, under keys of their own."""
    got = _interned_by_id.get(id(pids))
    return got.facts if got is not None and got.ids is pids else None


def _ids_json(pids: list[str]) -> bytes:
    """The prompt ids as JSON (ASCII: json.dumps escapes the rest), memoised for an interned list."""
    facts = facts_of(pids)
    if facts is None:
        return json.dumps(pids, separators=(",", ":")).encode()
    got = facts.get("json")
    if got is None:
        got = facts["json"] = json.dumps(pids, separators=(",", ":")).encode()
    return got


class SummaryBlock:
    __slots__ = ("node_id", "round", "prompt_ids", "policy_version", "n", "k", "reward_mean", "reward_std",
                 "n_lengths", "n_logprobs", "lengths", "mean_logprobs", "digests")

    def __init__(self, node_id: str, round: int, prompt_ids: list[str], policy_version: np.ndarray, n: np.ndarray,
                 k: np.ndarray, reward_mean: np.ndarray, reward_std: np.ndarray, n_lengths: np.ndarray,
                 n_logprobs: np.ndarray, lengths: np.ndarray, mean_logprobs: np.ndarray,
                 digests: list[str] | None = None) -> None:
        self.node_id, self.round, self.prompt_ids = node_id, round, prompt_ids
        self.policy_version, self.n, self.k = policy_version, n, k
        self.reward_mean, self.reward_std = reward_mean, reward_std
        self.n_lengths, self.n_logprobs = n_lengths, n_logprobs
        self.lengths, self.mean_logprobs = lengths, mean_logprobs
        self.digests = digests if digests is not None and any(digests) else None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @classmethod
    def from_columns(cls, node_id: str, round: int, prompt_ids: list[str], policy_version: Sequence[int],
                     n: Sequence[int], k: Sequence[int], reward_mean: Sequence[float], reward_std: Sequence[float],
                     n_lengths: Sequence[int], n_logprobs: Sequence[int], lengths: Sequence[int],
                     mean_logprobs: Sequence[float], digests: list[str] | None = None) -> "SummaryBlock":
        """From plain sequences (or arrays); integers must fit int64 (OverflowError, else)."""
        def ints(v) -> np.ndarray:
            return np.asarray(v, dtype=np.int64) if len(v) else np.zeros(0, dtype=np.int64)

        def floats(v) -> np.ndarray:
            return np.asarray(v, dtype=np.float64) if len(v) else np.zeros(0, dtype=np.float64)

        return cls(node_id, round, list(prompt_ids), ints(policy_version), ints(n), ints(k), floats(reward_mean),
                   floats(reward_std), ints(n_lengths), ints(n_logprobs), ints(lengths), floats(mean_logprobs),
                   digests)

    @classmethod
    def from_rows(cls, rows: Sequence[SummaryRow]) -> "SummaryBlock":
        """Rows of one (node, round), already normalised (plain ints and floats)."""
        return cls.from_columns(
            rows[0].node_id if rows else "", rows[0].round if rows else 0, [r.prompt_id for r in rows],
            [r.policy_version for r in rows], [r.n for r in rows], [r.k for r in rows],
            [r.reward_mean for r in rows], [r.reward_std for r in rows], [len(r.lengths) for r in rows],
            [len(r.mean_logprobs) for r in rows], [x for r in rows for x in r.lengths],
            [x for r in rows for x in r.mean_logprobs], [r.bundle_digest for r in rows])

    def select(self, keep: np.ndarray) -> "SummaryBlock":
        """The block's summaries where `keep` (bool, one per summary) is true."""
        lo_l = np.repeat(keep, self.n_lengths)
        lo_m = np.repeat(keep, self.n_logprobs)
        return SummaryBlock(self.node_id, self.round, [p for p, w in zip(self.prompt_ids, keep.tolist()) if w],
                            self.policy_version[keep], self.n[keep], self.k[keep], self.reward_mean[keep],
                            self.reward_std[keep], self.n_lengths[keep], self.n_logprobs[keep], self.lengths[lo_l],
                            self.mean_logprobs[lo_m],
                            None if self.digests is None else [d for d, w in zip(self.digests, keep.tolist()) if w])

    def rows(self, digests: dict[str, str] | None = None, wanted: set[str] | None = None) -> list[SummaryRow]:
        """SummaryRows (with their bundle digests from `digests`, prompt id -> digest; the
        block's own when None), only those whose prompt id is in `wanted` when given; in
        block order."""
        ol = np.concatenate([[0], np.cumsum(self.n_lengths, dtype=np.int64)]).tolist()
        om = np.concatenate([[0], np.cumsum(self.n_logprobs, dtype=np.int64)]).tolist()
        lengths, logprobs = self.lengths.tolist(), self.mean_logprobs.tolist()
        cols = zip(self.prompt_ids, self.policy_version.tolist(), self.n.tolist(), self.k.tolist(),
                   self.reward_mean.tolist(), self.reward_std.tolist())
        if digests is None:
            digests = dict(zip(self.prompt_ids, self.digests)) if self.digests is not None else {}
        out = []
        for i, (pid, pv, n, k, rm, rs) in enumerate(cols):
            if wanted is not None and pid not in wanted:
                continue
            out.append(SummaryRow(node_id=self.node_id, round=self.round, prompt_id=pid, policy_version=pv, n=n, k=k,
                                  reward_mean=rm, reward_std=rs, lengths=lengths[ol[i]:ol[i + 1]],
                                  mean_logprobs=logprobs[om[i]:om[i + 1]], bundle_digest=digests.get(pid, "")))
        return out

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts())

    def to_parts(self) -> list:
        """The encoding (`to_bytes`) as the buffers it joins, in order: the magic and header,
        then the columns, each a view where the column is of its stored type already. A
        writer that takes several buffers (`os.pwritev`) stores them without the join's
        copy of the whole block (about 0.2 ms a publish at 4,096 prompts, issue 13)."""
        cols = []
        widths = []
        encoded: dict[int, tuple[int, memoryview]] = {}  # a column given twice (a publish's counts): once
        for name, integer in _COLUMNS:
            a = getattr(self, name)
            if integer:
                got = encoded.get(id(a))
                if got is None:
                    arr = np.asarray(a)
                    if not holds_as_int64(arr):
                        arr = np.asarray(arr, dtype=np.int64)
                    w = int_width(arr)
                    got = encoded[id(a)] = (w, np.ascontiguousarray(arr, dtype=INT_DTYPES[w]).data.cast("B"))
                widths.append(got[0])
                cols.append(got[1])
            else:  # already of the stored type: in as it is (no copy; a view of the buffer)
                cols.append(np.ascontiguousarray(a, dtype=_F8).data.cast("B"))
        # what json.dumps({"node_id", "round", "prompt_ids", "nl", "nm", "w"}) writes, in
        # three pieces: the prompt ids' JSON (memoised, encoded, for an interned list) between
        head = f'{{"node_id":{json.dumps(self.node_id)},"round":{json.dumps(self.round)},"prompt_ids":'.encode()
        ids = _ids_json(self.prompt_ids)
        tail = (f',"nl":{int(self.lengths.size)},"nm":{int(self.mean_logprobs.size)},'
                f'"w":[{",".join(map(str, widths))}]}}').encode()
        size = len(head) + len(ids) + len(tail)
        return [MAGIC + size.to_bytes(4, "little") + head, ids, tail, *cols]

    @staticmethod
    def header(data: bytes) -> tuple[dict, int]:
        """(the JSON header, where the arrays start) of an encoded block; its fields checked
        (types, counts not negative, the integer widths), SummaryBlockError if one is wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SummaryBlockError(f"a stored summary block does not decode (a {type(data).__name__}, not bytes)")
        magic = bytes(data[:4])
        if magic not in (MAGIC, _MAGIC_V1):
            raise SummaryBlockError("a stored summary block does not decode (bad magic)")
        size = int.from_bytes(data[4:8], "little")
        try:
            head = json.loads(bytes(data[8:8 + size]).decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise SummaryBlockError(f"a stored summary block does not decode ({exc})") from None
        if magic == _MAGIC_V1 and isinstance(head, dict):
            head["w"] = [8] * 6
        problem = _header_problem(head)
        if problem:
            raise SummaryBlockError(f"a stored summary block does not decode ({problem})")
        return head, 8 + size

    @staticmethod
    def _layout(head: dict) -> list[tuple[int, np.dtype]]:
        """(element count, stored dtype) of each column, in order, for a checked header."""
        it = iter(head["w"])
        sizes = [len(head["prompt_ids"])] * 7 + [head["nl"], head["nm"]]
        return [(size, INT_DTYPES[next(it)] if integer else _F8) for size, (_, integer) in zip(sizes, _COLUMNS)]

    @classmethod
    def _body(cls, data: bytes) -> tuple[dict, list[tuple[int, np.dtype]], memoryview]:
        """(the checked header, the columns' layout, the arrays' bytes) of an encoded block
        whose arrays take exactly the bytes after the header (SummaryBlockError, else)."""
        head, off = cls.header(data)
        layout = cls._layout(head)
        body = memoryview(data)[off:]
        expected = sum(size * dtype.itemsize for size, dtype in layout)
        if len(body) != expected:
            raise SummaryBlockError(f"a stored summary block does not decode ({len(body)} bytes of arrays, "
                                    f"expected {expected})")
        return head, layout, body

    @classmethod
    def from_bytes(cls, data: bytes) -> "SummaryBlock":
        head, layout, body = cls._body(data)
        try:
            arrays, pos = [], 0
            for size, dtype in layout:
                a = np.frombuffer(body[pos:pos + size * dtype.itemsize], dtype=dtype)
                arrays.append(a if dtype in (_I8, _F8) else a.astype(np.int64))  # int64 in memory
                pos += size * dtype.itemsize
            pv, n, k, rm, rs, cl, cm, lengths, logprobs = arrays
            for counts, flat in ((cl, lengths), (cm, logprobs)):
                # each count in [0, the flat array's size], so that their sum cannot wrap
                if (counts.size and (int(counts.min()) < 0 or int(counts.max()) > flat.size)
                        or int(counts.sum()) != flat.size):
                    raise ValueError("per-summary counts disagree with the flat arrays")
            return cls(head["node_id"], head["round"], list(head["prompt_ids"]), pv, n, k, rm, rs, cl, cm,
                       lengths, logprobs)
        except (ValueError, KeyError, TypeError) as exc:
            raise SummaryBlockError(f"a stored summary block does not decode ({exc})") from None

    @classmethod
    def heads_of(cls, data: bytes) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(prompt ids, n, k) of an encoded block, without decoding the rest."""
        head, layout, body = cls._body(data)
        (c0, t0), (c1, t1), (c2, t2) = layout[:3]
        at = c0 * t0.itemsize
        n = np.frombuffer(body[at:at + c1 * t1.itemsize], dtype=t1)
        at += c1 * t1.itemsize
        k = np.frombuffer(body[at:at + c2 * t2.itemsize], dtype=t2)
        return list(head["prompt_ids"]), n.astype(np.int64), k.astype(np.int64)


def _header_problem(head: Any) -> str:
    """What is wrong with a decoded block header ("" when nothing is)."""
    if not isinstance(head, dict):
        return "its header is not an object"
    for key in ("node_id", "round", "prompt_ids", "nl", "nm", "w"):
        if key not in head:
            return f"its header has no {key!r}"
    if not isinstance(head["node_id"], str):
        return "node_id is not a string"
    if type(head["round"]) is not int:
        return "round is not an integer"
    ids = head["prompt_ids"]
    if not isinstance(ids, list) or not all(type(p) is str for p in ids):
        return "prompt_ids is not a list of strings"
    for key in ("nl", "nm"):
        if type(head[key]) is not int or head[key] < 0:
            return f"{key} is not a count"
    widths = head["w"]
    if not isinstance(widths, list) or len(widths) != 6 or any(type(w) is not int or w not in INT_DTYPES
                                                               for w in widths):
        return f"integer widths {str(widths)[:60]}: six of 1, 2, 4 or 8"
    return ""


def group_rows(rows: Iterable[SummaryRow]) -> list[list[SummaryRow]]:
    """Rows split by (node, round), each group in input order, groups in first-seen order."""
    groups: dict[tuple[str, int], list[SummaryRow]] = {}
    for r in rows:
        groups.setdefault((r.node_id, r.round), []).append(r)
    return list(groups.values())
