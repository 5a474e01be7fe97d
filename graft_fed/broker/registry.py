"""Sessions and liveness: the broker's node rows in memory, written through to the state.

Every RPC checks the caller's session and marks it alive. That used to be a read and an
fsynced write of the node's row under the broker's one lock, so heartbeats queued behind
publishes and matching (2-4 s under the 64-node load, 110 s at 64 x 4,096; issue 13) and
a larger federation would mark live nodes offline. Here the rows live in a dict behind a
lock held only for dict operations. What must survive a restart is written through to the
state before the cache changes (a join, a leave, a node's round, its published count);
liveness alone (`last_seen`) is persisted in batches by `flush` (every second from the
broker's housekeeping, one transaction for every node), which only makes a restarted broker
see a node as last seen up to that much earlier.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Callable

from graft_fed.broker.state import BrokerState, NodeRow
from graft_fed.federation.errors import StorageFull, Unauthenticated, Unavailable
from graft_fed.federation.limits import clip

_STRIPES = 64
#: The longest heartbeat interval the cadence asks for, however many nodes there are.
MAX_INTERVAL_S = 600.0


class Cadence:
    """How often nodes heartbeat, and how long a silent node stays online, scaled with the
    federation. Every heartbeat is a gRPC call the broker serves: a thousand nodes at the
    2 s default would send 500 a second, each taken by the one thread that takes every call
    (issue 13, sixteenth pass). After a restart the cadence starts from the configured
    interval and is rescaled within a second; nodes keep the interval they were told until
    their next heartbeat answer, so keep offline_after_s several intervals long. Nodes are told an interval long enough that all of them
    together send at most `max_per_s` heartbeats a second (the broker's
    `max_heartbeats_per_s`; 0 keeps the configured interval), in quarter steps of the
    configured one; the silence after which a node is offline grows by the same factor, so a
    node is given as many missed heartbeats at any size. Join and every heartbeat answer
    carry the interval. When the federation shrinks, the longer silence is kept for as long
    as it was (a node still on the longer interval hears the shorter one at its next
    heartbeat and is not marked offline meanwhile)."""

    def __init__(self, interval_s: float, offline_after_s: float, max_per_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_interval_s, self.base_offline_s, self.max_per_s = interval_s, offline_after_s, max_per_s
        self.clock = clock
        self._factor = 1.0
        self._held: tuple[float, float] = (1.0, -math.inf)  # (a longer factor's silence, kept until)

    def factor_for(self, online: int) -> float:
        """The interval's factor for `online` nodes: 1 while they stay under the rate."""
        if self.max_per_s <= 0:
            return 1.0
        factor = max(1.0, math.ceil(4.0 * online / (self.max_per_s * self.base_interval_s)) / 4.0)
        return min(factor, max(1.0, MAX_INTERVAL_S / self.base_interval_s))

    def update(self, online: int) -> None:
        """Rescale for `online` nodes (the broker's housekeeping, every second)."""
        new, now = self.factor_for(online), self.clock()
        if new < self._factor:
            held, until = self._held
            keep = max(self._factor, held if now < until else 1.0)
            self._held = (keep, now + self.base_offline_s * keep)
        self._factor = new

    @property
    def interval_s(self) -> float:
        """The interval nodes are told now."""
        return self.base_interval_s * self._factor

    @property
    def offline_after_s(self) -> float:
        """A node silent for this long is offline."""
        held, until = self._held
        return self.base_offline_s * (max(self._factor, held) if self.clock() < until else self._factor)


