"""Round rows and readiness: the cached rows of the rounds (written through to the state;
only the broker writes them), the federation's current round, the rounds a node may claim
(measured from a round no one node can move), and whether a round is ready to be matched
(with the wake-ups of the rounds that became ready without a publish), for the nodes that
publish it in time and for those that come to it after it was matched."""

from __future__ import annotations

import threading
import time
from typing import Callable

from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.registry import Registry
from graft_fed.broker.roundindex import RoundIndex
from graft_fed.broker.state import BrokerState, NodeRow, RoundRow
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
        # node -> the highest round it has published (its registry round is the one it claims
        # in heartbeats and at join; a node publishes ahead of it). Not stored as such: at a
        # start, each known node's stored round stands for it (claims are bounded by what it
        # had published, or by the agreed round)
        self._published: dict[str, int] = {n.node_id: n.round for n in registry.all()}
        self._published_version = 0  # bumped by every change of `_published`
        self._agreed: tuple[tuple, int] = ((), 0)  # (what it was computed from, the agreed round)
        # matched round -> when the first node that published it late asked for its matches
        # (self.clock): the late nodes' deadline counts from it
        self._reopened: dict[int, float] = {}

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

    # ----- the rounds a node may open and claim
    def note_published(self, node_id: str, round: int) -> None:
        """`node_id` has published `round` (its round was checked against `open_limit` when it opened one)."""
        if round > self._published.get(node_id, -1):
            self._published[node_id] = round
            self._published_version += 1

    def published_round(self, node: NodeRow) -> int:
        """The highest round a node has published (-1 for none; see `_published` for a node
        known before the broker started)."""
        return self._published.get(node.node_id, -1)

    def node_round(self, node: NodeRow) -> int:
        """How far a node has come: the round it claims (heartbeat, join) or the highest it
        has published, whichever is higher."""
        return max(node.round, self.published_round(node))

    def agreed(self) -> int:
        """The highest round at least two nodes have published (any node the broker knows,
        online or not; with fewer than two, the highest round with a row): what one node cannot
        move, however far ahead it publishes or claims to be. Claims do not count: two ids
        heartbeating far rounds moved it without publishing anything. Computed again only
        when the registry changed or a node published further."""
        key = (self.registry.version, self._published_version, self._latest_round)
        cached_key, agreed = self._agreed
        if key != cached_key:
            rounds = sorted(self.published_round(n) for n in self.registry.all())
            agreed = max(0, rounds[-2] if len(rounds) >= 2 else self.current())
            self._agreed = (key, agreed)
        return agreed

    def _own(self, node_id: str, of: Callable[[NodeRow], int]) -> int:
        """`of(node)` for a node the registry knows, -1 otherwise."""
        node = self.registry.get(node_id)
        return of(node) if node is not None else -1

    def open_limit(self, node_id: str) -> int:
        """The highest round `node_id` may open: MAX_ROUNDS_AHEAD past the agreed round or past
        its own, whichever is further. Its own: an honest node running ahead of every other
        one (a fast node in asynchronous mode, the first node of a federation) goes on, and
        one that missed rounds (a backlog, a refusal) is not stopped by the gap. One node's
        own round moves only its own bound: before, "current + 1000" counted from the highest
        round anyone had opened, so one node's 1000, 2000, 3000 moved every node's bound."""
        return max(self._own(node_id, self.node_round), self.agreed()) + MAX_ROUNDS_AHEAD

    def claim_limit(self, node_id: str) -> int:
        """The highest round `node_id` may claim (heartbeat, join) or report on: MAX_ROUNDS_AHEAD
        past the agreed round, or one past what it has published. Claims alone never move a
        node further: a node moves on by publishing."""
        return max(self._own(node_id, self.published_round) + 1, self.agreed() + MAX_ROUNDS_AHEAD)

    def may_open(self, node_id: str, round: int) -> bool:
        """round <= open_limit(node_id); a round at most MAX_ROUNDS_AHEAD past the node's own
        (the common case) without computing the agreed round."""
        return (round <= self._own(node_id, self.node_round) + MAX_ROUNDS_AHEAD
                or round <= self.agreed() + MAX_ROUNDS_AHEAD)

    def may_claim(self, node_id: str, round: int) -> bool:
        """round <= claim_limit(node_id); a round at most one past what the node has published
        (a thousand nodes heartbeating the round they work on) without computing the agreed
        round."""
        return round <= self._own(node_id, self.published_round) + 1 or round <= self.agreed() + MAX_ROUNDS_AHEAD

    def plausible(self, node_id: str, round: int) -> int:
        """A node's claimed round (heartbeat, join), clamped to its `claim_limit` (a node's round
        only decides which rounds wait for it and whom it uploads for; a claim of round 10^12
        must not make it look like it is working near every round)."""
        return round if self.may_claim(node_id, round) else self.claim_limit(node_id)

    def lowest_online(self, max_lag: int | None = None) -> tuple[int | None, list[tuple[str, int]]]:
        """(the lowest round an online node has come to, None when none is online; the online
        nodes left out, as (node id, round)): retention keeps `keep_rounds` back from it too,
        so that no one can make it drop the rounds the nodes at work still use. With `max_lag`,
        a node more than `max_lag` rounds behind the median online node is left out: one node
        stuck far behind would keep every round since its own. The median is the lower median
        of the rounds the online nodes have published (claims do not count: ids that only
        heartbeat far rounds do not move it), which ids running ahead move only when they are
        half the online nodes or more and publish there."""
        online = self.registry.online()
        rounds = sorted((self.node_round(n), n.node_id) for n in online)
        if not rounds:
            return None, []
        if max_lag is None:
            return rounds[0][0], []
        published = sorted(self.published_round(n) for n in online)
        floor = published[(len(published) - 1) // 2] - max_lag
        # a node's round is at least what it published, so half the nodes or more are at the floor or above
        behind = [(node, r) for r, node in rounds if r < floor]
        return rounds[len(behind)][0], behind

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

    def _waiting(self, round: int, now: float, fresh: bool = False) -> bool:
        """Whether an online node working near `round` has not published it: at the round, or
        one behind. One far behind (a late joiner replaying early rounds) is not waited for,
        and neither is one past it (it will not publish this round any more; and a node
        claiming a round far ahead must not stall every round until its deadline).

        The nodes near the round are listed at most every quarter second (and again after a
        join or a leave), and a cursor remembers how many of them in a row have published: a
        thousand publishes walk the list once between them, not once each (each walk sorted
        and filtered every node: 128 ms of the interpreter per 1,000 x 1,000 round, against
        0.6 ms; bench/broker/results/ready_scan_cost.py.txt). It asks the round index about
        each node rather than copying the round's publishers (a thousand names per publish).
        With `fresh`, the list is made again whenever a node's round, a join or a leave has
        changed the registry since (the late nodes' check, which is rare)."""
        entry = self._near.get(round)
        version = self.registry.version
        if entry is None or now - entry[0] >= 0.25 or (fresh and entry[3] != version):
            near = [n.node_id for n in self.registry.online() if round - 1 <= n.round <= round]
            if len(self._near) > 64:
                self._near.clear()
            entry = self._near[round] = [now, near, 0, version]
        near, i = entry[1], entry[2]
        has_published = self.index.has_published
        while i < len(near) and has_published(round, near[i]):  # publishers only grow: a cursor never passes a waiter
            i += 1
        entry[2] = i
        return i < len(near)

    def late_ready(self, round: int) -> bool:
        """For a node that published `round` after it was matched: whether to match it now.
        Like a round's own readiness: when every online node working near the round has
        published it, or `round_deadline_s` after the first such late node asked. Those who
        come to a round together are matched together: a node running ahead of the others
        (hostile or only fast) seals the round it publishes alone, and when the others got
        there each was matched at once on its own, against only the nodes that happened to
        publish before it, so the first of them received nothing from the rest."""
        return self.late_deadline_left(round) <= 0 or not self._waiting(round, time.monotonic(), fresh=True)

    def late_deadline_left(self, round: int) -> float:
        """Seconds until the late nodes of `round` stop waiting for each other (its clock starts
        at the first late node's question; kept in memory: a restarted broker starts it anew)."""
        now = self.clock()
        with self._rounds_lock:  # GetMatches calls ask at once, holding no other lock
            since = self._reopened.get(round)
            if since is None:
                if len(self._reopened) > 256:
                    for old in sorted(self._reopened)[:128]:
                        del self._reopened[old]
                since = self._reopened[round] = now
        return since + self.cfg.round_deadline_s - now

    def wake_ready(self) -> None:
        """Wake the long-polls of every round someone waits for that is ready now (a node went
        offline or left, which no publish reports). The server's housekeeping calls it every
        second."""
        for key in self.wakeups.keys():
            if key[0] == "round" and self.ready(key[1]):
                self.wakeups.wake(key)
