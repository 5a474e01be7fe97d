"""GetMatches: the long-poll for a round to be matched (matching it when ready) and for its
bundles, and the answer: a receiver's offers (from a cache kept per round and receiver,
encoded from pieces encoded once per round), the bundles it is granted, the uploads asked
of it and the complementarity counts."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from typing import Callable, Iterable

import numpy as np

from graft_fed.broker.context import Context, Part
from graft_fed.broker.matcher import Matcher
from graft_fed.broker.matchset import MatchSet
from graft_fed.broker.state import NodeRow
from graft_fed.broker.wakeups import Parked, Wake, bundles_key
from graft_fed.federation.errors import FailedPrecondition, ResourceExhausted
from graft_fed.federation.limits import MAX_LONG_POLLS_PER_NODE, clip
from graft_fed.federation.messages import MatchResult, Offer

#: what the servicer passes to encode answers (federation/codec.py): the offer encoder of a
#: round's match set (its class), the writer of upload requests and that of offer tuples
Encoders = tuple[Callable, Callable[[Iterable[tuple[str, int]]], bytes], Callable[[Iterable[tuple]], bytes]]


class Answers(Part):
    def __init__(self, ctx: Context, matcher: Matcher) -> None:
        super().__init__(ctx)
        self.matcher = matcher
        self._polls: Counter[str] = Counter()  # node -> GetMatches calls waiting now
        self._polls_lock = threading.Lock()
        # per (round, receiver): the answer's offers, granted digests and encoded bytes, valid
        # while the round's digests and the sources' models are as they were
        self._answers: OrderedDict[tuple[int, str], tuple] = OrderedDict()
        self._answers_lock = threading.Lock()
        self._answer_build_lock = threading.Lock()
        # per round: (match set, sources' models, the round's OfferEncoder, whether each source's model is known)
        self._encoders: OrderedDict[int, tuple] = OrderedDict()
        # per-node facts every answer of a round reads, computed once per change of the
        # registry rather than once per answer (a thousand answers each walking a thousand
        # nodes took seconds): round -> (match set, registry version, sources' models), and
        # (time, registry version, online nodes by round, per round the receivers as a mask)
        self._models: dict[int, tuple[MatchSet, int, tuple]] = {}
        self._waiting: tuple[float, int, dict[int, set[str]], dict[int, tuple[MatchSet, np.ndarray]]] | None = None
        # round -> (match set, each column's upload request encoded, the encoder): _uploads_wire
        self._wires: dict[int, tuple[MatchSet, list[bytes] | None, Callable]] = {}

    def forget_answers(self) -> None:
        """Drop the cached answers (retention pruned some of what they offer)."""
        with self._answers_lock:
            self._answers.clear()

    def get_matches(self, node_id: str, session_id: str, round: int, wait_s: float,
                    wait_for_bundles: bool = False, encode: Encoders | None = None,
                    park: bool = False) -> MatchResult:
        """The round's matches for a node, waiting up to `wait_s` (at most 60 s) for the round
        to be matched and, with `wait_for_bundles`, then for every offered bundle to be
        uploaded (a receiver waiting for its sources: woken by each upload, never polling).
        At most MAX_LONG_POLLS_PER_NODE calls of one node wait at once, and at most
        `max_long_polls` in all (RESOURCE_EXHAUSTED beyond), so that long-polls never hold
        every worker thread and heartbeats are always served. With `encode` (the codec's
        writers of MatchResponse.offers and .upload_requests, passed by the servicer) the
        answer carries them encoded (`offers_wire`, `uploads_wire`), the offers from a cache
        kept per round and receiver. With `park` (a caller that can wait without a thread:
        the front's link, broker/front.py) a wait raises Parked (wakeups.py) instead of
        blocking: its `resume` goes on from the start of the checks, and the call keeps its
        place among the long-polls until it answers or its `release` runs."""
        self.registry.touch(node_id, session_id)
        with self._polls_lock:
            if self._polls[node_id] >= MAX_LONG_POLLS_PER_NODE:
                self.counters["long_polls_refused"] += 1
                raise ResourceExhausted(f"node {clip(node_id)} already has {MAX_LONG_POLLS_PER_NODE} GetMatches "
                                        "calls waiting; wait for their answers")
            if self._polls.total() >= self.cfg.max_long_polls:
                self.counters["long_polls_refused"] += 1
                raise ResourceExhausted("the broker has too many GetMatches calls waiting; retry shortly")
            self._polls[node_id] += 1
        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        return self._poll(node_id, session_id, round, deadline, wait_for_bundles, encode, park)

    def _poll(self, node_id: str, session_id: str, round: int, deadline: float, wait_for_bundles: bool,
              encode: Encoders | None, park: bool) -> MatchResult:
        """One go at a long-poll's answer; its place among the long-polls given back when it
        ends, but not when it parks (the call waits on)."""
        ended = True
        try:
            return self._get_matches(node_id, session_id, round, deadline, wait_for_bundles, encode, park)
        except Parked as parked:
            ended = False
            parked.resume = lambda: self._poll(node_id, session_id, round, deadline, wait_for_bundles, encode, park)
            parked.release = lambda: self._end_poll(node_id)
            raise
        finally:
            if ended:
                self._end_poll(node_id)

    def long_polls(self) -> int:
        """GetMatches calls open now (waiting, parked or being answered): what `max_long_polls` bounds."""
        with self._polls_lock:
            return self._polls.total()

    def _end_poll(self, node_id: str) -> None:
        with self._polls_lock:
            self._polls[node_id] -= 1
            if not self._polls[node_id]:
                del self._polls[node_id]

    @staticmethod
    def _wait(wake: Wake, timeout_s: float, park: bool) -> None:
        """Wait for `wake` at most `timeout_s` on this thread, or (`park`) raise Parked for
        the caller to do the waiting."""
        if park:
            raise Parked(wake, timeout_s)
        wake.wait(timeout=timeout_s)

    def _get_matches(self, node_id: str, session_id: str, round: int, deadline: float,
                     wait_for_bundles: bool, encode: Encoders | None = None, park: bool = False) -> MatchResult:
        if not self._wait_matched(node_id, session_id, round, deadline, encode, park):
            return MatchResult(ready=False, offers=[], upload_requests=[])
        # The answer only reads what matching has written, so it is built outside the lock:
        # with many nodes, publishes and heartbeats no longer queue behind every waiting
        # node's answer (bench/broker/load.py measured heartbeats at seconds).
        if wait_for_bundles:
            # woken by each upload of the round's bundles (of any round's, asynchronous mode)
            key = bundles_key(self.cfg.mode, round)
            while True:
                event = self.wakeups.event(key)  # before looking: an upload meanwhile is not missed
                with self.cond:
                    missing = self._missing_bundles(node_id, round)
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    break
                self._wait(event, remaining, park)
        lo = round - self.cfg.staleness_rounds if self.cfg.mode == "async" else round
        with self.work:
            cands, solved = self._complementarity(node_id, round, lo)
            offers, offers_wire = self._offers(node_id, round, encode)
            if encode is None:
                return MatchResult(ready=True, offers=offers, upload_requests=self._upload_requests(node_id),
                                   candidates=cands, solved_by_peers=solved)
            return MatchResult(ready=True, offers=[], upload_requests=[], candidates=cands, solved_by_peers=solved,
                               offers_wire=offers_wire, uploads_wire=self._uploads_wire(node_id, encode[1]))

    def _wait_matched(self, node_id: str, session_id: str, round: int, deadline: float,
                      encode: Encoders | None = None, park: bool = False) -> bool:
        """Wait until the round is matched for this node, matching it when this call finds it
        ready; False when the deadline passed first. The wait is on the round's wake-up event
        (wakeups.py), never holding the broker's lock; it ends when a publish completes the
        round, when housekeeping finds it ready (a node went offline), at the round's
        deadline, or at the call's. Matching runs under the match lock and a work slot
        (always taken in that order, never while holding the broker's lock: a publish holds
        a slot and then takes the lock briefly)."""
        action: tuple[str, int] | None = None
        self.registry.touch(node_id, session_id)
        if not self.index.has_published(round, node_id):
            raise FailedPrecondition(f"node {clip(node_id)} has published nothing for round {round}; "
                                     "publish its summaries before asking for matches")
        while True:
            if self.cfg.mode == "async":
                if not self.state.matches(round=round, receiver=node_id):
                    action = ("one", round - self.cfg.staleness_rounds)
                break
            event = self.wakeups.event(("round", round))  # before looking: a wake-up meanwhile is kept
            late = False
            if self.rounds.ready(round):
                rnd = self.rounds.get(round)
                assert rnd is not None
                if rnd.state != "matched":
                    action = ("round", round)
                    break
                if node_id in rnd.participants or self.state.matches(round=round, receiver=node_id):
                    break
                # published after the round was matched: learn from the stored groups, once
                # the other online nodes near the round have published it too (rounds.py,
                # late_ready); one with no all-fail group has nothing to wait for
                if not self.index.fails(node_id, round) or self.rounds.late_ready(round):
                    action = ("one", round)
                    break
                late = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            rnd = self.rounds.get(round)
            if late:
                until_deadline = self.rounds.late_deadline_left(round)
            else:
                until_deadline = (rnd.opened_at + self.cfg.round_deadline_s - self.clock()) if rnd else remaining
            self._wait(event, max(0.01, min(remaining, until_deadline)), park)
        if action is None:
            return True
        # Whoever comes second finds the work done, and takes a work slot only to do some: a
        # thousand long-polls woken at once, each through the lock and a slot to find the
        # round matched, queued for seconds behind each other (issue 13, twentieth pass).
        if action[0] == "round" and self._matched(round):
            return True
        with self.matcher.lock:
            if action[0] == "round":
                if not self._matched(round):
                    with self.work:
                        self.matcher.match_round(round)
                        if encode is not None:
                            self._encode_answers(round, encode[0])
            elif not self.state.matches(round=round, receiver=node_id):
                with self.work:
                    self.matcher.match_one(node_id, round, action[1], round)
        return True

    def _encode_answers(self, round: int, make_encoder: Callable) -> None:
        """Every receiver's offers of a round just matched, encoded into the answer cache in
        one go by the call that matched it. Encoded by each answer instead, 64 answers at
        64 x 4,096 took 1.0-1.4 ms each, one after another, where the encoding itself is
        0.1-0.15 ms: each answer's numpy calls handed the interpreter to the threads sending
        the answers before it (issue 13, thirtieth pass)."""
        ms = self.matcher.match_set(round)
        if ms is None:
            return
        for receiver in ms.nodes:
            self._set_answer(ms, receiver, make_encoder)

    def _matched(self, round: int) -> bool:
        rnd = self.rounds.get(round)
        return rnd is None or rnd.state == "matched"

    def _missing_bundles(self, receiver: str, round: int) -> bool:
        """Whether some group the receiver was matched to in `round` has no bundle yet."""
        ms = self.matcher.match_set(round)
        if ms is not None and ms.index(receiver) is not None:
            offers, left_out = self._receiver_offers(ms, receiver)
            if left_out or any(not o[6] for o in offers):
                return True
        if not self.matcher.may_have_rows(round):
            return False
        matches = self.state.matches(round=round, receiver=receiver)
        heads = self.state.matched_heads(round, receiver=receiver)
        return len(heads) < len(matches) or any(not h.bundle_digest for _, h in heads)

    def _complementarity(self, receiver: str, round: int, min_round: int) -> tuple[int, int]:
        """core.exchange.complementarity of the receiver's all-fail prompts of `round` over the
        peers' groups of [min_round, round], counted on the round index's arrays."""
        return self.index.complementarity(receiver, round, min_round)

    def _answer_key(self, ms: MatchSet) -> tuple:
        """(round book, the sources' models, the key the round's cached answers are valid for:
        the same book, its digests and the sources' models unchanged)."""
        book = self.index.book(ms.round)
        version = self.registry.version
        cached = self._models.get(ms.round)
        if cached is not None and cached[0] is ms and cached[1] == version:
            models = cached[2]
        else:
            models = tuple(None if node is None else node.model_id for node in map(self.registry.get, ms.nodes))
            self._models[ms.round] = (ms, version, models)
            # each entry holds its round's match set: keep the rounds the index keeps (a
            # window of 64 held up to 48 match sets more, 0.4 MiB each at 256 x 256; issue 13)
            if len(self._models) > self.index.keep:
                for old in sorted(list(self._models))[:-self.index.keep]:
                    self._models.pop(old, None)
        return book, models, (id(book), book.digest_version, models)

    def _digests_of(self, ms: MatchSet, book, col: np.ndarray, src: np.ndarray) -> list[str] | None:
        """The bundle digest of each (column, source) group; None when the round has none."""
        if not book.digests:
            return None
        out = [""] * len(col)
        pids = ms.pids
        for name, per in list(book.digests.items()):
            j = ms.index(name)
            if j is None or not per:
                continue
            for i in np.flatnonzero(src == j).tolist():
                out[i] = per.get(pids[int(col[i])], "")
        return out

    def _receiver_offers(self, ms: MatchSet, receiver: str) -> tuple[list[tuple], int]:
        """(offer tuples (prompt, source, model, round, k, n, digest), offers left out because
        their source is unknown) of one receiver in a round's match set."""
        book, models, _ = self._answer_key(ms)
        col, src, k = ms.for_receiver(receiver)
        digests = self._digests_of(ms, book, col, src)
        offers, left_out = [], 0
        pids, nodes, n, rnd = ms.pids, ms.nodes, self.cfg.n, ms.round
        for i, (c, s_, kk) in enumerate(zip(col.tolist(), src.tolist(), k.tolist())):
            model = models[s_]
            if model is None:
                left_out += 1
                continue
            offers.append((pids[c], nodes[s_], model, rnd, kk, n, digests[i] if digests else ""))
        return offers, left_out

    def _set_answer(self, ms: MatchSet, receiver: str, make_encoder: Callable) -> tuple:
        """(key, granted digests, encoded offers) of a receiver in a round's match set, cached
        until a digest of the round arrives or a source's model changes, encoded from pieces
        encoded once per round (the round's encoder). The call that matches a round fills
        the cache for every receiver (`_encode_answers`); an answer encodes its own when its
        entry is missing or stale."""
        key = self._answer_key(ms)[2]
        with self._answers_lock:
            entry = self._answers.get((ms.round, receiver))
        if entry is not None and entry[0] == key:
            return entry
        book, models, key = self._answer_key(ms)
        with self._answer_build_lock:  # one encoder per round and sources' models, built by whoever comes first
            cached = self._encoders.get(ms.round)
            if cached is None or cached[0] is not ms or cached[1] != models:
                cached = self._encoders[ms.round] = (
                    ms, models, make_encoder(ms.pids, ms.nodes, [m or "" for m in models], ms.round, self.cfg.n),
                    np.fromiter((m is not None for m in models), dtype=bool, count=len(models)))
                while len(self._encoders) > max(16, 2 * self.cfg.staleness_rounds + 4):
                    self._encoders.popitem(last=False)
        encoder, known = cached[2], cached[3]
        col, src, k = ms.for_receiver(receiver)
        keep = known[src]
        if not keep.all():
            col, src, k = col[keep], src[keep], k[keep]
        digests = self._digests_of(ms, book, col, src)
        entry = (key, [d for d in digests if d] if digests is not None else [], encoder.encode(col, src, k, digests))
        with self._answers_lock:
            self._answers[(ms.round, receiver)] = entry
            self._answers.move_to_end((ms.round, receiver))
            while len(self._answers) > 4 * max(64, len(ms.nodes)):
                self._answers.popitem(last=False)
        return entry

    def _offers(self, receiver: str, round: int, encode: Encoders | None = None) -> tuple[list[Offer], bytes | None]:
        """The receiver's offers of `round` (empty with `encode`) and, with `encode`, the
        same encoded; the receiver is granted the offered bundles."""
        ms = self.matcher.match_set(round)
        head: list[tuple] = []
        wire = b"" if encode is not None else None
        if ms is not None and ms.index(receiver) is not None:
            if encode is not None:
                _, granted, wire = self._set_answer(ms, receiver, encode[0])
            else:
                head = self._receiver_offers(ms, receiver)[0]
                granted = [t[6] for t in head if t[6]]
            if granted:
                self.grants.grant(receiver, granted)
        rows = self._row_offers(receiver, round)
        if encode is not None:
            return [], wire + (encode[2]([(o.prompt_id, o.source_node, o.source_model, o.source_round, o.k, o.n,
                                           o.digest) for o in rows]) if rows else b"")
        return [Offer(*t) for t in head] + rows, None

    def _row_offers(self, receiver: str, round: int) -> list[Offer]:
        """Offers from matches stored as rows (a late joiner, asynchronous mode)."""
        if not self.matcher.may_have_rows(round):
            return []
        offers = []
        sources: dict[str, NodeRow | None] = {}
        granted = []
        for m, s in self.state.matched_heads(round, receiver=receiver):  # one indexed join
            if m.source not in sources:
                sources[m.source] = self.registry.get(m.source)
            src = sources[m.source]
            if src is None:
                continue
            if s.bundle_digest:
                granted.append(s.bundle_digest)
            offers.append(Offer(prompt_id=m.prompt_id, source_node=m.source, source_model=src.model_id,
                                source_round=m.source_round, k=s.k, n=s.n, digest=s.bundle_digest))
        if granted:
            self.grants.grant(receiver, granted)
        return offers

    def _upload_requests(self, source: str) -> list[tuple[str, int]]:
        """(prompt id, round) of every group of the source's that a receiver waiting for it
        was given and that has no bundle yet, sorted."""
        return _sorted_requests(*self._upload_pieces(source))

    def _uploads_wire(self, source: str, encode: Callable[[Iterable[tuple[str, int]]], bytes]) -> bytes:
        """encode(self._upload_requests(source)), joined from each request encoded once per
        round and prompt where the requests are one round's (in sync mode, always). Once the
        compatibility estimates spread a round's receivers over many sources, each source is
        asked for about a thousand groups a round at 64 x 4,096 (against tens while every
        receiver prefers the same sources), and building and encoding them answer by answer
        took about 1 ms of the interpreter each, 64 in a row after every match (issue 13,
        thirty-eighth pass)."""
        pieces, rows = self._upload_pieces(source)
        if not rows and len(pieces) == 1:
            r, ms, cols = pieces[0]
            wires = self._request_wires(r, ms, encode)
            if wires is not None:  # the round's prompt ids ascend with its columns: already in order
                return b"".join([wires[c] for c in cols])
        return encode(_sorted_requests(pieces, rows))

    def _request_wires(self, round: int, ms: MatchSet, encode: Callable) -> list[bytes] | None:
        """Each prompt's upload request of `round` encoded (column order), once per round's
        match set; None when the set's prompt ids do not ascend with its columns (then an
        answer's requests are sorted one by one)."""
        cached = self._wires.get(round)
        if cached is not None and cached[0] is ms and cached[2] is encode:
            return cached[1]
        pids = ms.pids
        wires = [encode(((p, round),)) for p in pids] if all(a < b for a, b in zip(pids, pids[1:])) else None
        self._wires[round] = (ms, wires, encode)
        if len(self._wires) > self.index.keep:
            for old in sorted(list(self._wires))[:-self.index.keep]:
                self._wires.pop(old, None)
        return wires

    def _upload_pieces(self, source: str) -> tuple[list[tuple[int, MatchSet, list[int]]], list[tuple[str, int]]]:
        """What the source is asked to upload: per round with a match set, (round, set, its
        columns, ascending) and the (prompt id, round) of matches stored as rows."""
        node = self.registry.get(source)
        if node is None or node.privacy == "summaries_only":
            return [], []
        # Only a receiver still at the round it was matched in fetches (it waits for uploads
        # during its own step), so look at the rounds online nodes are at rather than at the
        # whole history: the answer stays the same size however long the federation runs
        # (bench/broker/load.py saw it, and the broker's memory, grow with every round).
        # (The source itself may be among them: no match has a node as its own receiver.)
        waiting, by_source = self._waiting_receivers()
        pieces, rows = [], []
        for r, receivers in sorted(waiting.items()):
            ms = self.matcher.match_set(r)
            j = ms.index(source) if ms is not None else None
            if j is not None:
                # every source's columns at once, once per round and set of waiting receivers
                # (per answer, finding its own rows among a round's 80,000 took a third of
                # the answer at 64 x 4,096, issue 13)
                entry = by_source.get(r)
                if entry is None or entry[0] is not ms:
                    mask = np.fromiter((name in receivers for name in ms.nodes), dtype=bool, count=len(ms.nodes))
                    entry = by_source[r] = (ms, *ms.columns_by_source(mask))
                cols = entry[2][entry[1][j]:entry[1][j + 1]].tolist()
                if cols:
                    with self.index.lock:
                        have = self.index.book(r).digests.get(source, {})
                    if have:
                        pids = ms.pids
                        cols = [c for c in cols if pids[c] not in have]
                    if cols:
                        pieces.append((r, ms, cols))
            if self.matcher.may_have_rows(r):
                for m, s in self.state.matched_heads(r, source=source):
                    if m.receiver in receivers and not s.bundle_digest:
                        rows.append((m.prompt_id, m.source_round))
        return pieces, rows

    def _waiting_receivers(self) -> tuple[dict[int, set[str]], dict[int, tuple[MatchSet, np.ndarray, np.ndarray]]]:
        """Online nodes by the round they are at, and a cache per round of its match set's
        columns by source among those receivers (MatchSet.columns_by_source): recomputed
        when the registry changed (a node joined, left or moved to another round) and at most
        every quarter second for liveness alone."""
        now, version = time.monotonic(), self.registry.version
        cached = self._waiting
        if cached is not None and cached[1] == version and now - cached[0] < 0.25:
            return cached[2], cached[3]
        waiting: dict[int, set[str]] = {}
        for n in self.registry.online():
            waiting.setdefault(n.round, set()).add(n.node_id)
        self._waiting = (now, version, waiting, {})
        return waiting, self._waiting[3]


def _sorted_requests(pieces: list[tuple[int, MatchSet, list[int]]], rows: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Answers._upload_pieces' (prompt id, round) requests, each once, sorted."""
    return sorted({(ms.pids[c], r) for r, ms, cols in pieces for c in cols} | set(rows))
