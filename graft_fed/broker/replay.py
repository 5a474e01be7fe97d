"""Replay protection for the state-changing RPCs.

TLS already stops an on-path attacker from replaying traffic inside or across
connections. What is left at the application level is a request delivered twice: a
node's own retry after a lost reply, or a copy replayed by whoever could read it (an
`insecure` network, a TLS-terminating proxy, a request log). So every state-changing
request (Join, Leave, Heartbeat, PublishSummaries, UploadBundle, ReportCompatibility)
carries a tag: a request id the node draws at random (128 bits) and the time the node
sent it. The broker

- refuses a send time more than `window_s` from its own clock (FAILED_PRECONDITION: the
  request is stale, or the node's clock is off), so a captured request is useless once
  the window has passed;
- refuses a request id it has already applied for that node within the window
  (ALREADY_EXISTS; the first application stands and nothing is applied again), and one
  that is still being processed (ABORTED: retry shortly);
- forgets a request id once its send time is more than `window_s` old (a replay of it is
  then refused by its timestamp), and keeps at most `max_per_node` ids per node (beyond it
  the node's oldest eighth is forgotten at once), so its memory is bounded however long the
  broker runs.

The memory of request ids lives in the broker's process and does not survive a restart,
by design: every state change those RPCs make is idempotent in the durable state, so a
request replayed to a restarted broker within the window changes nothing. Summaries are
keyed by (node, round, prompt) and bundles by their digest; reports by (round, receiver,
source, prompt); a heartbeat only moves a node's round forward and refreshes its liveness
(which a replay within the window could extend by at most the window); Leave of a session
that has left is refused. The one exception is Join, which opens a new session: replayed
to a restarted broker within the window, it would end the node's current session and the
node would re-join at its next call; no data changes.

A request id is remembered only once its request has been applied: a request that was
refused (any error) can be retried with the same id.

Memory: a busy federation applies hundreds of requests per second, and each id is kept for
the whole window (at 256 nodes x 256 prompts about 95,000 of them). Kept as Python strings
in per-node dicts, that was about 165 bytes (traced) and three to four interpreter objects
per id, filled over the first `window_s` of every broker life and churned for good after
(docs/performance.md, issue 13, "thirty-fifth pass"). `RequestIds` keeps each one as a
128-bit keyed fingerprint, its expiry and its node in sorted numpy columns (24 bytes; 27
traced with the rest), with only the last few seconds' ids in a dict.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from graft_fed.federation.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument

log = logging.getLogger("graft_fed.broker")

REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
MAX_IDS_PER_NODE = 16384
_LOW64 = (1 << 64) - 1


@dataclass(frozen=True)
class Ticket:
    node_id: str
    request_id: str
    fingerprint: int
    expires: float


class RequestIds:
    """The (node, request id) pairs applied within the window, compactly.

    Each pair is a 128-bit fingerprint (BLAKE2b keyed with a secret drawn at start, so no
    sender can aim at another's ids; two distinct pairs share one with odds of about 2^-128
    per pair). Ids added in the last `merge_s` seconds sit in a dict; `merge` folds them
    into three columns sorted by the fingerprint's high half (uint64 high, uint64 low,
    uint32 expiry in whole seconds from `epoch`, rounded up) plus the node as an index into
    a list of names, dropping what expired. Lookups are a dict probe and a binary search.
    The columns live in buffers kept from merge to merge (grown or shrunk only when the ids
    held change by a quarter or more), so a busy broker does not place a new set of
    long-lived arrays in its heap every few seconds (issue 13's RSS run).

    An id is remembered at least until its expiry and at most `merge_s` seconds longer
    (harmless: a request sent that long ago is refused by its timestamp first). Not
    thread-safe: ReplayGuard calls it under its lock.
    """

    def __init__(self, max_per_node: int, epoch: float, merge_s: float = 10.0, merge_at: int = 8192) -> None:
        self.max_per_node = max_per_node
        self.epoch = math.floor(epoch)
        self.merge_s = merge_s
        self.merge_at = merge_at
        self._key = os.urandom(32)
        self._recent: dict[int, tuple[float, str]] = {}  # fingerprint -> (expires, node)
        # the columns' buffers, kept from merge to merge (their capacity grows and shrinks by
        # a quarter or more at a time); _hi, _lo, _exp and _node are views of their first n
        self._buf = {"hi": np.empty(0, np.uint64), "lo": np.empty(0, np.uint64),
                     "exp": np.empty(0, np.uint32), "node": np.empty(0, np.int32)}
        self._view(0)
        self._names: list[str] = []
        self._count: dict[str, int] = {}  # ids held per node, expired ones not yet dropped included
        self._next_expiry = math.inf  # the earliest expiry held (recent or columns)
        self._merged_at = -math.inf
        self.evicted = 0

    def fingerprint(self, node_id: str, request_id: str) -> int:
        h = hashlib.blake2b(node_id.encode("utf-8", "surrogatepass"), digest_size=16, key=self._key)
        h.update(b"\0" + request_id.encode("ascii"))
        return int.from_bytes(h.digest(), "little")

    def __len__(self) -> int:
        return len(self._recent) + len(self._hi)

    def __contains__(self, fp: int) -> bool:
        if fp in self._recent:
            return True
        hi, lo = np.uint64(fp >> 64), np.uint64(fp & _LOW64)
        i = int(self._hi.searchsorted(hi))
        while i < len(self._hi) and self._hi[i] == hi:
            if self._lo[i] == lo:
                return True
            i += 1
        return False

    def add(self, fp: int, node_id: str, expires: float, now: float) -> int:
        """Remember one id; returns how many ids of its node were forgotten early to keep it
        within `max_per_node`."""
        self._recent[fp] = (expires, node_id)
        self._next_expiry = min(self._next_expiry, expires)
        held = self._count[node_id] = self._count.get(node_id, 0) + 1
        if len(self._recent) >= max(self.merge_at, len(self._hi) // 4):
            self.merge(now)
        if held > self.max_per_node:
            return self._evict_oldest(node_id, now)
        return 0

    def due(self, now: float) -> bool:
        """Whether `merge` has something to drop and its interval has passed."""
        return now > self._next_expiry and now - self._merged_at >= self.merge_s

    def merge(self, now: float) -> int:
        """Fold the recent ids into the columns and drop the expired ones; returns how many
        were dropped."""
        keep_until = math.ceil(now - self.epoch)  # an expiry in whole seconds >= this is kept
        n_recent = len(self._recent)
        hi = np.empty(n_recent, np.uint64)
        lo = np.empty(n_recent, np.uint64)
        exp = np.empty(n_recent, np.uint32)
        node = np.empty(n_recent, np.int32)
        index = {name: i for i, name in enumerate(self._names)}
        names = self._names
        for k, (fp, (expires, node_id)) in enumerate(self._recent.items()):
            hi[k], lo[k] = fp >> 64, fp & _LOW64
            exp[k] = max(0, math.ceil(expires - self.epoch))
            i = index.get(node_id)
            if i is None:
                i = index[node_id] = len(names)
                names.append(node_id)
            node[k] = i
        old_live, new_live = self._exp >= keep_until, exp >= keep_until
        dropped = 0
        for nodes, live in ((self._node, old_live), (node, new_live)):
            gone = nodes[~live]
            dropped += len(gone)
            for i, c in enumerate(np.bincount(gone, minlength=len(names)).tolist() if len(gone) else ()):
                if c:
                    self._uncount(names[i], c)
        if not old_live.all():
            self._compact(old_live)
        pick = np.flatnonzero(new_live)
        pick = pick[np.argsort(hi[pick], kind="stable")]  # the live new ids, by their high half
        self._insert({"hi": hi[pick], "lo": lo[pick], "exp": exp[pick], "node": node[pick]})
        if len(names) - len(self._count) > len(self._count):  # most names hold no id any more
            self._forget_names()
        self._recent = {}
        self._next_expiry = self.epoch + float(self._exp.min()) if len(self._exp) else math.inf
        self._merged_at = now
        return dropped

    def _view(self, n: int) -> None:
        self._hi, self._lo, self._exp, self._node = (self._buf[c][:n] for c in ("hi", "lo", "exp", "node"))

    def _fit(self, n: int) -> None:
        """Give the buffers room for n ids (the columns' ids kept): grown to n and a
        quarter when short, shrunk to twice n when n fills less than a quarter of them."""
        cap = len(self._buf["hi"])
        if cap >= n and not (n < cap // 4 and cap > 1024):
            return
        new_cap = max(1024, n + n // 4) if cap < n else max(1024, 2 * n)
        held = len(self._hi)
        for c, old in self._buf.items():
            buf = np.empty(new_cap, old.dtype)
            buf[:held] = old[:held]
            self._buf[c] = buf
        self._view(held)

    def _compact(self, keep: np.ndarray) -> None:
        """Keep only the ids where `keep` is true, in their order, in the same buffers."""
        n = int(np.count_nonzero(keep))
        for col in self._buf.values():
            col[:n] = col[:len(keep)][keep]  # the right side is a copy: no overlap
        self._view(n)
        self._fit(n)

    def _insert(self, recent: dict[str, np.ndarray]) -> None:
        """Merge ids sorted by their high half into the columns (sorted by it too)."""
        r = len(recent["hi"])
        if not r:
            return
        n = len(self._hi)
        total = n + r
        at = np.searchsorted(self._hi, recent["hi"], side="right") + np.arange(r)  # where each new id lands
        old_at = np.ones(total, bool)
        old_at[at] = False
        self._fit(total)
        for c, new in recent.items():
            col = self._buf[c]
            old = col[:n].copy()
            col[:total][old_at] = old
            col[at] = new
        self._view(total)

    def _forget_names(self) -> None:
        """Drop the names of nodes that hold no id, renumbering the columns' node index."""
        keep = np.zeros(len(self._names), bool)
        keep[[i for i, name in enumerate(self._names) if name in self._count]] = True
        renumber = np.cumsum(keep, dtype=np.int32) - 1
        self._node[:] = renumber[self._node]
        self._names = [name for name, k in zip(self._names, keep.tolist()) if k]

    def _uncount(self, node_id: str, c: int) -> None:
        left = self._count[node_id] - c
        if left > 0:
            self._count[node_id] = left
        else:
            del self._count[node_id]

    def _evict_oldest(self, node_id: str, now: float) -> int:
        """Forget the node's oldest ids down to 7/8 of `max_per_node` (an eighth at a time,
        so that a node sending beyond it costs one pass over the columns per eighth)."""
        self.merge(now)
        if node_id not in self._count:  # all of its ids had expired (a request applied after its window)
            return 0
        mine = np.flatnonzero(self._node == self._names.index(node_id))
        excess = len(mine) - (self.max_per_node - max(1, self.max_per_node // 8))
        if excess <= 0:
            return 0
        oldest = mine[np.argsort(self._exp[mine], kind="stable")[:excess]]
        keep = np.ones(len(self._hi), bool)
        keep[oldest] = False
        self._compact(keep)
        self._uncount(node_id, excess)
        self.evicted += excess
        return excess


class ReplayGuard:
    def __init__(self, window_s: float = 300.0, required: bool = True, max_per_node: int = MAX_IDS_PER_NODE,
                 clock: Callable[[], float] = time.time) -> None:
        self.window = window_s
        self.required = required
        self.max_per_node = max_per_node
        self.clock = clock
        self._lock = threading.Lock()
        self._seen = RequestIds(max_per_node, epoch=clock(), merge_s=min(10.0, max(1.0, window_s / 30)))
        self._inflight: set[int] = set()
        self.counters: Counter[str] = Counter()
        self._warned_eviction = False

    def begin(self, method: str, node_id: str, request_id: str, sent_at_ms: int) -> Ticket | None:
        """Admit one request or raise: InvalidArgument (no or malformed tag), FailedPrecondition
        (send time outside the window), AlreadyExists (applied before), Aborted (in flight).
        Returns None for an untagged request where tags are not required."""
        if not request_id and not sent_at_ms:
            if self.required:
                self.counters["refused_untagged"] += 1
                raise InvalidArgument(f"{method}: the request carries no tag (request_id and sent_at_ms); this broker "
                                      "refuses untagged state-changing requests to stop replays. Upgrade the node, "
                                      "or set the broker's require_request_ids: false")
            return None
        if not REQUEST_ID.match(request_id):
            raise InvalidArgument(f"{method}: tag.request_id must be 16-64 characters of A-Z, a-z, 0-9, '_' or '-', "
                                  f"got {request_id[:70]!r}")
        now = self.clock()
        skew = now - sent_at_ms / 1000.0
        if abs(skew) > self.window:
            self.counters["refused_stale"] += 1
            when = f"{skew:.0f} s ago" if skew > 0 else f"{-skew:.0f} s in the future"
            raise FailedPrecondition(f"{method}: the request says it was sent {when} by the broker's clock; the "
                                     f"broker accepts requests sent within {self.window:.0f} s. A replayed request, "
                                     "or the node's clock is off: synchronise it (NTP)")
        fp = self._seen.fingerprint(node_id, request_id)
        with self._lock:
            if fp in self._seen:
                self.counters["refused_duplicate"] += 1
                raise AlreadyExists(f"{method}: request {request_id} of node {node_id!r} was already applied; "
                                    "a repeated request is not applied again (a retry after a lost reply can "
                                    "take this as success)")
            if fp in self._inflight:
                self.counters["refused_inflight"] += 1
                raise Aborted(f"{method}: request {request_id} of node {node_id!r} is still being processed; retry "
                              "shortly with the same request id")
            self._inflight.add(fp)
        return Ticket(node_id, request_id, fp, sent_at_ms / 1000.0 + self.window)

    def end(self, ticket: Ticket | None, applied: bool) -> None:
        """Close a request admitted by `begin`: remember its id if it was applied, else let
        it be retried with the same id."""
        if ticket is None:
            return
        with self._lock:
            self._inflight.discard(ticket.fingerprint)
            if not applied:
                return
            evicted = self._seen.add(ticket.fingerprint, ticket.node_id, ticket.expires, self.clock())
            self.counters["admitted"] += 1
            if evicted:
                self.counters["evicted"] += evicted
                if not self._warned_eviction:
                    log.warning("node %s sent more than %d state-changing requests within %.0f s; its oldest request "
                                "ids are forgotten early (their replay is harmless: the operations are idempotent)",
                                ticket.node_id, self.max_per_node, self.window)
                    self._warned_eviction = True

    @contextmanager
    def admit(self, method: str, node_id: str, request_id: str, sent_at_ms: int) -> Iterator[None]:
        ticket = self.begin(method, node_id, request_id, sent_at_ms)
        applied = False
        try:
            yield
            applied = True
        finally:
            self.end(ticket, applied)

    def expire(self) -> int:
        """Forget ids whose send time left the window (a replay is refused by its timestamp),
        at most every few seconds (the housekeeping calls it every second); returns how many."""
        now = self.clock()
        with self._lock:
            return self._seen.merge(now) if self._seen.due(now) else 0

    def remembered(self) -> int:
        with self._lock:
            return len(self._seen)
