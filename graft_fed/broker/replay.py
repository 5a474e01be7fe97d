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
  then refused by its timestamp), and keeps at most `max_per_node` ids per node, dropping
  the oldest first, so its memory is bounded however long the broker runs.

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
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from graft_fed.federation.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument

log = logging.getLogger("graft_fed.broker")

REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
MAX_IDS_PER_NODE = 16384


@dataclass(frozen=True)
class Ticket:
    node_id: str
    request_id: str
    expires: float


class ReplayGuard:
    def __init__(self, window_s: float = 300.0, required: bool = True, max_per_node: int = MAX_IDS_PER_NODE,
                 clock: Callable[[], float] = time.time) -> None:
        self.window = window_s
        self.required = required
        self.max_per_node = max_per_node
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, OrderedDict[str, float]] = {}  # node -> request id -> forget after (unix s)
        self._inflight: set[tuple[str, str]] = set()
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
        key = (node_id, request_id)
        with self._lock:
            seen = self._seen.get(node_id)
            if seen is not None:
                self._expire_node(node_id, seen, now)
                if request_id in seen:
                    self.counters["refused_duplicate"] += 1
                    raise AlreadyExists(f"{method}: request {request_id} of node {node_id!r} was already applied; "
                                        "a repeated request is not applied again (a retry after a lost reply can "
                                        "take this as success)")
            if key in self._inflight:
                self.counters["refused_inflight"] += 1
                raise Aborted(f"{method}: request {request_id} of node {node_id!r} is still being processed; retry "
                              "shortly with the same request id")
            self._inflight.add(key)
        return Ticket(node_id, request_id, sent_at_ms / 1000.0 + self.window)

    def end(self, ticket: Ticket | None, applied: bool) -> None:
        """Close a request admitted by `begin`: remember its id if it was applied, else let
        it be retried with the same id."""
        if ticket is None:
            return
        with self._lock:
            self._inflight.discard((ticket.node_id, ticket.request_id))
            if not applied:
                return
            seen = self._seen.setdefault(ticket.node_id, OrderedDict())
            seen[ticket.request_id] = ticket.expires
            while len(seen) > self.max_per_node:
                seen.popitem(last=False)
                self.counters["evicted"] += 1
                if not self._warned_eviction:
                    log.warning("node %s sent more than %d state-changing requests within %.0f s; the oldest request "
                                "ids are forgotten early (their replay is harmless: the operations are idempotent)",
                                ticket.node_id, self.max_per_node, self.window)
                    self._warned_eviction = True
            self.counters["admitted"] += 1

    @contextmanager
    def admit(self, method: str, node_id: str, request_id: str, sent_at_ms: int) -> Iterator[None]:
        ticket = self.begin(method, node_id, request_id, sent_at_ms)
        applied = False
        try:
            yield
            applied = True
        finally:
            self.end(ticket, applied)

    def _expire_node(self, node_id: str, seen: OrderedDict[str, float], now: float) -> int:
        dropped = 0
        while seen:
            request_id, expires = next(iter(seen.items()))
            if expires >= now:
                break
            del seen[request_id]
            dropped += 1
        if not seen:
            del self._seen[node_id]
        return dropped

    def expire(self) -> int:
        """Forget ids whose send time left the window (a replay is refused by its timestamp)."""
        now = self.clock()
        with self._lock:
            return sum(self._expire_node(n, seen, now) for n, seen in list(self._seen.items()))

    def remembered(self) -> int:
        with self._lock:
            return sum(len(seen) for seen in self._seen.values())
