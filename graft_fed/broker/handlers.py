"""The broker's domain logic behind one facade, `Federation`, whose methods the servicer
calls. The parts (each a module of broker/) share one Context (broker/context.py):
sessions.py (join, leave, heartbeats), rounds.py (round rows, readiness), publishing.py
(summaries), matcher.py (matching), answers.py (GetMatches), bundles.py (uploads and
fetches), reports.py (compatibility reports); status and retention, which read or clear
every part, are here.

No gRPC here: methods take and return plain data and raise the domain errors of
graft_fed.federation.errors; the servicer translates. Every method that changes state
validates its whole input first, so a rejected request leaves the state as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from graft_fed.broker.answers import Answers, Encoders
from graft_fed.broker.auth import Allowlist
from graft_fed.broker.bundles import Bundles
from graft_fed.broker.compat import CompatTable, CompatView, pair_rows
from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.context import Context
from graft_fed.broker.exchange import ExchangeView
from graft_fed.broker.grants import MAX_GRANTS, Grants
from graft_fed.broker.matcher import Matcher
from graft_fed.broker.publishing import Publishing, Received
from graft_fed.broker.registry import Cadence, Registry
from graft_fed.broker.replay import ReplayGuard
from graft_fed.broker.reports import Reports
from graft_fed.broker.roundindex import RoundIndex
from graft_fed.broker.rounds import Rounds
from graft_fed.broker.sessions import Sessions, hold_for_of
from graft_fed.broker.state import BrokerState, CompatRow, NodeRow
from graft_fed.broker.uploads import BundleUpload
from graft_fed.broker.wakeups import Wakeups
from graft_fed.data.config import load_prompts
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version
from graft_fed.federation.messages import MatchResult, ReportEntry, ReportReader, SummaryRow
from graft_fed.federation.summaryblock import SummaryBlock

log = logging.getLogger("graft_fed.broker")


class Federation:
    def __init__(self, cfg: BrokerConfig, state: BrokerState, clock: Callable[[], float] = time.time,
                 allowlist: Allowlist | None = None) -> None:
        self.cfg = cfg
        self.state = state
        self.clock = clock
        self.allowlist = allowlist
        prompts = load_prompts(cfg.data)
        self.known_prompts = {p.id for p in prompts}
        self.manifest = Manifest(
            federation_id=cfg.federation_id, protocol_version=PROTOCOL_VERSION,
            dataset_id=prompts[0].dataset if prompts else cfg.data.source,
            dataset_hash=dataset_hash(prompts), seed=cfg.seed, n=cfg.n, prompts_per_round=cfg.prompts_per_round,
            mode=cfg.mode, verifier_name=cfg.verifier.name, verifier_version=verifier_version(cfg.verifier),
            staleness_rounds=cfg.staleness_rounds, advantage=cfg.advantage)
        state.bind_manifest(self.manifest)  # a state of another federation is refused (broker/state.py)
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
        self.registry = Registry(state, clock, Cadence(cfg.heartbeat_interval_s, cfg.offline_after_s,
                                                       cfg.max_heartbeats_per_s, clock))
        self.rounds = Rounds(cfg, state, clock, self.registry, self.index, self.wakeups)
        # heavy calls (publishes, matching and answers) take a slot, so that only a few threads
        # want the interpreter at once and short calls (heartbeats) are served between them
        self.work = threading.BoundedSemaphore(cfg.work_slots)
        self.prompts_by_id = {p.id: p for p in prompts}
        # request ids of applied state-changing requests, per node, within the replay window
        self.replay = ReplayGuard(cfg.replay_window_s, cfg.require_request_ids, clock=clock)
        ctx = Context(cfg=cfg, state=state, clock=clock, allowlist=allowlist, manifest=self.manifest,
                      known_prompts=self.known_prompts, prompts_by_id=self.prompts_by_id, cond=self.cond,
                      wakeups=self.wakeups, counters=self.counters, grants=self.grants, index=self.index,
                      registry=self.registry, work=self.work, rounds=self.rounds,
                      compat=CompatTable(state.compat))
        self.ctx = ctx
        self.sessions = Sessions(ctx)
        self.publishing = Publishing(ctx)
        self.matcher = Matcher(ctx)
        self.answers = Answers(ctx, self.matcher)
        self.bundles = Bundles(ctx)
        self.reports = Reports(ctx, self.matcher)
        self._left_behind: set[str] = set()  # online nodes retention no longer waits for (prune)

    # ----- sessions (sessions.py, rounds.py) -------------------------------------------------------

    def check_session(self, node_id: str, session_id: str) -> NodeRow:
        """The node's row when `session_id` is its live session (UNAUTHENTICATED otherwise), without
        marking it seen."""
        return self.registry.check(node_id, session_id)

    def online_nodes(self) -> list[NodeRow]:
        return self.registry.online()

    def rescale_heartbeats(self) -> None:
        """Scale the heartbeat interval and the offline silence to the nodes online (the
        server's housekeeping calls it every second; registry.py::Cadence)."""
        self.registry.cadence.update(self.registry.online_count())

    def heartbeat_interval_s(self) -> float:
        """The interval nodes are told to heartbeat at now."""
        return self.registry.cadence.interval_s

    def flush_liveness(self) -> int:
        """Persist the nodes' last-seen times (the server's housekeeping calls it every second)."""
        return self.registry.flush()

    def node_state(self, node: NodeRow) -> str:
        return self.sessions.node_state(node)

    def join(self, node_id: str, model_id: str, tokenizer_id: str, manifest: Manifest, privacy: str,
             resume_round: int, node_secret: str = "") -> tuple[str, int]:
        return self.sessions.join(node_id, model_id, tokenizer_id, manifest, privacy, resume_round, node_secret)

    def forget_secret(self, node_id: str, options: Mapping[str, str] | None = None) -> str:
        """An operator's request (broker/spool.py)."""
        return self.sessions.forget_secret(node_id, hold_for_of(options))

    def leave(self, node_id: str, session_id: str) -> None:
        self.sessions.leave(node_id, session_id)

    def heartbeat(self, node_id: str, session_id: str, round: int) -> tuple[int, int]:
        return self.sessions.heartbeat(node_id, session_id, round)

    def current_round(self) -> int:
        return self.rounds.current()

    def wake_ready_rounds(self) -> None:
        """Wake the long-polls of every round someone waits for that is ready now (the server's
        housekeeping calls it every second)."""
        self.rounds.wake_ready()

    # ----- publishing (publishing.py) -----------------------------------------------------------

    def publish(self, node_id: str, session_id: str, round: int, summaries: Sequence[SummaryRow]) -> tuple[int, int]:
        return self.publishing.publish(node_id, session_id, round, summaries)

    def check_block(self, node_id: str, round: int, block: SummaryBlock) -> None:
        """A publish's checks on its block (the caller holds a work slot: `work`)."""
        self.publishing.check_block(node_id, round, block)

    def check_count(self, count: int) -> None:
        """A publish's number of summaries against the per-round limit (ResourceExhausted)."""
        self.publishing.check_count(count)

    def check_rows(self, node_id: str, round: int, summaries: Sequence[SummaryRow]) -> SummaryBlock:
        """A publish's checks on its summaries as rows, and their block (the caller holds a work slot)."""
        return self.publishing.check_rows(node_id, round, summaries)

    def publish_received(self, work: Received) -> tuple[int, int]:
        """A received publish, decoded, checked and stored (by the publish queue's thread in a
        batch with `publish_queue`, else by the caller's: Publishing.submit)."""
        return self.publishing.submit(work)

    def stop(self) -> None:
        """Run the queued publishes, then refuse new ones (the server stops)."""
        self.publishing.queue.stop()

    # ----- matching (matcher.py, answers.py) ----------------------------------------------------

    def quarantined(self) -> set[str]:
        """Sources whose groups receivers rejected too often (Context.quarantined has the rule)."""
        return self.ctx.quarantined()

    def get_matches(self, node_id: str, session_id: str, round: int, wait_s: float,
                    wait_for_bundles: bool = False, encode: Encoders | None = None,
                    park: bool = False) -> MatchResult:
        return self.answers.get_matches(node_id, session_id, round, wait_s, wait_for_bundles, encode, park)

    # ----- bundles (bundles.py) -----------------------------------------------------------------

    def has_bundles(self, node_id: str, session_id: str, digests: Sequence[str]) -> list[str]:
        return self.bundles.has_bundles(node_id, session_id, digests)

    def upload_allowed(self, node_id: str, session_id: str) -> None:
        self.bundles.upload_allowed(node_id, session_id)

    def begin_upload(self, node_id: str, session_id: str, prompt_id: str, round: int, digest: str, size: int,
                     signature: bytes = b"", signer_cert: bytes = b"") -> BundleUpload:
        return self.bundles.begin_upload(node_id, session_id, prompt_id, round, digest, size, signature, signer_cert)

    def put_bundle(self, node_id: str, session_id: str, prompt_id: str, round: int, digest: str,
                   data: bytes, signature: bytes = b"", signer_cert: bytes = b"") -> bool:
        return self.bundles.put_bundle(node_id, session_id, prompt_id, round, digest, data, signature, signer_cert)

    def get_bundle(self, node_id: str, session_id: str, digest: str) -> bytes:
        return self.bundles.get_bundle(node_id, session_id, digest)

    def fetch_bundle(self, node_id: str, session_id: str, digest: str) -> tuple[bytes, bytes, bytes]:
        return self.bundles.fetch_bundle(node_id, session_id, digest)

    def open_bundle(self, node_id: str, session_id: str, digest: str) -> tuple[int, bytes, bytes]:
        return self.bundles.open_bundle(node_id, session_id, digest)

    def check_stored_bundle(self, digest: str) -> None:
        self.bundles.check_stored(digest)

    def bundle_file(self, digest: str) -> tuple[str, int] | None:
        return self.bundles.bundle_file(digest)

    def bytes_sent(self, count: int) -> None:
        self.bundles.bytes_sent(count)

    def file_unsent(self, digest: str, outcome: str, reason: str = "") -> None:
        self.bundles.file_unsent(digest, outcome, reason)

    def stream_bundle(self, digest: str, chunk: int) -> Iterator[bytes]:
        return self.bundles.stream_bundle(digest, chunk)

    # ----- compatibility (reports.py) -------------------------------------------------------------

    def report(self, node_id: str, session_id: str, round: int,
               entries: Iterable[ReportEntry] | ReportReader) -> tuple[int, int]:
        return self.reports.report(node_id, session_id, round, entries)

    # ----- status and retention -------------------------------------------------------------------

    def status(self, pairs: bool = True, max_pairs: int | None = None) -> dict:
        """Nodes, rounds, bundles and (with `pairs`) the (source, receiver) pairs that exchanged
        a group or reported on one, by name: all of them, or the `max_pairs` with the most
        groups; `pairs_total` says how many there are. Without `pairs` the status costs
        O(nodes): /metrics reads the pairs from `exchange()` instead."""
        nodes = self.registry.all()
        with self.cond:
            now = self.clock()
            n_bundles, n_bytes = self.state.bundle_stats()
            bad = self.ctx.quarantined()
        # outside the broker's lock: the exchange and the compatibility counts keep their own
        rows, total = pair_rows(self.matcher.exchange(), self.ctx.compat.view(), max_pairs) if pairs else ([], 0)
        return {
            "manifest": self.manifest, "current_round": self.current_round(),
            "nodes": [{"node_id": n.node_id, "model_id": n.model_id,
                       "state": ("revoked" if self.allowlist is not None and self.allowlist.is_revoked(n.node_id)
                                 else "quarantined" if n.node_id in bad else self.node_state(n)), "round": n.round,
                       "published": n.published, "last_seen_s": now - n.last_seen,
                       # what the per-node quotas count (answered from memory, no lock)
                       "summaries_held": self.state.summaries_held(n.node_id),
                       "bundle_bytes_held": self.state.bundle_bytes_held(n.node_id)} for n in nodes],
            "pairs": rows, "pairs_total": total, "bundles": n_bundles, "bundle_bytes": n_bytes,
            "max_node_summaries": self.cfg.max_node_summaries,
            "max_node_bundle_bytes": self.cfg.max_node_bundle_mib * 2**20,
        }

    def exchange(self) -> ExchangeView:
        """Groups matched per (source, receiver) over every stored round (broker/exchange.py)."""
        return self.matcher.exchange()

    def compat_view(self) -> CompatView:
        """Every pair's compatibility counts as arrays (broker/compat.py), for /metrics."""
        return self.ctx.compat.view()

    def compat_totals(self) -> tuple[int, int, int]:
        """(pairs with compatibility counts, groups rejected, groups reported undelivered)."""
        return self.ctx.compat.totals()

    def compat(self, among: Iterable[str] | None = None) -> list[CompatRow]:
        """The compatibility counts per (source, receiver), by (source, receiver); with `among`,
        of the pairs between those nodes only (broker/compat.py)."""
        return self.ctx.compat.rows(among)

    def prune(self) -> int:
        """Retention. `keep_rounds` counts back from the highest round at least two nodes have
        published (rounds.py, `agreed`; the highest round when there is one node) or from the
        lowest round an online node has come to, whichever is lower; not from the highest round
        anyone published: nodes publishing far ahead (two ids can move the agreed round) must
        not make the broker drop the groups of the nodes at work (and a late joiner replaying
        early rounds keeps the groups it is matched against, unless `retention_max_lag_rounds`
        is set: an online node further than that behind the median online node is left out of
        "the lowest round", and logged once when it falls behind)."""
        with self.cond:
            max_bytes = int(self.cfg.max_bundle_gib * 2**30) if self.cfg.max_bundle_gib else None
            keep = self.cfg.keep_rounds
            if keep is not None:
                latest = self.state.latest_round()
                anchor = self.rounds.agreed()
                lowest, behind = self.rounds.lowest_online(self.cfg.retention_max_lag_rounds)
                self._note_left_behind(behind)
                if lowest is not None:
                    anchor = min(anchor, lowest)
                keep += max(0, latest - anchor)
            removed = self.state.prune(keep_rounds=keep, max_bundle_bytes=max_bytes)
            if removed:
                self.index.clear()  # rebuilt from what the state still holds
                self.rounds.forget_rows()
                self.matcher.forget_sets()
                self.answers.forget_answers()
                self.matcher.forget_exchange()
            return removed

    def left_behind(self) -> list[str]:
        """The online nodes the last retention pass no longer waited for (`retention_max_lag_rounds`)."""
        return sorted(self._left_behind)

    def _note_left_behind(self, behind: list[tuple[str, int]]) -> None:
        """Log each online node retention stops waiting for, once until it catches up."""
        for node, round_ in behind:
            if node not in self._left_behind:
                log.warning("node %s is at round %d, more than retention_max_lag_rounds (%d) behind the median "
                            "online node: retention no longer keeps the rounds since its own for it, so the "
                            "rounds it comes to may have lost its peers' groups", node, round_,
                            self.cfg.retention_max_lag_rounds)
        self._left_behind = {node for node, _ in behind}
