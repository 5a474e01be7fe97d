"""Matching: a synchronous round as a whole (broker/matching.py's selection on the round
index's arrays, stored as one match set), or one receiver on its own (a late joiner,
asynchronous mode, stored as rows); the recent match sets decoded, and the matches per
(source, receiver) that status reports."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Sequence

import numpy as np

from graft_fed.broker.context import Context, Part
from graft_fed.broker.exchange import Exchange, ExchangeView
from graft_fed.broker.matching import select_sources_arrays
from graft_fed.broker.matchset import MatchSet, MatchSetError, pid_order
from graft_fed.broker.state import MatchRow
from graft_fed.core.exchange import SourceGroup, classify, select_for_receiver
from graft_fed.federation.errors import Unavailable

log = logging.getLogger("graft_fed.broker")


class Matcher(Part):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.lock = threading.Lock()  # one matching at a time; taken before a work slot
        # synchronous rounds' matchings (one blob each in the state), the recent ones decoded
        self._sets: OrderedDict[int, MatchSet] = OrderedDict()
        self._sets_lock = threading.Lock()
        self._exchange: Exchange | None = None  # matches per (source, receiver)
        self._exchange_lock = threading.Lock()
        # per recent round: whether it may have matches stored as rows (match_one writes them:
        # a late joiner, asynchronous mode). A synchronous round has none, and every answer
        # of it used to read the state twice to find that out (issue 13)
        self._rows: OrderedDict[int, bool] = OrderedDict()

    def forget_sets(self) -> None:
        """Drop the decoded match sets (retention pruned some; re-read from the state)."""
        with self._sets_lock:
            self._sets.clear()

    def forget_exchange(self) -> None:
        """Drop the matches per (source, receiver) (recounted from the state on the next status)."""
        with self._exchange_lock:
            self._exchange = None

    def can_source(self, node_ids: Sequence[str]) -> list[bool]:
        bad = self.ctx.quarantined()
        out = []
        for nid in node_ids:
            node = self.registry.get(nid)
            out.append(node is not None and node.privacy != "summaries_only" and nid not in bad)
        return out

    def match_round(self, round: int) -> None:
        """Synchronous close: select sources for every participant at once (for two nodes,
        exactly the paper's balanced rule): core.exchange.select_sources, computed on the
        round index's arrays (broker/matching.py; the same choices)."""
        participants, pids, k = self.index.kn(round)
        # the columns in prompt-id order first: the match set's rows (receiver, prompt id)
        # are then in order as the selection makes them (sorting each receiver's afterwards
        # took 10-13 ms a round at 64 x 4,096, issue 13); the choice does not depend on it
        by_id = pid_order(pids)
        # np.take: row-major, as the selection reads it (k[:, by_id] is column-major, and 6x slower)
        pids, k = [pids[i] for i in by_id.tolist()], np.take(k, by_id, axis=1)
        chosen = select_sources_arrays(k, self.cfg.n, self.cfg.balance == "pairwise",
                                       self.ctx.compat.estimates(participants), self.can_source(participants),
                                       cap=self.cfg.per_receiver_cap if self.cfg.balance == "per_receiver_cap"
                                       else None) if pids else []
        ms = MatchSet.from_choice(round, participants, pids, k, chosen)
        rnd = self.rounds.get(round)
        assert rnd is not None
        # one transaction (one fsync before the first answer) for the whole round's matching
        # and the round's row; a set stored before (by a broker that crashed before its round
        # row was written) wins, so a restarted broker answers what it answered before
        matched = replace(rnd, state="matched", matched_at=self.clock(), participants=ms.nodes)
        if self.state.put_match_set(round, ms.to_bytes(), round_row=matched):
            self._remember_set(ms)  # the set before the round reads as matched, as ever
            self.rounds.remember(matched)
        else:
            stored = self.match_set(round)
            assert stored is not None
            ms = stored
            self._remember_set(ms)
            self.rounds.put(replace(matched, participants=ms.nodes))
        with self._exchange_lock:
            if self._exchange is not None:  # a count built meanwhile from the state may hold it already
                self._exchange.add_set(ms.round, ms.nodes, ms.source, ms.receiver)
        self.counters["rounds_matched"] += 1
        self.counters["matches"] += len(ms)
        log.info("round %d matched: %d nodes, %d transfers", round, len(ms.nodes), len(ms))

    def _remember_set(self, ms: MatchSet) -> None:
        with self._sets_lock:
            self._sets[ms.round] = ms
            self._sets.move_to_end(ms.round)
            while len(self._sets) > max(16, 2 * self.cfg.staleness_rounds + 4):
                self._sets.popitem(last=False)

    def may_have_rows(self, round: int) -> bool:
        """False when `round` is known to have no match stored as a row (then its answers
        need not read them); asked of the state once per round, then kept up to date by
        match_one, which marks a round before it writes its rows."""
        with self._sets_lock:
            known = self._rows.get(round)
        if known is None:
            known = self.state.has_matches(round)
            with self._sets_lock:
                known = self._rows.setdefault(round, known)  # match_one's mark meanwhile wins
                while len(self._rows) > 4096:
                    self._rows.popitem(last=False)
        return known

    def _mark_rows(self, round: int) -> None:
        with self._sets_lock:
            self._rows[round] = True
            self._rows.move_to_end(round)

    def match_set(self, round: int) -> MatchSet | None:
        """The round's matching when it was matched as a whole (synchronous), else None."""
        with self._sets_lock:
            ms = self._sets.get(round)
        if ms is not None:
            return ms
        data = self.state.match_set(round)
        if data is None:
            return None
        try:
            ms = MatchSet.from_bytes(data)
            if ms.round != round:  # never cached under another round's number
                raise MatchSetError(f"the match set stored for round {round} says it is round {ms.round}'s")
        except MatchSetError as exc:
            # as for a damaged bundle file: the operator reads what in the log, the caller is
            # told the storage failed (UNAVAILABLE, retried), never a bare INTERNAL
            log.error("broker state: the match set stored for round %d is damaged (a damaged volume?): %s",
                      round, exc)
            raise Unavailable(f"the broker's storage failed reading round {round}'s matches: retry later "
                              "(details in the broker's log)") from exc
        self._remember_set(ms)
        return ms

    def matches_of(self, round: int, receiver: str) -> list[MatchRow]:
        """The receiver's matches of `round`: from the round's match set and from single rows
        (a late joiner, asynchronous mode)."""
        ms = self.match_set(round)
        rows = ms.rows(receiver=receiver) if ms is not None else []
        return rows + (self.state.matches(round=round, receiver=receiver) if self.may_have_rows(round) else [])

    def offered(self, round: int, receiver: str) -> set[tuple[str, str]]:
        """The (source, prompt id) of every match of the receiver's in `round`: matches_of's,
        as pairs."""
        ms = self.match_set(round)
        pairs = ms.offered(receiver) if ms is not None else set()
        if self.may_have_rows(round):
            pairs.update((m.source, m.prompt_id) for m in self.state.matches(round=round, receiver=receiver))
        return pairs

    def exchange(self) -> ExchangeView:
        """Matches per (source, receiver) over every stored round (counted once from the
        state, then kept up to date by matching; broker/exchange.py)."""
        with self._exchange_lock:
            if self._exchange is None:
                counts = Exchange()
                counts.add_pairs((m.source, m.receiver) for m in self.state.matches())
                for r in self.state.match_set_rounds():
                    ms = self.match_set(r)
                    if ms is not None:
                        counts.add_set(ms.round, ms.nodes, ms.source, ms.receiver)
                self._exchange = counts
            return self._exchange.view()

    def match_one(self, receiver: str, round: int, min_round: int, max_round: int) -> None:
        """Match one receiver on its own against every other node's groups in [min_round,
        max_round]: the stored mode (a late joiner) and asynchronous mode. Every candidate
        in this one direction; per prompt the source core.exchange.source_rank prefers (the
        most compatible, then the highest k, then the freshest group)."""
        fails = self.index.fails(receiver, round)
        if not fails:
            return
        mine = {pid: (0, self.cfg.n) for pid in fails}
        compat = self.ctx.compat.of_receiver(receiver)
        # the other nodes' informative groups for these prompts, from the round index, in the
        # order the state lists them (round, node): the candidates' order, source_rank's last key
        offers: dict[str, list[tuple[SourceGroup, int]]] = {}
        order = 0
        with self.index.lock:
            for r in range(max(min_round, max_round - self.index.keep + 1), max_round + 1):
                book = self.index.book(r)
                cols = [(pid, book.cols[pid]) for pid in fails if pid in book.cols]
                if not cols:
                    continue
                nodes = sorted(book.nodes - {receiver})
                ok = dict(zip(nodes, self.can_source(nodes)))
                m = book.matrix(nodes)
                for i, nid in enumerate(nodes):
                    row = m[i]
                    for pid, c in cols:
                        k = int(row[c])
                        if k >= 0:
                            order += 1
                            if ok[nid] and classify(k, self.cfg.n) == "informative":
                                offers.setdefault(pid, []).append(
                                    (SourceGroup(source=nid, k=k, round=r, order=order), self.cfg.n))
        best = select_for_receiver(mine, offers, compat)
        rows = [MatchRow(round=round, receiver=receiver, prompt_id=pid, source=str(g.source), source_round=g.round)
                for pid, g in sorted(best.items())]
        if rows:
            self._mark_rows(round)  # before the rows exist: an answer never skips rows that do
        self.state.put_matches(rows)
        if rows:
            self._mark_rows(round)  # and after: a mark evicted meanwhile (4,096 rounds later) comes back
        with self._exchange_lock:
            self._exchange = None  # recounted on the next status (a retried match writes nothing new)
        self.counters["matches"] += len(best)
