"""Round rows and readiness: the cached rows of the rounds (written through to the state;
only the broker writes them), the federation's current round, and whether a round is ready
to be matched (with the wake-ups of the rounds that became ready without a publish)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.registry import Registry
from graft_fed.broker.roundindex import RoundIndex
from graft_fed.broker.state import BrokerState, RoundRow
from graft_fed.broker.wakeups import Wakeups
from graft_fed.federation.limits import MAX_ROUNDS_AHEAD


class Rounds:
    def __init__(self, cfg: BrokerConfig, state: BrokerState, clock: Callable[[], float], registry: Registry,
                 index: RoundIndex, wakeups: Wakeups) -> None:
        self.cfg, self.state, self.clock = cfg, state, clock
        self.registry, self.index, self.wakeups = registry, index, wakeups
        self._latest_round = state.latest_round()  # the highest round with a row (only this class writes rounds)
        self._rounds_lock = threading.Lock()
        self._rounds: dict[int, RoundRow] = {}  # round rows, written through (only this class writes them)
        self._ready_memo: dict[tuple[int, int], tuple[float, bool]] = {}
        # round -> [built at, ids of the online nodes working near it, how many of them in a
        # row have published]: what `ready` walks instead of every node per call
        self._near: dict[int, list] = {}

    def forget_readiness(self) -> None:
        """Drop the remembered answers of `ready` (a remembered "not yet" may have waited for
        a node that left; a node that joined may be waited for)."""
        self._ready_memo.clear()
        self._near.clear()

    def forget_rows(self) -> None:
        """Drop the cached rows (retention pruned some; they are re-read from the state)."""
        with self._rounds_lock:
            self._rounds.clear()

    def current(self) -> int:
        return max(0, self._latest_round)

    def put(self, row: RoundRow) -> None:
        self.state.put_round(row)
        self.remember(row)

    def remember(self, row: RoundRow) -> None:
        """Keep a row the state has just stored (by `put`, or with the round's match set)."""
        with self._rounds_lock:
            self._latest_round = max(self._latest_round, row.round)
            self._rounds[row.round] = row
            if len(self._rounds) > 256:
                for old in sorted(self._rounds)[:-128]:
                    del self._rounds[old]

    def get(self, round: int) -> RoundRow | None:
        """The round's row (a cached copy of the state's; do not mutate it)."""
        with self._rounds_lock:
            row = self._rounds.get(round)
        if row is None:
            row = self.state.get_round(round)
            if row is not None:
                with self._rounds_lock:
                    self._rounds.setdefault(round, row)
        return row

    def plausible(self, round: int) -> int:
        """A node's claimed round, clamped to at most MAX_ROUNDS_AHEAD past the federation's
        (a node's round only decides which rounds wait for it and whom it uploads for; a
        claim of round 10^12 must not make it look like it is working near every round)."""
        return min(round, self.current() + MAX_ROUNDS_AHEAD)

    def ready(self, round: int) -> bool:
        rnd = self.get(round)
        if rnd is None:
            return False
        if rnd.state == "matched":
            return True
        if self.clock() - rnd.opened_at >= self.cfg.round_deadline_s:
            return True
        # Every GetMatches asks this when it arrives and when it is woken, and every publish
        # asks it: with a thousand nodes, a thousand callers each scanning a thousand nodes.
        # The answer for a round and a count of publishers is reused for a quarter second
        # (liveness and rounds change no faster than that matters; a stale "not yet" is
        # asked again by housekeeping's wake_ready_rounds, at most a second later).
        count = self.index.published_count(round)
        key = (round, count)
        now = time.monotonic()
        cached = self._ready_memo.get(key)
        if cached is not None and now - cached[0] < 0.25:
            return cached[1]
        ready = count >= self.cfg.min_nodes and not self._waiting(round, now)
        if len(self._ready_memo) > 64:
            self._ready_memo.clear()
        self._ready_memo[key] = (now, ready)
        return ready

    def _waiting(self, round: int, now: float) -> bool:
        """Whether an online node working near `round` has not published it: at the round, or
        one behind. One far behind (a late joiner replaying early rounds) is not waited for,
        and neither is one past it (it will not publish this round any more; and a node
        claiming a round far ahead must not stall every round until its deadline).

        The nodes near the round are listed at most every quarter second (and again after a
        join or a leave), and a cursor remembers how many of them in a row have published: a
        thousand publishes walk the list once between them, not once each (each walk sorted
        and filtered every node: 128 ms of the interpreter per 1,000 x 1,000 round, against
        0.6 ms; bench/broker/results/ready_scan_cost.py.txt). It asks the round index about
        each node rather than copying the round's publishers (a thousand names per publish)."""
        entry = self._near.get(round)
        if entry is None or now - entry[0] >= 0.25:
            near = [n.node_id for n in self.registry.online() if round - 1 <= n.round <= round]
            if len(self._near) > 64:
                self._near.clear()
            entry = self._near[round] = [now, near, 0]
        near, i = entry[1], entry[2]
        has_published = self.index.has_published
        while i < len(near) and has_published(round, near[i]):  # publishers only grow: a cursor never passes a waiter
            i += 1
        entry[2] = i
        return i < len(near)

    def wake_ready(self) -> None:
        """Wake the long-polls of every round someone waits for that is ready now (a node went
        offline or left, which no publish reports). The server's housekeeping calls it every
        second."""
        for key in self.wakeups.keys():
            if key[0] == "round" and self.ready(key[1]):
                self.wakeups.wake(key)