class Registry:
    def __init__(self, state: BrokerState, clock: Callable[[], float], cadence: Cadence) -> None:
        self.state = state
        self.clock = clock
        self.cadence = cadence
        self._lock = threading.Lock()  # guards the dicts only; never held across I/O
        self._nodes: dict[str, NodeRow] = {n.node_id: n for n in state.list_nodes()}
        self._persisted: dict[str, float] = {n.node_id: n.last_seen for n in self._nodes.values()}
        # one writer at a time per node, so the state and the cache see its writes in one order
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._online: tuple[float, int] = (-1.0, 0)  # (monotonic time computed, count)
        #: bumped by every change but liveness (a join, a leave, a round, a model): what
        #: callers key their caches of per-node facts on
        self.version = 0

    def node_lock(self, node_id: str) -> threading.Lock:
        return self._stripes[hash(node_id) % _STRIPES]

    # ----- reads (no I/O)
    def get(self, node_id: str) -> NodeRow | None:
        with self._lock:
            return self._nodes.get(node_id)

    def all(self) -> list[NodeRow]:
        with self._lock:
            return [self._nodes[k] for k in sorted(self._nodes)]

    @staticmethod
    def _alive(node: NodeRow, now: float, silence: float) -> bool:
        return node.state != "left" and now - node.last_seen < silence

    def is_online(self, node: NodeRow) -> bool:
        """Not left, and heard from within the cadence's silence."""
        return self._alive(node, self.clock(), self.cadence.offline_after_s)

    def online(self) -> list[NodeRow]:
        now, silence = self.clock(), self.cadence.offline_after_s
        with self._lock:
            return [self._nodes[k] for k in sorted(self._nodes) if self._alive(self._nodes[k], now, silence)]

    def online_count(self, max_age_s: float = 0.5) -> int:
        """How many nodes are online, recomputed at most every `max_age_s` (every heartbeat
        answers it; with a thousand nodes a count per heartbeat would be a million steps
        every interval)."""
        t, count = self._online
        if time.monotonic() - t >= max_age_s:
            count = len(self.online())
            self._online = (time.monotonic(), count)
        return count

    def check(self, node_id: str, session_id: str) -> NodeRow:
        """The node's row when `session_id` is its live session; Unauthenticated otherwise."""
        node = self.get(node_id)
        if node is None or node.state == "left" or not session_id or node.session_id != session_id:
            raise Unauthenticated(f"node {clip(node_id)} has no live session {session_id[:8]!r}...; call Join again")
        return node

    # ----- writes
    def put(self, node: NodeRow) -> None:
        """Write the row to the state, then to the cache (the caller holds no node lock)."""
        with self.node_lock(node.node_id):
            self.state.upsert_node(node)
            self._remember(node)

    def remember(self, node: NodeRow) -> None:
        """Cache a row the caller has just written to the state itself (holding node_lock)."""
        self._remember(node)

    def _remember(self, node: NodeRow) -> None:
        with self._lock:
            self._nodes[node.node_id] = node
            self._persisted[node.node_id] = node.last_seen
            self.version += 1

    def touch(self, node_id: str, session_id: str, round: int | None = None) -> NodeRow:
        """Check the session and mark the node alive (and at `round`, when that is higher).
        A changed round or state is written through; liveness alone stays in memory until
        `flush` (the broker's housekeeping, every second). Liveness is best effort: a full or
        failing disk does not refuse the call."""
        node = self.check(node_id, session_id)
        now = self.clock()
        if (round is None or round <= node.round) and node.state == "online":
            with self._lock:
                current = self._nodes.get(node_id)
                if current is not None and current.session_id == node.session_id and current.state == "online":
                    current = self._nodes[node_id] = replace(current, last_seen=max(current.last_seen, now))
                    return current
        with self.node_lock(node_id):
            current = self.check(node_id, session_id)
            new = replace(current, last_seen=now, state="online",
                          round=current.round if round is None else max(current.round, round))
            try:
                self.state.upsert_node(new)
            except (StorageFull, Unavailable):
                with self._lock:  # alive in memory all the same
                    self._nodes[node_id] = new
                    self.version += 1
                return new
            self._remember(new)
            return new

    def flush(self) -> int:
        """Persist the liveness that changed since the last write, in one transaction;
        returns how many nodes it wrote."""
        with self._lock:
            due = [(k, n.last_seen) for k, n in self._nodes.items() if n.last_seen > self._persisted.get(k, -1.0)]
        if not due:
            return 0
        try:
            self.state.record_liveness(due)
        except (StorageFull, Unavailable):
            return 0
        with self._lock:
            for k, seen in due:
                self._persisted[k] = max(self._persisted.get(k, -1.0), seen)
        return len(due)
