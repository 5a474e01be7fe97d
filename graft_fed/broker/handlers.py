"""The broker's domain logic: registry, rounds, matching, bundles, compatibility.

No gRPC here: methods take and return plain data and raise the domain errors of
graft_fed.federation.errors; the servicer translates. Every method that changes state
validates its whole input first, so a rejected request leaves the state as it was.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import unicodedata
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from graft_fed.broker.auth import Allowlist
from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.grants import MAX_GRANTS, Grants
from graft_fed.broker.matching import select_sources_arrays
from graft_fed.broker.matchset import MatchSet
from graft_fed.broker.quarantine import quarantined_sources
from graft_fed.broker.ratelimit import PublishRateLimit
from graft_fed.broker.registry import Registry
from graft_fed.broker.replay import ReplayGuard
from graft_fed.broker.roundindex import RoundIndex
from graft_fed.broker.state import BrokerState, MatchRow, NodeRow, ReportRow, RoundRow
from graft_fed.broker.uploads import BundleUpload
from graft_fed.broker.wakeups import Wakeups
from graft_fed.core.exchange import SourceGroup, classify, select_for_receiver
from graft_fed.core.records import GroupRecord
from graft_fed.data.config import load_prompts
from graft_fed.federation.bundles import decode_bundle, is_digest
from graft_fed.federation.errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                                         ResourceExhausted)
from graft_fed.federation.limits import (MAX_DIGESTS_PER_CALL, MAX_ID_LEN, MAX_LONG_POLLS_PER_NODE, MAX_PER_ROUND_FACTOR,
                                         MAX_ROUNDS_AHEAD, MAX_TOKENIZER_ID_LEN, MIN_MEAN_LOGPROB, clip)
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, differences, verifier_version
from graft_fed.federation.messages import MatchResult, Offer, Privacy, ReportEntry, SummaryRow
from graft_fed.federation.signing import ProvenanceError, common_name, load_certificate_der, verify_signature
from graft_fed.federation.summaryblock import SummaryBlock

log = logging.getLogger("graft_fed.broker")

#: what the servicer passes to encode answers (federation/codec.py): the offer encoder of a
#: round's match set (its class), the writer of upload requests and that of offer tuples
Encoders = tuple[Callable, Callable[[Iterable[tuple[str, int]]], bytes], Callable[[Iterable[tuple]], bytes]]

PRIVACY = Privacy.names()
MAX_SUMMARIES_FACTOR = MAX_PER_ROUND_FACTOR  # a round may carry up to 4x prompts_per_round summaries (DAPO refills)


def _check_id(value: str, what: str, limit: int = MAX_ID_LEN, empty: bool = False) -> None:
    """Printable: no control, format or other category-C characters (ids end up in logs and
    in `graft-fed status` on an operator's terminal, where C1 controls are escape sequences)."""
    if (not value and not empty) or len(value) > limit or any(unicodedata.category(c)[0] == "C" for c in value):
        raise InvalidArgument(f"{what} must be {0 if empty else 1}-{limit} printable characters, got {clip(value)}")


def _std_matches(k: int, n: int, claimed: float) -> bool:
    """reward_std agrees with k successes of n binary rewards (sample std, as
    federation.messages.summarise computes it, or population std)."""
    p = k / n
    var = p * (1 - p)
    candidates = [math.sqrt(var), math.sqrt(var * n / (n - 1)) if n > 1 else 0.0]
    return any(abs(claimed - c) <= 1e-6 * max(1.0, c) for c in candidates)


class Federation:
    def __init__(self, cfg: BrokerConfig, state: BrokerState, clock: Callable[[], float] = time.time,
                 allowlist: Allowlist | None = None) -> None:
        self.cfg = cfg
        self.state = state
        self.clock = clock
        self.allowlist = allowlist
        self._publish_rate = PublishRateLimit(cfg.max_publishes_per_s)
        # uploaded bytes per node, rebuilt from the durable state (a restart must not reset quotas)
        self._bundle_bytes: Counter[str] = Counter(state.bundle_bytes_by_node())
        prompts = load_prompts(cfg.data)
        self.known_prompts = {p.id for p in prompts}
        self.manifest = Manifest(
            federation_id=cfg.federation_id, protocol_version=PROTOCOL_VERSION,
            dataset_id=prompts[0].dataset if prompts else cfg.data.source,
            dataset_hash=dataset_hash(prompts), seed=cfg.seed, n=cfg.n, prompts_per_round=cfg.prompts_per_round,
            mode=cfg.mode, verifier_name=cfg.verifier.name, verifier_version=verifier_version(cfg.verifier),
            staleness_rounds=cfg.staleness_rounds, advantage=cfg.advantage)
        self.cond = threading.Condition()
        # what long-polls wait on: ("round", r) until round r is ready or matched,
        # ("bundles", r) for bundles of round r, ("bundles", None) for any bundle (asynchronous
        # mode); never the lock above, which a thousand waiters kept busy (wakeups.py)
        self.wakeups = Wakeups()
        self.counters: Counter[str] = Counter()
        # bundle digest -> receivers allowed to fetch it (what GetMatches offered them)
        self.grants = Grants(MAX_GRANTS)
        # k per node and prompt of the recent rounds, and who published: what matching,
        # complementarity and round readiness read (rebuilt from the state on a miss, e.g.
        # after a restart), so none of them re-reads and decodes summaries under the lock
        self.index = RoundIndex(cfg.n, lambda r: self.state.summary_heads(round=r),
                                keep=max(16, 2 * cfg.staleness_rounds + 4))
        # node rows in memory (sessions, liveness), written through to the state: a heartbeat
        # checks and marks a session without the broker's lock or a disk write
        self.registry = Registry(state, clock, cfg.offline_after_s)
        self._latest_round = state.latest_round()  # the highest round with a row (only this class writes rounds)
        self._rounds_lock = threading.Lock()
        self._rounds: dict[int, RoundRow] = {}  # round rows, written through (only this class writes them)
        self._ready_memo: dict[tuple[int, int], tuple[float, bool]] = {}
        # heavy calls (publishes, matching and answers) take a slot, so that only a few threads
        # want the interpreter at once and short calls (heartbeats) are served between them
        self.work = threading.BoundedSemaphore(cfg.work_slots)
        self._match_lock = threading.Lock()  # one matching at a time; taken before a work slot
        self._warned_unverifiable = False
        self.prompts_by_id = {p.id: p for p in prompts}
        self._verifier = None
        self._verifier_failed = False
        self._verifier_lock = threading.Lock()
        self._polls: Counter[str] = Counter()  # node -> GetMatches calls waiting now
        self._polls_lock = threading.Lock()
        # request ids of applied state-changing requests, per node, within the replay window
        self.replay = ReplayGuard(cfg.replay_window_s, cfg.require_request_ids, clock=clock)
        # synchronous rounds' matchings (one blob each in the state), the recent ones decoded
        self._sets: OrderedDict[int, MatchSet] = OrderedDict()
        self._sets_lock = threading.Lock()
        # per (round, receiver): the answer's offers, granted digests and encoded bytes, valid
        # while the round's digests and the sources' models are as they were
        self._answers: OrderedDict[tuple[int, str], tuple] = OrderedDict()
        self._answers_lock = threading.Lock()
        self._answer_build_lock = threading.Lock()
        # per round: (match set, sources' models, the round's OfferEncoder, whether each source's model is known)
        self._encoders: OrderedDict[int, tuple] = OrderedDict()
        self._exchange: Counter[tuple[str, str]] | None = None  # matches per (source, receiver)
        # per-node facts every answer of a round reads, computed once per change of the
        # registry rather than once per answer (a thousand answers each walking a thousand
        # nodes took seconds): round -> (match set, registry version, sources' models), and
        # (time, registry version, online nodes by round, per round the receivers as a mask)
        self._models: dict[int, tuple[MatchSet, int, tuple]] = {}
        self._waiting: tuple[float, int, dict[int, set[str]], dict[int, tuple[MatchSet, np.ndarray]]] | None = None
        self._exchange_lock = threading.Lock()

    # ----- sessions -------------------------------------------------------------------------

    def _node(self, node_id: str, session_id: str, touch: bool = True) -> NodeRow:
        if not touch:
            return self.registry.check(node_id, session_id)
        return self.registry.touch(node_id, session_id)

    def online_nodes(self) -> list[NodeRow]:
        return self.registry.online()

    def flush_liveness(self) -> int:
        """Persist the nodes' last-seen times (the server's housekeeping calls it every second)."""
        return self.registry.flush()

    def node_state(self, node: NodeRow) -> str:
        if node.state in ("left", "registered"):
            return node.state
        return "online" if self.clock() - node.last_seen < self.cfg.offline_after_s else "offline"

    def join(self, node_id: str, model_id: str, tokenizer_id: str, manifest: Manifest, privacy: str,
             resume_round: int) -> tuple[str, int]:
        _check_id(node_id, "node_id")
        _check_id(model_id, "model_id")
        _check_id(tokenizer_id, "tokenizer_id", MAX_TOKENIZER_ID_LEN, empty=True)
        if privacy not in PRIVACY:
            raise InvalidArgument(f"privacy must be one of {PRIVACY}, got {privacy!r}")
        diff = differences(self.manifest, manifest)
        if diff:
            self.counters["rejected_join"] += 1
            raise FailedPrecondition("the node's settings differ from the federation manifest: " + "; ".join(diff)
                                     + ". Use the broker's dataset, seed (the node's run.schedule_seed, or run.seed "
                                     "when that is unset), n, prompts per round, verifier and advantage "
                                     "(the node's algorithm.scale_rewards/algorithm.std).")
        session = secrets.token_hex(16)
        with self.cond, self.registry.node_lock(node_id):
            prev = self.registry.get(node_id)
            row = NodeRow(node_id=node_id, model_id=model_id, tokenizer_id=tokenizer_id, privacy=privacy,
                          state="online", session_id=session, round=self._plausible_round(resume_round),
                          last_seen=self.clock(), published=prev.published if prev else 0)
            self.state.upsert_node(row)
            self.registry.remember(row)
            self.counters["joins"] += 1
        log.info("node %s joined (model %s, privacy %s, round %d)", node_id, model_id, privacy, resume_round)
        return session, self.current_round()

    def leave(self, node_id: str, session_id: str) -> None:
        with self.cond, self.registry.node_lock(node_id):
            node = self._node(node_id, session_id, touch=False)
            row = replace(node, state="left", last_seen=self.clock())
            self.state.upsert_node(row)
            self.registry.remember(row)
        self._ready_memo.clear()  # a remembered "not yet" may have waited for this node
        self.wake_ready_rounds()  # the rounds that waited for it may be ready now
        log.info("node %s left", node_id)

    def heartbeat(self, node_id: str, session_id: str, round: int) -> tuple[int, int]:
        """Never waits for the broker's lock: a session check and a liveness mark in memory
        (a higher round is written through), then two cached numbers."""
        self.registry.touch(node_id, session_id, self._plausible_round(round))
        return self.current_round(), self.registry.online_count()

    def current_round(self) -> int:
        return max(0, self._latest_round)

    def _put_round(self, row: RoundRow) -> None:
        self.state.put_round(row)
        with self._rounds_lock:
            self._latest_round = max(self._latest_round, row.round)
            self._rounds[row.round] = row
            if len(self._rounds) > 256:
                for old in sorted(self._rounds)[:-128]:
                    del self._rounds[old]

    def _get_round(self, round: int) -> RoundRow | None:
        """The round's row (a cached copy of the state's; do not mutate it)."""
        with self._rounds_lock:
            row = self._rounds.get(round)
        if row is None:
            row = self.state.get_round(round)
            if row is not None:
                with self._rounds_lock:
                    self._rounds.setdefault(round, row)
        return row

    def _plausible_round(self, round: int) -> int:
        """A node's claimed round, clamped to at most MAX_ROUNDS_AHEAD past the federation's
        (a node's round only decides which rounds wait for it and whom it uploads for; a
        claim of round 10^12 must not make it look like it is working near every round)."""
        return min(round, self.current_round() + MAX_ROUNDS_AHEAD)

    # ----- publishing -------------------------------------------------------------------------

    def _validate_summary(self, s: SummaryRow) -> None:
        where = f"summary for prompt {s.prompt_id[:40]!r}"
        if s.prompt_id not in self.known_prompts:
            raise InvalidArgument(f"{where}: unknown prompt id (not in the federation's dataset "
                                  f"{self.manifest.dataset_id})")
        if s.n != self.manifest.n:
            raise InvalidArgument(f"{where}: n={s.n} but the federation samples n={self.manifest.n}")
        if len(s.prompt_id) > MAX_ID_LEN:
            raise InvalidArgument(f"{where}: prompt id longer than {MAX_ID_LEN} characters")
        if not 0 <= s.k <= s.n:
            raise InvalidArgument(f"{where}: k={s.k} is not in [0, n={s.n}]")
        if len(s.lengths) != s.n or len(s.mean_logprobs) != s.n:
            raise InvalidArgument(f"{where}: {len(s.lengths)} lengths and {len(s.mean_logprobs)} mean log-probs "
                                  f"for n={s.n} responses")
        if any(length < 1 for length in s.lengths):
            raise InvalidArgument(f"{where}: every response has at least one token")
        values = [s.reward_mean, s.reward_std, *s.mean_logprobs]
        if not all(math.isfinite(v) for v in values):
            raise InvalidArgument(f"{where}: non-finite number")
        if any(v > 1e-6 for v in s.mean_logprobs):
            raise InvalidArgument(f"{where}: a mean log-prob is positive (log-probs are <= 0)")
        if any(v < MIN_MEAN_LOGPROB for v in s.mean_logprobs):
            raise InvalidArgument(f"{where}: a mean log-prob is below {MIN_MEAN_LOGPROB}, which sampling does not "
                                  "produce")
        if abs(s.reward_mean - s.k / s.n) > 1e-6:
            raise InvalidArgument(f"{where}: reward_mean {s.reward_mean} contradicts k/n = {s.k}/{s.n}")
        if not _std_matches(s.k, s.n, s.reward_std):
            raise InvalidArgument(f"{where}: reward_std {s.reward_std} contradicts k/n = {s.k}/{s.n} (binary "
                                  "rewards: the sample or population std of k ones and n - k zeros)")
        if s.bundle_digest:
            # the broker attaches a digest when it holds the bundle (UploadBundle); a digest
            # claimed in a summary could name bytes that never arrive
            raise InvalidArgument(f"{where}: bundle_digest must be empty; the broker sets it when the bundle is "
                                  "uploaded")

    def publish(self, node_id: str, session_id: str, round: int, summaries: Sequence[SummaryRow]) -> tuple[int, int]:
        with self.work:
            self._validate_rows(node_id, round, summaries)
            block = SummaryBlock.from_rows(list(summaries)) if summaries else SummaryBlock.from_columns(
                node_id, round, [], *([[]] * 9))
        return self._publish(node_id, session_id, round, block)

    def publish_block(self, node_id: str, session_id: str, round: int, block: SummaryBlock) -> tuple[int, int]:
        """`publish` for summaries as columns (the servicer reads a publish in bulk): the same
        checks, on arrays; a block that fails one is checked row by row, so that the error
        is the one `publish` raises."""
        with self.work:
            if not self._block_valid(node_id, round, block):
                self._validate_rows(node_id, round, block.rows())
                raise InvalidArgument("the summaries are malformed")  # not reached: the row checks raise
        return self._publish(node_id, session_id, round, block)

    def _validate_rows(self, node_id: str, round: int, summaries: Sequence[SummaryRow]) -> None:
        limit = self.manifest.prompts_per_round * MAX_SUMMARIES_FACTOR
        if len(summaries) > limit:
            raise ResourceExhausted(f"{len(summaries)} summaries in one publish; at most {limit} per round")
        seen = set()
        for s in summaries:
            if s.node_id != node_id or s.round != round:
                raise InvalidArgument("every summary must carry the publishing node and round")
            if s.prompt_id in seen:
                raise InvalidArgument(f"prompt {clip(s.prompt_id)} appears twice in one publish")
            seen.add(s.prompt_id)
            self._validate_summary(s)

    def _block_valid(self, node_id: str, round: int, b: SummaryBlock) -> bool:
        """Every check of `_validate_rows` on the block's columns at once."""
        count = len(b)
        if count > self.manifest.prompts_per_round * MAX_SUMMARIES_FACTOR:
            return False
        if b.node_id != node_id or b.round != round or b.digests is not None:
            return False
        if not count:
            return True
        if len(set(b.prompt_ids)) != count or not self.known_prompts.issuperset(b.prompt_ids):
            return False
        n = self.manifest.n
        if not ((b.n == n).all() and (b.k >= 0).all() and (b.k <= n).all() and (b.n_lengths == n).all()
                and (b.n_logprobs == n).all() and (b.lengths >= 1).all()):
            return False
        lp, mean, std = b.mean_logprobs, b.reward_mean, b.reward_std
        with np.errstate(invalid="ignore"):
            if not (np.isfinite(mean).all() and np.isfinite(std).all() and np.isfinite(lp).all()
                    and (lp <= 1e-6).all() and (lp >= MIN_MEAN_LOGPROB).all()):
                return False
            p = b.k / n
            if not (np.abs(mean - p) <= 1e-6).all():
                return False
            var = p * (1 - p)  # reward_std: the population or the sample std of k ones and n - k zeros
            pop = np.sqrt(var)
            sample = np.sqrt(var * n / (n - 1)) if n > 1 else np.zeros_like(var)
            ok = ((np.abs(std - pop) <= 1e-6 * np.maximum(1.0, pop))
                  | (np.abs(std - sample) <= 1e-6 * np.maximum(1.0, sample)))
        return bool(ok.all())

    def _publish(self, node_id: str, session_id: str, round: int, summaries: SummaryBlock) -> tuple[int, int]:
        with self.cond:
            node = self._node(node_id, session_id)
            self._rate_limit(node_id)
            rnd = self._get_round(round)
            if rnd is None:
                if round > self.current_round() + 1000:
                    raise FailedPrecondition(f"round {round} is implausibly far ahead of the federation "
                                             f"(current {self.current_round()})")
                self._put_round(RoundRow(round=round, state="open", opened_at=self.clock()))
        # The write happens outside the broker's lock and outside a work slot (it waits for
        # the disk, not for the interpreter), so that concurrent publishes share one commit
        # (the state's group commit) and nobody else waits for them; one node's
        # publishes are serialised (its published count). Acknowledged, and visible to
        # matching through the index, only once durable.
        with self.registry.node_lock(node_id):
            node = self.registry.check(node_id, session_id)
            row = replace(node, round=max(node.round, round), last_seen=self.clock(), state="online")
            # the summaries and the node's count and round in one transaction
            accepted, dups = self.state.put_summary_block(summaries, node=row)
            self.registry.remember(replace(row, published=row.published + accepted))
            self.index.add_columns(round, node_id, summaries.prompt_ids, summaries.k)
        with self.cond:
            self.counters["summaries"] += accepted
            self.counters["duplicate_summaries"] += dups
        # Wake the round's long-polls only when this publish may have completed it: a thousand
        # waiters woken by each of a thousand publishes is a million wake-ups a round. A round
        # closed by its deadline wakes its waiters by their own timeout; one closed by a node
        # going offline or leaving, by wake_ready_rounds (housekeeping, every second).
        if self.cfg.mode == "sync" and self._round_ready(round):
            self.wakeups.wake(("round", round))
        return accepted, dups

    def wake_ready_rounds(self) -> None:
        """Wake the long-polls of every round someone waits for that is ready now (a node went
        offline or left, which no publish reports). The server's housekeeping calls it every
        second."""
        for key in self.wakeups.keys():
            if key[0] == "round" and self._round_ready(key[1]):
                self.wakeups.wake(key)

    # ----- matching -----------------------------------------------------------------------------

    def _compat_index(self, nodes: Sequence[str]) -> dict[tuple[int, int], float]:
        pos = {n: i for i, n in enumerate(nodes)}
        return {(pos[c.source], pos[c.receiver]): c.mean_s for c in self.state.compat()
                if c.source in pos and c.receiver in pos and c.groups > 0}

    def quarantined(self) -> set[str]:
        """Sources whose groups receivers rejected too often (re-verification disagreed with
        their claimed rewards). A source is quarantined when (1) at least
        `quarantine_min_reports` of its groups were reported on, (2) at least
        `quarantine_min_receivers` distinct receivers each rejected at least
        `quarantine_rejection_rate` of the groups they reported on, and (3) the mean of the
        receivers' rejection rates, each receiver weighing the same however many groups it
        reported, reaches `quarantine_rejection_rate`. So one receiver, however many of a
        source's groups it was given, cannot quarantine it alone. Derived from the durable
        compatibility counts, so it survives a restart; the operator's `trusted` list
        exempts a node."""
        return quarantined_sources(self.state.compat(), self.cfg.quarantine_rejection_rate,
                                   self.cfg.quarantine_min_reports, self.cfg.quarantine_min_receivers,
                                   trusted=self.allowlist.is_trusted if self.allowlist is not None else lambda _: False)

    def _can_source(self, node_ids: Sequence[str]) -> list[bool]:
        bad = self.quarantined()
        out = []
        for nid in node_ids:
            node = self.registry.get(nid)
            out.append(node is not None and node.privacy != "summaries_only" and nid not in bad)
        return out

    def _rate_limit(self, node_id: str) -> None:
        self._publish_rate.check(node_id)

    def _round_ready(self, round: int) -> bool:
        rnd = self._get_round(round)
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
        published = self._published_in(round)
        # Wait for online nodes working near this round: at it, or one behind. One far behind
        # (a late joiner replaying early rounds) is not waited for, and neither is one past it
        # (it will not publish this round any more; and a node claiming a round far ahead
        # must not stall every round until its deadline).
        waiting = any(n.node_id not in published and round - 1 <= n.round <= round for n in self.online_nodes())
        ready = not waiting and len(published) >= self.cfg.min_nodes
        if len(self._ready_memo) > 64:
            self._ready_memo.clear()
        self._ready_memo[key] = (now, ready)
        return ready

    def _published_in(self, round: int) -> set[str]:
        return self.index.published(round)

    def _match_round(self, round: int) -> None:
        """Synchronous close: select sources for every participant at once (for two nodes,
        exactly the paper's balanced rule): core.exchange.select_sources, computed on the
        round index's arrays (broker/matching.py; the same choices)."""
        participants, pids, k = self.index.kn(round)
        chosen = select_sources_arrays(k, self.cfg.n, self.cfg.balance == "pairwise",
                                       self._compat_index(participants), self._can_source(participants),
                                       cap=self.cfg.per_receiver_cap if self.cfg.balance == "per_receiver_cap"
                                       else None) if pids else []
        ms = MatchSet.from_choice(round, participants, pids, k, chosen)
        # one write for the whole round; a set stored before (a crash between this write and
        # the round's row) wins, so a restarted broker answers what it answered before
        if not self.state.put_match_set(round, ms.to_bytes()):
            stored = self._match_set(round)
            assert stored is not None
            ms = stored
        self._remember_set(ms)
        with self._exchange_lock:
            if self._exchange is not None:
                self._exchange.update(ms.pairs())
        rnd = self._get_round(round)
        assert rnd is not None
        self._put_round(replace(rnd, state="matched", matched_at=self.clock(), participants=ms.nodes))
        self.counters["rounds_matched"] += 1
        self.counters["matches"] += len(ms)
        log.info("round %d matched: %d nodes, %d transfers", round, len(ms.nodes), len(ms))

    def _remember_set(self, ms: MatchSet) -> None:
        with self._sets_lock:
            self._sets[ms.round] = ms
            self._sets.move_to_end(ms.round)
            while len(self._sets) > max(16, 2 * self.cfg.staleness_rounds + 4):
                self._sets.popitem(last=False)

    def _match_set(self, round: int) -> MatchSet | None:
        """The round's matching when it was matched as a whole (synchronous), else None."""
        with self._sets_lock:
            ms = self._sets.get(round)
        if ms is not None:
            return ms
        data = self.state.match_set(round)
        if data is None:
            return None
        ms = MatchSet.from_bytes(data)
        self._remember_set(ms)
        return ms

    def _matches_of(self, round: int, receiver: str) -> list[MatchRow]:
        """The receiver's matches of `round`: from the round's match set and from single rows
        (a late joiner, asynchronous mode)."""
        ms = self._match_set(round)
        rows = ms.rows(receiver=receiver) if ms is not None else []
        return rows + self.state.matches(round=round, receiver=receiver)

    def _exchange_counts(self) -> Counter[tuple[str, str]]:
        """Matches per (source, receiver) over every stored round (built once from the state,
        then kept up to date by matching)."""
        with self._exchange_lock:
            if self._exchange is None:
                counts: Counter[tuple[str, str]] = Counter((m.source, m.receiver) for m in self.state.matches())
                for r in self.state.match_set_rounds():
                    ms = self._match_set(r)
                    if ms is not None:
                        counts.update(ms.pairs())
                self._exchange = counts
            return Counter(self._exchange)

    def _match_one(self, receiver: str, round: int, min_round: int, max_round: int) -> None:
        """Match one receiver on its own against every other node's groups in [min_round,
        max_round]: the stored mode (a late joiner) and asynchronous mode. Every candidate
        in this one direction; per prompt the source core.exchange.source_rank prefers (the
        most compatible, then the highest k, then the freshest group)."""
        fails = self.index.fails(receiver, round)
        if not fails:
            return
        mine = {pid: (0, self.cfg.n) for pid in fails}
        compat = {c.source: c.mean_s for c in self.state.compat() if c.receiver == receiver and c.groups > 0}
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
                ok = dict(zip(nodes, self._can_source(nodes)))
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
        self.state.put_matches(rows)
        with self._exchange_lock:
            self._exchange = None  # recounted on the next status (a retried match writes nothing new)
        self.counters["matches"] += len(best)

    def get_matches(self, node_id: str, session_id: str, round: int, wait_s: float,
                    wait_for_bundles: bool = False, encode: Encoders | None = None) -> MatchResult:
        """The round's matches for a node, waiting up to `wait_s` (at most 60 s) for the round
        to be matched and, with `wait_for_bundles`, then for every offered bundle to be
        uploaded (a receiver waiting for its sources: woken by each upload, never polling).
        At most MAX_LONG_POLLS_PER_NODE calls of one node wait at once, and at most
        `max_long_polls` in all (RESOURCE_EXHAUSTED beyond), so that long-polls never hold
        every worker thread and heartbeats are always served. With `encode` (the codec's
        writers of MatchResponse.offers and .upload_requests, passed by the servicer) the
        answer carries them encoded (`offers_wire`, `uploads_wire`), the offers from a cache
        kept per round and receiver."""
        self._node(node_id, session_id)
        with self._polls_lock:
            if self._polls[node_id] >= MAX_LONG_POLLS_PER_NODE:
                self.counters["long_polls_refused"] += 1
                raise ResourceExhausted(f"node {clip(node_id)} already has {MAX_LONG_POLLS_PER_NODE} GetMatches "
                                        "calls waiting; wait for their answers")
            if sum(self._polls.values()) >= self.cfg.max_long_polls:
                self.counters["long_polls_refused"] += 1
                raise ResourceExhausted("the broker has too many GetMatches calls waiting; retry shortly")
            self._polls[node_id] += 1
        try:
            return self._get_matches(node_id, session_id, round, wait_s, wait_for_bundles, encode)
        finally:
            with self._polls_lock:
                self._polls[node_id] -= 1
                if not self._polls[node_id]:
                    del self._polls[node_id]

    def _get_matches(self, node_id: str, session_id: str, round: int, wait_s: float,
                     wait_for_bundles: bool, encode: Encoders | None = None) -> MatchResult:
        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        if not self._wait_matched(node_id, session_id, round, deadline):
            return MatchResult(ready=False, offers=[], upload_requests=[])
        # The answer only reads what matching has written, so it is built outside the lock:
        # with many nodes, publishes and heartbeats no longer queue behind every waiting
        # node's answer (bench/broker/load.py measured heartbeats at seconds).
        if wait_for_bundles:
            # woken by each upload of the round's bundles (of any round's, asynchronous mode)
            key = self._bundles_key(round)
            while True:
                event = self.wakeups.event(key)  # before looking: an upload meanwhile is not missed
                with self.cond:
                    missing = self._missing_bundles(node_id, round)
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    break
                event.wait(timeout=remaining)
        lo = round - self.cfg.staleness_rounds if self.cfg.mode == "async" else round
        with self.work:
            cands, solved = self._complementarity(node_id, round, lo)
            offers, offers_wire = self._offers(node_id, round, encode)
            uploads = self._upload_requests(node_id)
            if encode is None:
                return MatchResult(ready=True, offers=offers, upload_requests=uploads, candidates=cands,
                                   solved_by_peers=solved)
            return MatchResult(ready=True, offers=[], upload_requests=[], candidates=cands, solved_by_peers=solved,
                               offers_wire=offers_wire, uploads_wire=encode[1](uploads))

    def _wait_matched(self, node_id: str, session_id: str, round: int, deadline: float) -> bool:
        """Wait until the round is matched for this node, matching it when this call finds it
        ready; False when the deadline passed first. The wait is on the round's wake-up event
        (wakeups.py), never holding the broker's lock; it ends when a publish completes the
        round, when housekeeping finds it ready (a node went offline), at the round's
        deadline, or at the call's. Matching runs under the match lock and a work slot
        (always taken in that order, never while holding the broker's lock: a publish holds
        a slot and then takes the lock briefly)."""
        action: tuple[str, int] | None = None
        self._node(node_id, session_id)
        if not self.index.has_published(round, node_id):
            raise FailedPrecondition(f"node {clip(node_id)} has published nothing for round {round}; "
                                     "publish its summaries before asking for matches")
        while True:
            if self.cfg.mode == "async":
                if not self.state.matches(round=round, receiver=node_id):
                    action = ("one", round - self.cfg.staleness_rounds)
                break
            event = self.wakeups.event(("round", round))  # before looking: a wake-up meanwhile is kept
            if self._round_ready(round):
                rnd = self._get_round(round)
                assert rnd is not None
                if rnd.state != "matched":
                    action = ("round", round)
                elif node_id not in rnd.participants and not self.state.matches(round=round, receiver=node_id):
                    # published after the round was matched: learn from the stored groups
                    action = ("one", round)
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            rnd = self._get_round(round)
            until_deadline = (rnd.opened_at + self.cfg.round_deadline_s - self.clock()) if rnd else remaining
            event.wait(timeout=max(0.01, min(remaining, until_deadline)))
        if action is None:
            return True
        with self._match_lock, self.work:  # whoever comes second finds the work done
            if action[0] == "round":
                rnd = self._get_round(round)
                if rnd is not None and rnd.state != "matched":
                    self._match_round(round)
            elif not self.state.matches(round=round, receiver=node_id):
                self._match_one(node_id, round, action[1], round)
        return True

    def _bundles_key(self, round: int) -> tuple[str, int | None]:
        """The wake-up key of a wait for bundles of `round` (uploads wake it): the round's own
        in synchronous mode; one for every round in asynchronous mode, where a receiver's
        offers span several rounds."""
        return ("bundles", round if self.cfg.mode == "sync" else None)

    def _missing_bundles(self, receiver: str, round: int) -> bool:
        """Whether some group the receiver was matched to in `round` has no bundle yet."""
        ms = self._match_set(round)
        if ms is not None and ms.index(receiver) is not None:
            offers, left_out = self._receiver_offers(ms, receiver)
            if left_out or any(not o[6] for o in offers):
                return True
        matches = self.state.matches(round=round, receiver=receiver)
        heads = self.state.matched_heads(round, receiver=receiver)
        return len(heads) < len(matches) or any(not h.bundle_digest for _, h in heads)

    def _complementarity(self, receiver: str, round: int, min_round: int) -> tuple[int, int]:
        """core.exchange.complementarity of the receiver's all-fail prompts of `round` over the
        peers' groups of [min_round, round], counted on the round index's arrays."""
        return self.index.complementarity(receiver, round, min_round)

    def _summary(self, node: str, round: int, prompt_id: str) -> SummaryRow | None:
        rows = self.state.summaries(round=round, node_id=node, prompt_ids=[prompt_id])
        return rows[0] if rows else None

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
        until a digest of the round arrives or a source's model changes. Each receiver's
        answer is encoded by its own call, from pieces encoded once per round (the round's
        encoder), so that the first answers leave while later ones are still being written
        (encoding all of a round's answers before sending any held every node back by the
        whole round's encoding, issue 13)."""
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
        ms = self._match_set(round)
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
        node = self.registry.get(source)
        if node is None or node.privacy == "summaries_only":
            return []
        # Only a receiver still at the round it was matched in fetches (it waits for uploads
        # during its own step), so look at the rounds online nodes are at rather than at the
        # whole history: the answer stays the same size however long the federation runs
        # (bench/broker/load.py saw it, and the broker's memory, grow with every round).
        # (The source itself may be among them: no match has a node as its own receiver.)
        waiting, masks = self._waiting_receivers()
        out = []
        for r, receivers in sorted(waiting.items()):
            ms = self._match_set(r)
            if ms is not None:
                rows = ms.for_source(source)
                if rows.size:
                    mask = masks.get(r)
                    if mask is None or mask[0] is not ms:
                        mask = masks[r] = (ms, np.fromiter((name in receivers for name in ms.nodes), dtype=bool,
                                                           count=len(ms.nodes)))
                    rows = rows[mask[1][ms.receiver[rows]]]
                if rows.size:
                    with self.index.lock:
                        have = self.index.book(r).digests.get(source, {})
                    pids = ms.pids
                    out.extend((pids[c], r) for c in set(ms.col[rows].tolist()) if pids[c] not in have)
            for m, s in self.state.matched_heads(r, source=source):
                if m.receiver in receivers and not s.bundle_digest:
                    out.append((m.prompt_id, m.source_round))
        return sorted(set(out))

    def _waiting_receivers(self) -> tuple[dict[int, set[str]], dict[int, tuple[MatchSet, np.ndarray]]]:
        """Online nodes by the round they are at, and a cache for masks of them over a round's
        match set: recomputed when the registry changed (a node joined, left or moved to
        another round) and at most every quarter second for liveness alone."""
        now, version = time.monotonic(), self.registry.version
        cached = self._waiting
        if cached is not None and cached[1] == version and now - cached[0] < 0.25:
            return cached[2], cached[3]
        waiting: dict[int, set[str]] = {}
        for n in self.online_nodes():
            waiting.setdefault(n.round, set()).add(n.node_id)
        self._waiting = (now, version, waiting, {})
        return waiting, self._waiting[3]

    # ----- bundles ------------------------------------------------------------------------------

    def has_bundles(self, node_id: str, session_id: str, digests: Sequence[str]) -> list[str]:
        if len(digests) > MAX_DIGESTS_PER_CALL:
            raise InvalidArgument(f"{len(digests)} digests in one call; at most {MAX_DIGESTS_PER_CALL}")
        for d in digests:
            if not is_digest(d):
                raise InvalidArgument(f"malformed digest {clip(d, 70)}: expected 64 lowercase hex digits")
        with self.cond:
            self._node(node_id, session_id)
            return self.state.has_bundles(digests)

    def upload_allowed(self, node_id: str, session_id: str) -> None:
        """Checks that need no payload, run before receiving the chunks."""
        with self.cond:
            node = self._node(node_id, session_id)
        if node.privacy == "summaries_only":
            raise PermissionDenied(f"node {clip(node_id)} declared privacy summaries_only; it uploads no trajectories")
        if node_id in self.quarantined():
            raise PermissionDenied(f"node {clip(node_id)} is quarantined: receivers rejected too many of its groups "
                                   "(claimed rewards did not re-verify); the operator can release it")

    def begin_upload(self, node_id: str, session_id: str, prompt_id: str, round: int, digest: str, size: int,
                     signature: bytes = b"", signer_cert: bytes = b"") -> BundleUpload:
        """Start storing a node's bundle of `size` bytes, which then come a chunk at a time
        (broker/uploads.py: hashed, checked and written as they arrive). The checks that need
        no bytes run here. With `signer_cert` (the node's mTLS certificate, DER) a signature
        must verify for this node and digest and is stored with the bytes for receivers to
        check; without a certificate to check it against (no mutual TLS) a signature is
        dropped and the bundle stored unsigned."""
        self.upload_allowed(node_id, session_id)
        if not is_digest(digest):
            raise InvalidArgument(f"malformed digest {clip(digest, 70)}: expected 64 lowercase hex digits")
        quota = self.cfg.max_node_bundle_mib * 2**20
        if quota and self._bundle_bytes[node_id] + size > quota:
            raise ResourceExhausted(f"node {clip(node_id)} exceeded its bundle storage quota of "
                                    f"{self.cfg.max_node_bundle_mib} MiB")
        if signature and signer_cert:
            try:
                cert = load_certificate_der(signer_cert)
                if common_name(cert) != node_id:
                    raise ProvenanceError(f"the client certificate is {common_name(cert)!r}'s, not {clip(node_id)}'s")
                verify_signature(cert, node_id, digest, signature)
            except ProvenanceError as exc:
                raise InvalidArgument(f"bundle signature rejected: {exc}. Sign with the key of the certificate "
                                      "this connection presents") from None
        elif signature:
            if not self._warned_unverifiable:
                log.warning("node %s signs its bundles but this broker does not use mutual TLS, so it has no "
                            "certificate to relay with them: bundles are stored unsigned (set client_ca)", node_id)
                self._warned_unverifiable = True
            signature = b""
        else:
            signer_cert = b""
        return BundleUpload(self._store_upload, self.state.begin_bundle(), node_id, prompt_id, round, digest, size, signature,
                            signer_cert)

    def put_bundle(self, node_id: str, session_id: str, prompt_id: str, round: int, digest: str,
                   data: bytes, signature: bytes = b"", signer_cert: bytes = b"") -> bool:
        """Store a node's bundle whole: begin_upload, its bytes in chunks, finish."""
        upload = self.begin_upload(node_id, session_id, prompt_id, round, digest, len(data), signature, signer_cert)
        try:
            view, chunk = memoryview(data), self.cfg.chunk_kib * 1024
            for off in range(0, len(data), chunk):
                upload.write(view[off:off + chunk])
            return upload.finish()
        finally:
            upload.abort()  # a no-op once finished

    def _store_upload(self, up: BundleUpload, rec: GroupRecord) -> bool:
        """The end of an upload whose bytes hashed to its digest and hold `rec`: check the
        record against its summary, commit the bytes, attach the digest, wake the waiters."""
        node_id, round, prompt_id = up.node_id, up.round, up.prompt_id
        with self.cond:
            summary = self._summary(node_id, round, prompt_id)
            if summary is None:
                raise NotFound(f"node {clip(node_id)} published no summary for prompt {clip(prompt_id)} in round {round}")
            if (rec.prompt_id != prompt_id or rec.k != summary.k or rec.n != summary.n
                    or list(rec.mean_logprobs) != list(summary.mean_logprobs)
                    or list(rec.lengths) != list(summary.lengths) or rec.step != summary.policy_version):
                raise InvalidArgument("the bundle does not hold the group its summary describes "
                                      "(prompt id, k, n, lengths, step or mean log-probs differ)")
            stored = up.writer.commit(up.digest, signature=up.signature, signer_cert=up.signer_cert)
            if stored:
                self._bundle_bytes[node_id] += up.size
                self.counters["bundles_signed" if up.signature else "bundles_unsigned"] += 1
            self.state.set_bundle_digest(node_id, round, prompt_id, up.digest)
            self.index.set_digest(round, node_id, prompt_id, up.digest)
            self.counters["bundles_stored" if stored else "bundles_duplicate"] += 1
            self.counters["bundle_bytes_in"] += up.size
        self.wakeups.wake(self._bundles_key(round))
        return stored

    def get_bundle(self, node_id: str, session_id: str, digest: str) -> bytes:
        return self.fetch_bundle(node_id, session_id, digest)[0]

    def fetch_bundle(self, node_id: str, session_id: str, digest: str) -> tuple[bytes, bytes, bytes]:
        """(bytes, producer's signature, producer's certificate DER) of a bundle the node was
        matched to; the last two are empty for an unsigned bundle."""
        self._check_grant(node_id, session_id, digest)
        data = self.state.get_bundle(digest)
        provenance = self.state.bundle_provenance(digest)
        if data is None or provenance is None:
            raise NotFound(f"no bundle {digest[:12]}... (pruned by retention?)")
        self.counters["bundle_bytes_out"] += len(data)
        return data, provenance[0], provenance[1]

    def open_bundle(self, node_id: str, session_id: str, digest: str) -> tuple[int, bytes, bytes]:
        """fetch_bundle without the bytes: (size, signature, certificate DER) of a bundle the
        node was matched to, whose bytes `stream_bundle` then yields a chunk at a time (a
        fetch holds one chunk in memory, not the bundle)."""
        self._check_grant(node_id, session_id, digest)
        size = self.state.bundle_size(digest)
        provenance = self.state.bundle_provenance(digest)
        if size is None or provenance is None:
            raise NotFound(f"no bundle {digest[:12]}... (pruned by retention?)")
        return size, provenance[0], provenance[1]

    def stream_bundle(self, digest: str, chunk: int) -> Iterator[bytes]:
        """The chunks of a bundle `open_bundle` granted; NotFound when it was pruned meanwhile."""
        chunks = self.state.iter_bundle(digest, chunk)
        if chunks is None:
            raise NotFound(f"no bundle {digest[:12]}... (pruned by retention while it was being fetched)")
        for data in chunks:
            self.counters["bundle_bytes_out"] += len(data)
            yield data

    def _check_grant(self, node_id: str, session_id: str, digest: str) -> None:
        if not is_digest(digest):
            raise InvalidArgument("digest must be 64 lowercase hex digits")
        self._node(node_id, session_id)
        if not self.grants.allowed(node_id, digest):
            if not self.state.has_bundles([digest]):
                raise NotFound(f"no bundle {digest[:12]}...")
            raise PermissionDenied(f"node {clip(node_id)} was not matched to bundle {digest[:12]}...; ask for "
                                   "matches first")

    # ----- compatibility -----------------------------------------------------------------------

    def report(self, node_id: str, session_id: str, round: int, entries: Iterable[ReportEntry]) -> tuple[int, int]:
        """Fold a receiver's verdicts into the compatibility matrix; returns (accepted,
        duplicates). A report about one group, (round, receiver, source, prompt), counts
        once however often it is sent: a retried or replayed report changes nothing, and a
        receiver cannot inflate a source's rejections by repeating one. A rejection of a
        group the broker holds and re-verifies as correct is not counted (`recheck_rejections`)."""
        entries = list(entries)
        limit = self.manifest.prompts_per_round * MAX_PER_ROUND_FACTOR
        if len(entries) > limit:
            # a receiver gets at most one group per prompt of its round
            raise InvalidArgument(f"{len(entries)} entries in one report; at most {limit} (one per group received)")
        seen = set()
        for e in entries:
            if not e.rejected and not (math.isfinite(e.mean_s) and 0 <= e.mean_s <= 1e6):
                raise InvalidArgument(f"mean_s must be a finite number in [0, 1e6], got {e.mean_s}")
            if not (0.0 <= e.admitted_fraction <= 1.0):
                raise InvalidArgument(f"admitted_fraction must be in [0, 1], got {e.admitted_fraction}")
            if (e.source, e.prompt_id) in seen:
                raise InvalidArgument(f"source {clip(e.source)} and prompt {clip(e.prompt_id)} appear twice in one "
                                      "report; send one entry per group received")
            seen.add((e.source, e.prompt_id))
        with self.cond:
            self._node(node_id, session_id)
            if round > self.current_round() + MAX_ROUNDS_AHEAD:
                raise FailedPrecondition(f"report for round {round}, implausibly far ahead of the federation "
                                         f"(current {self.current_round()})")
            for source in {e.source for e in entries}:
                if source == node_id or self.state.get_node(source) is None:
                    raise InvalidArgument(f"unknown source node {clip(source)}")
            # a receiver reports only on groups it was matched to: otherwise one node could
            # invent rejections of an honest source's groups and push it into quarantine
            matched = {(m.source, m.prompt_id): m for m in self._matches_of(round, node_id)}
            for e in entries:
                if (e.source, e.prompt_id) not in matched:
                    raise FailedPrecondition(f"{clip(node_id)} was not matched to {clip(e.source)}'s group for "
                                             f"prompt {clip(e.prompt_id)} in round {round}; report only the groups "
                                             "the broker offered you, with the round they were offered in")
        # outside the lock: re-verifying may take a while and needs nothing the lock guards
        disputed = {(e.source, e.prompt_id) for e in entries
                    if e.rejected and self._rejection_disputed(matched[(e.source, e.prompt_id)])}
        if disputed:
            self.counters["disputed_rejections"] += len(disputed)
            log.warning("receiver %s reported %d group(s) rejected that the broker re-verified as correct; "
                        "those rejections are not counted", clip(node_id), len(disputed))
        rows = [ReportRow(round=round, receiver=node_id, source=e.source, prompt_id=e.prompt_id,
                          mean_s=e.mean_s if not e.rejected else 0.0, admitted_fraction=e.admitted_fraction,
                          rejected=e.rejected) for e in entries if (e.source, e.prompt_id) not in disputed]
        with self.cond:
            accepted, dups = self.state.put_reports(rows)
            self.counters["reports"] += accepted
            self.counters["duplicate_reports"] += dups
            # counted once per group, like the matrix (a repeated rejection is a duplicate)
            self.counters["rejected_groups"] = sum(c.rejected for c in self.state.compat())
        return accepted, dups

    def _rejection_disputed(self, match: MatchRow) -> bool:
        """True when the broker holds the matched group's bundle and its own re-verification
        (the federation's verifier, the dataset's answer) agrees with the claimed rewards:
        then a receiver's claim that the group failed re-verification is false. False when the
        broker cannot check (no bundle held, no verifier, the check failed)."""
        if not self.cfg.recheck_rejections:
            return False
        summary = self._summary(match.source, match.source_round, match.prompt_id)
        prompt = self.prompts_by_id.get(match.prompt_id)
        if summary is None or not summary.bundle_digest or prompt is None:
            return False
        data = self.state.get_bundle(summary.bundle_digest)
        if data is None:
            return False
        try:
            rec = decode_bundle(data, summary.bundle_digest)
            verifier = self._get_verifier()
            if verifier is None:
                return False
            scored = verifier.score(list(rec.texts), [prompt.answer] * rec.n).rewards
        except Exception as exc:  # noqa: BLE001 - a check the broker cannot make counts the claim
            log.warning("could not re-verify %s's group for %s: %s", match.source, clip(match.prompt_id), exc)
            return False
        return [float(r) for r in scored] == [float(r) for r in rec.rewards]

    def _get_verifier(self):  # noqa: ANN202 - graft_fed.rewards.verifier.Verifier, imported lazily
        with self._verifier_lock:
            if self._verifier is None and not self._verifier_failed:
                try:
                    from graft_fed.rewards.verifier import build_verifier

                    self._verifier = build_verifier(self.cfg.verifier)
                except Exception as exc:  # noqa: BLE001 - the broker works without it
                    log.warning("the broker cannot load the verifier %s (%s): rejections are counted as "
                                "reported, unchecked", self.cfg.verifier.name, exc)
                    self._verifier_failed = True
            return self._verifier

    # ----- status and retention -------------------------------------------------------------------

    def status(self) -> dict:
        nodes = self.registry.all()
        with self.cond:
            now = self.clock()
            exchange = self._exchange_counts()
            compat = {(c.source, c.receiver): c for c in self.state.compat()}
            n_bundles, n_bytes = self.state.bundle_stats()
            bad = self.quarantined()
        pairs = []
        for key in sorted(set(exchange) | set(compat)):
            c = compat.get(key)
            pairs.append({"source": key[0], "receiver": key[1], "groups": exchange.get(key, 0),
                          "mean_s": c.mean_s if c else math.nan,
                          "admitted_fraction": c.admitted_fraction if c else math.nan,
                          "rejected": c.rejected if c else 0})
        return {
            "manifest": self.manifest, "current_round": self.current_round(),
            "nodes": [{"node_id": n.node_id, "model_id": n.model_id,
                       "state": ("revoked" if self.allowlist is not None and self.allowlist.is_revoked(n.node_id)
                                 else "quarantined" if n.node_id in bad else self.node_state(n)), "round": n.round,
                       "published": n.published, "last_seen_s": now - n.last_seen} for n in nodes],
            "pairs": pairs, "bundles": n_bundles, "bundle_bytes": n_bytes,
        }

    def prune(self) -> int:
        """Retention. `keep_rounds` counts back from the highest round at least two nodes have
        reached (from the highest round when there is one node), not from the highest round
        anyone published: one node publishing far ahead (a round up to current + 1000 is
        accepted) must not make the broker drop every other node's groups."""
        with self.cond:
            max_bytes = int(self.cfg.max_bundle_gib * 2**30) if self.cfg.max_bundle_gib else None
            keep = self.cfg.keep_rounds
            if keep is not None:
                latest = self.state.latest_round()
                rounds = sorted(n.round for n in self.registry.all())
                agreed = rounds[-2] if len(rounds) >= 2 else latest
                keep += max(0, latest - max(agreed, 0))
            removed = self.state.prune(keep_rounds=keep, max_bundle_bytes=max_bytes)
            if removed:
                self.index.clear()  # rebuilt from what the state still holds
                with self._rounds_lock:
                    self._rounds.clear()
                with self._sets_lock:
                    self._sets.clear()
                with self._answers_lock:
                    self._answers.clear()
                with self._exchange_lock:
                    self._exchange = None
            return removed
