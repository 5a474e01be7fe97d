"""Peers = a federation's broker over gRPC: the node's side of the GRAFT step.

publish: this round's summaries (and, with share_all, the informative groups' bundles);
offers: the broker's matches for this round (a long-poll), the uploads the broker asks of
this node, then the offered bundles, each checked (digest, record, the producer's
signature); report: the receiver's verdict on every group it was offered.

When the broker is unreachable or slow the step goes on as plain GRPO and the node
reconnects with backoff and jitter; the summaries of the rounds it could not publish wait
in a backlog and are published once it is back (idempotent: a publish whose answer was
lost is counted as a duplicate, never stored twice), so the broker ends up with every
group the node sampled.

Under torchrun only the main process talks to the broker; what it gets (the offered
records and the metrics) reaches the other processes by broadcast (`GRPOTrainer.from_main`),
so every process receives and trains on the same groups.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.errors import ConfigError
from graft_fed.federation.errors import PERMANENT, FailedPrecondition, FederationError, InvalidArgument, \
    NotFound, PermissionDenied, ResourceExhausted, Unauthenticated
from graft_fed.federation.limits import MAX_DIGESTS_PER_CALL, MAX_REPORT_MEAN_S
from graft_fed.federation.manifest import Manifest
from graft_fed.federation.messages import MatchResult, Offer, Privacy, ReportEntry, SummaryRow, summarise
from graft_fed.federation.policy import fetch_failure_is_per_offer, offers_to_fetch, refused_record_entry, \
    undelivered_entries, uploads_to_serve
from graft_fed.federation.signing import ProvenanceError
from graft_fed.graft.receive import GroupReport, offer_metrics
from graft_fed.graft.step import Offers
from graft_fed.node.client import UPLOAD_REFUSALS, Backoff, BrokerClient, BundlesRefused, DeliveryError
from graft_fed.trainer.group import Group, StepData
from graft_fed.trainer.grpo import GRPOTrainer

log = logging.getLogger("graft_fed.node")

#: Unpublished rounds kept for publishing later (the oldest go first beyond this).
MAX_BACKLOG_ROUNDS = 1024
#: Backlog rounds published per step once the broker is back (bounded so a long outage
#: does not turn one step into a burst the broker's rate limit refuses).
BACKLOG_ROUNDS_PER_STEP = 16
#: Compatibility reports kept for sending later when the broker could not be reached (the
#: oldest go first beyond this): a rejection lost to an outage lets a lying source go on.
MAX_REPORT_BACKLOG_ROUNDS = 64


def summary_of(group: Group, node_id: str, round: int, step: int) -> SummaryRow:
    """What leaves the site about a group whatever the privacy setting: no text."""
    return summarise(node_id, round, step, group.prompt.id, group.rewards.tolist(),
                     [len(c.token_ids) for c in group.completions], [c.mean_logprob for c in group.completions])


@dataclass
class FetchedOffers:
    """The peer groups of one step's offers that passed the receiver's checks."""

    records: dict[str, GroupRecord] = field(default_factory=dict)  # prompt id -> the source's group
    bad: int = 0  # bundles refused, for any reason
    bad_signatures: int = 0  # ... because their producer could not be established
    unsigned: int = 0  # accepted without a signature (signatures not required)
    refused: int = 0  # fetches the broker refused (NOT_FOUND, ...) or whose bytes did not arrive whole: that offer only
    delivery_failed: int = 0  # ... of which: bytes that did not arrive as the digest names them (DeliveryError)
    undelivered: int = 0  # offers whose bundle never arrived
    #: Groups refused for their provenance or content (reported as rejected, so that the
    #: broker's quarantine sees a source whose bundles do not check out) and offers never
    #: delivered (reported with s = 0, so a source that claims groups and never delivers them
    #: stops winning matches).
    rejections: list[ReportEntry] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"federation/bad_signatures": float(self.bad_signatures),
                "federation/unsigned_bundles": float(self.unsigned),
                "federation/fetch_refused": float(self.refused), "federation/undelivered": float(self.undelivered),
                "federation/delivery_failed": float(self.delivery_failed)}


def fetch_offers(client: BrokerClient, offers: Sequence[Offer], n: int | None = None) -> FetchedOffers:
    """Download and check every offered bundle: digest, record, and who produced it (the
    signature must be the offered source's, see graft_fed/federation/signing.py); with `n`
    (the federation's group size), a record of another size is refused too. A bundle
    that fails is skipped, never trained on, and reported as a rejected group of that
    source; a fetch the broker refuses, or whose bytes do not arrive as the digest names them
    (DeliveryError), skips that offer only (reported as undelivered); only a lost broker
    raises."""
    out = FetchedOffers()
    for o in offers:
        if not o.digest:
            continue
        try:
            got = client.fetch_bundle(o.digest, source=o.source_node)
        except ProvenanceError as exc:
            log.warning("bundle %s... offered as %s's rejected: %s", o.digest[:12], o.source_node, exc)
            out.bad += 1
            out.bad_signatures += 1
            out.rejections.append(refused_record_entry(o))
            continue
        except DeliveryError as exc:
            # the bytes did not arrive as the broker hashed them at upload: not the source's
            # doing, so reported as undelivered (s 0), never as a rejected group of the source
            log.warning("bundle %s... offered as %s's not delivered: %s", o.digest[:12], o.source_node, exc)
            out.bad += 1
            out.refused += 1
            out.delivery_failed += 1
            continue
        except RecordError as exc:
            log.warning("bundle from %s rejected: %s", o.source_node, exc)
            out.bad += 1
            out.rejections.append(refused_record_entry(o))
            continue
        except FederationError as exc:
            if not fetch_failure_is_per_offer(exc):
                raise
            log.warning("fetch of %s's bundle %s... refused (%s: %s); skipping that offer", o.source_node,
                        o.digest[:12], exc.status, exc)
            out.bad += 1
            out.refused += 1
            continue
        if got.record.prompt_id != o.prompt_id or (n is not None and got.record.n != n):
            log.warning("bundle from %s rejected: it holds %d responses for prompt %r, offered as prompt %r (a "
                        "federation's groups have %s)", o.source_node, got.record.n, got.record.prompt_id[:64],
                        o.prompt_id[:64], n)
            out.bad += 1
            out.rejections.append(refused_record_entry(o))
            continue
        out.unsigned += not got.signer
        # Name the source by its node id, so reports and metrics key on it.
        out.records[o.prompt_id] = dataclasses.replace(got.record, model_id=o.source_node)
    missing = undelivered_entries(offers, received=set(out.records),
                                  already_reported={(e.source, e.prompt_id) for e in out.rejections})
    out.undelivered = len(missing)
    out.rejections += missing
    return out


@dataclass
class _Round:
    """What the main process knows about the round in progress."""

    round: int
    live: bool  # the summaries reached the broker: matching, fetching and reporting may follow
    groups: dict[str, Group] = field(default_factory=dict)
    rejections: list[ReportEntry] = field(default_factory=list)  # bundles refused for their provenance


class BrokerPeers:
    """The broker as a learner's peers (graft/step.py `Peers`). Owns the connection: join with
    backoff, the backlog of unpublished rounds, and the degradation to plain GRPO."""

    def __init__(self, client: BrokerClient, node_id: str, privacy: str, manifest: Manifest,
                 broker: str, federation_id: str | None, match_wait_s: float, round_timeout_s: float,
                 fetch_timeout_s: float, rpc_timeout_s: float, reconnect_min_s: float,
                 reconnect_max_s: float, max_staleness_rounds: int = 16, node_secret: str = "") -> None:
        self.client = client
        self.node_id = node_id
        self.node_secret = node_secret  # node/secret.py: holds the node id at the broker
        self.privacy = Privacy(privacy)
        self.manifest = manifest
        self.broker = broker
        self.federation_id = federation_id
        self.match_wait_s, self.round_timeout_s, self.fetch_timeout_s = match_wait_s, round_timeout_s, fetch_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.max_staleness_rounds = max_staleness_rounds  # matched_only: the widest upload window taken
        self.connected = False
        self.backoff = Backoff(reconnect_min_s, reconnect_max_s)
        self.broker_manifest: Manifest | None = None
        # round -> summaries not (known to be) acknowledged by the broker, oldest first
        self.backlog: OrderedDict[int, list[SummaryRow]] = OrderedDict()
        self.report_backlog: OrderedDict[int, list[ReportEntry]] = OrderedDict()
        self.backlog_dropped = 0
        self.uploads_refused = 0  # upload requests refused under matched_only
        self.uploads_refused_by_broker = 0  # bundles uploaded that the broker refused
        self._round: _Round | None = None

    # ----- connection -----------------------------------------------------------------------------
    def ensure_joined(self, learner: GRPOTrainer) -> bool:
        if self.connected and not self.client.session_lost.is_set():
            return True
        if not self.backoff.ready():
            return False
        self.client.wait_ready(self.rpc_timeout_s)
        try:
            manifest, current, _ = self.client.join(learner.model_id, learner.tok_id, self.manifest,
                                                    self.privacy.value, learner.step, node_secret=self.node_secret)
        except PERMANENT as exc:
            raise ConfigError(f"the broker at {self.broker} refused node {self.node_id!r}: {exc}") from None
        except Unauthenticated as exc:
            # Join opens the session, so this is no lost session but the transport's identity:
            # the broker requires a client certificate and this node presented none (joining
            # again would be refused the same way, forever)
            raise ConfigError(f"the broker at {self.broker} refused node {self.node_id!r}: {exc}. Give the node its "
                              "client certificate and key (federation.tls_cert and federation.tls_key, with "
                              "federation.tls_ca)") from None
        except FederationError as exc:
            self._lost(exc)
            return False
        if self.federation_id and manifest.federation_id != self.federation_id:
            raise ConfigError(f"broker {self.broker} serves federation {manifest.federation_id!r}, "
                              f"not {self.federation_id!r}")
        if (self.privacy is Privacy.MATCHED_ONLY and manifest.mode == "async"
                and manifest.staleness_rounds > self.max_staleness_rounds):
            log.warning("node %s: the broker runs asynchronous rounds with staleness_rounds %d; this node uploads "
                        "(matched_only) groups at most %d rounds old (federation.max_staleness_rounds) and refuses "
                        "requests for older ones", self.node_id, manifest.staleness_rounds,
                        self.max_staleness_rounds)
        self.broker_manifest = manifest
        self.connected = True
        self.backoff.succeeded()
        log.info("node %s joined federation %s at round %d", self.node_id, manifest.federation_id, current)
        return True

    def _lost(self, exc: FederationError) -> None:
        self.connected = False
        delay = self.backoff.failed()
        if self.broker_manifest is None:  # never joined: Node.connect decides whether it trains alone meanwhile
            log.warning("cannot join the broker at %s yet (%s: %s); next attempt in %.1fs", self.broker,
                        exc.status, exc, delay)
        else:
            log.warning("exchange with broker %s failed (%s: %s); training plain GRPO, next attempt in %.1fs",
                        self.broker, exc.status, exc, delay)

    def leave(self) -> None:
        if self.connected:
            self.client.leave()

    # ----- the three phases (graft/step.py) -------------------------------------------------------
    def publish(self, learner: GRPOTrainer, data: StepData) -> dict[str, Any]:
        if not learner.is_main:
            return {}
        rnd = learner.step
        summaries = [summary_of(g, self.node_id, rnd, learner.step) for g in data.groups]
        self._round = _Round(round=rnd, live=False, groups={g.prompt.id: g for g in data.groups})
        if not self.ensure_joined(learner):
            self._defer(rnd, summaries)
            return self._skipped(connected=False)
        self.client.round = rnd
        try:
            self.client.publish(rnd, summaries)
        except (FailedPrecondition, InvalidArgument, NotFound) as exc:
            # the broker refused this round's summaries, not the connection: publishing them
            # again would be refused the same way, and joining again (as for a lost broker)
            # changes nothing. PERMISSION_DENIED (revoked) still goes the lost way: the next
            # Join says so and stops the node.
            log.warning("node %s: the broker refused round %d's summaries (%s: %s); this step trains without the "
                        "exchange", self.node_id, rnd, exc.status, exc)
            return self._skipped(connected=True, **{"federation/publish_refused": 1.0})
        except ResourceExhausted as exc:
            # a limit of this node's (its publish rate, or the summaries the broker holds of it):
            # the broker is there, so no new Join; the summaries wait in the backlog for the
            # limit to lift (the rate's next tokens, retention freeing stored summaries)
            self._defer(rnd, summaries)
            log.warning("node %s: the broker refused round %d's summaries for a limit (%s); this step trains without "
                        "the exchange and the summaries wait in the backlog", self.node_id, rnd, exc)
            return self._skipped(connected=True, **{"federation/publish_refused": 1.0})
        except FederationError as exc:
            self._defer(rnd, summaries)
            self._lost(exc)
            return self._skipped(connected=False)
        self._round.live = True
        if self.privacy is Privacy.SHARE_ALL:
            try:
                self.client.upload_missing((self._record(learner, g), rnd) for g in data.groups if 0 < g.k < g.n)
            except UPLOAD_REFUSALS as exc:
                # not a lost broker: it refused these bundles (e.g. it keeps the summaries this
                # node id published first for the round and these groups are others, the node
                # is quarantined as a source, or its bundle quota is used up); the groups
                # offered to it still come
                self._uploads_refused(rnd, exc, "" if not isinstance(exc, BundlesRefused) else (
                    f"; the groups offered to it still come. If it says they do not match their summaries, the "
                    f"broker holds other summaries of node {self.node_id!r} for this round, published before: by an "
                    f"earlier run under this node id (a new run needs a federation.node_id of its own, or a broker "
                    f"state of its own), or before a resume that sampled the round differently (only that round is "
                    f"affected)"))
            except FederationError as exc:
                self._round.live = False
                self._lost(exc)
        return {}

    def offers(self, learner: GRPOTrainer, groups: Sequence[Group]) -> Offers:
        got = self._offers(learner, groups) if learner.is_main else None
        return learner.from_main(got)

    def report(self, learner: GRPOTrainer, reports: Sequence[GroupReport]) -> dict[str, Any]:
        if not learner.is_main:
            return {}
        cur = self._round
        if cur is None or not cur.live:
            return {}
        metrics: dict[str, Any] = {}
        # s is exp(lbar_R - lbar_S): against a source claiming very low log-probs it exceeds
        # what the broker takes (MAX_REPORT_MEAN_S), which refused the whole report (every
        # other source's verdict with it); clamped, it still says "best"
        entries = cur.rejections + [
            ReportEntry(source=r.source, prompt_id=r.prompt_id,
                        mean_s=0.0 if math.isnan(r.mean_s) else min(max(r.mean_s, 0.0), MAX_REPORT_MEAN_S),
                        admitted_fraction=r.admitted_fraction, rejected=r.rejected) for r in reports]
        try:
            try:
                self.client.report(cur.round, entries)
            except (FailedPrecondition, InvalidArgument) as exc:
                # the broker refused the report itself (not the connection): train on what was
                # received and say so, rather than dropping the step's exchange
                log.warning("node %s: the broker refused the compatibility report of round %d: %s",
                            self.node_id, cur.round, exc)
                metrics["federation/report_refused"] = 1.0
            except FederationError:
                self._defer_report(cur.round, entries)
                raise
            metrics["federation/reports_resent"] = float(self._flush_reports())
            metrics["federation/backlog_published"] = float(self._flush_backlog(learner))
        except FederationError as exc:
            self._lost(exc)
        metrics["federation/backlog_rounds"] = float(len(self.backlog))
        metrics["federation/report_backlog_rounds"] = float(len(self.report_backlog))
        return metrics

    # ----- helpers ------------------------------------------------------------------------------
    def _offers(self, learner: GRPOTrainer, groups: Sequence[Group]) -> Offers:
        cur = self._round
        t0 = time.perf_counter()
        if cur is None or not cur.live:
            return Offers(metrics=self._skipped(connected=self.connected))
        try:
            deadline = time.monotonic() + self.round_timeout_s
            resp = self.client.get_matches(cur.round, self.match_wait_s)
            while not resp.ready and time.monotonic() < deadline:
                resp = self.client.get_matches(cur.round, min(self.match_wait_s, max(0.1, deadline - time.monotonic())))
            if not resp.ready:
                flushed = self._flush_backlog(learner)
                cur.live = False
                return Offers(metrics=self._skipped(connected=True, **{"federation/round_timeout": 1.0,
                                                                       "federation/backlog_published": float(flushed)}))
            uploads = self._serve_uploads(learner, resp, cur.groups)
            if any(not o.digest for o in resp.offers) and self.fetch_timeout_s > 0:
                # the broker answers as soon as every offered bundle is there (or the wait ends)
                resp = self.client.get_matches(cur.round, self.fetch_timeout_s, wait_for_bundles=True)
                uploads += self._serve_uploads(learner, resp, cur.groups)
            # only offers for this round's all-fail prompts, one each, whatever the broker sends
            offers, ignored = offers_to_fetch(resp.offers, {pid for pid, g in cur.groups.items() if g.k == 0})
            if ignored:
                log.warning("node %s: ignored %d offers of round %d for prompts it did not ask for (not all-fail "
                            "here, unknown, or offered twice)", self.node_id, ignored, cur.round)
            if self.fetch_timeout_s <= 0:
                # the node did not wait for bundles (fetch_timeout_s 0): one not uploaded yet
                # (a matched_only source uploads once its own answer asks it to) is not the
                # source failing to deliver, so it is neither fetched nor reported (s 0)
                offers = [o for o in offers if o.digest]
            fetched = fetch_offers(self.client, offers, n=self.manifest.n)
        except FederationError as exc:
            cur.live = False
            self._lost(exc)
            return Offers(metrics=self._skipped(connected=False, **{"time/federation": time.perf_counter() - t0}))
        cur.rejections = fetched.rejections
        metrics: dict[str, Any] = offer_metrics(groups, resp.candidates, resp.solved_by_peers, len(offers))
        metrics.update(fetched.metrics())
        metrics.update({"federation/connected": 1.0, "federation/skipped": 0.0,
                        "federation/offers": float(len(offers)), "federation/offers_ignored": float(ignored),
                        "federation/bad_bundles": float(fetched.bad),
                        "federation/uploads": float(uploads), "federation/uploads_refused": float(self.uploads_refused),
                        "federation/uploads_refused_by_broker": float(self.uploads_refused_by_broker),
                        "time/federation": time.perf_counter() - t0})
        return Offers(records=fetched.records, metrics=metrics)

    def _record(self, learner: GRPOTrainer, group: Group) -> GroupRecord:
        return group.to_record(learner.step, learner.model_id, learner.tok_id, learner.run_id)

    def _own_record(self, learner: GRPOTrainer, prompt_id: str, rnd: int,
                    current: dict[str, Group]) -> GroupRecord | None:
        if rnd == learner.step and prompt_id in current:
            return self._record(learner, current[prompt_id])
        if learner.store is not None:
            return learner.store.lookup([prompt_id], step=rnd).get(prompt_id)
        return None

    def _serve_uploads(self, learner: GRPOTrainer, resp: MatchResult, current: dict[str, Group]) -> int:
        if self.privacy is Privacy.SUMMARIES_ONLY or not resp.upload_requests:
            return 0
        requests = list(resp.upload_requests)
        if self.privacy is Privacy.MATCHED_ONLY:
            # upload only what this node can see was matched in the current window, whatever
            # the broker asks (docs/security.md)
            m = self.broker_manifest
            # the broker's window, never wider than this node takes (a hostile broker could
            # otherwise ask for every round the node ever recorded)
            window = min(m.staleness_rounds, self.max_staleness_rounds) if m is not None and m.mode == "async" else 0
            informative = {learner.step: {pid for pid, g in current.items() if 0 < g.k < g.n}}
            if window and learner.store is not None:
                asked: dict[int, list[str]] = {}
                for p, r in requests:
                    if learner.step - window <= r < learner.step:
                        asked.setdefault(r, []).append(p)
                for rnd, pids in sorted(asked.items()):
                    found = learner.store.lookup(pids, step=rnd, run_id=learner.run_id)
                    informative[rnd] = {pid for pid, rec in found.items() if rec.kind == "informative"}
            requests, refused = uploads_to_serve(requests, learner.step, window, informative)
            if refused:
                log.warning("node %s: refused %d upload requests outside the current window or for groups it "
                            "never published as informative (matched_only)", self.node_id, len(refused))
                self.uploads_refused += len(refused)
        # whatever the privacy: only informative groups (the only ones ever matched as a
        # source), each once, of rounds the node has reached, and no more than one HasBundles
        # call may name; a hostile broker could otherwise ask for the node's all-fail and
        # all-pass groups, or for millions of lookups
        records, seen, skipped = [], set(), 0
        for prompt_id, rnd in requests:
            if (prompt_id, rnd) in seen or rnd > learner.step or len(seen) >= MAX_DIGESTS_PER_CALL:
                skipped += 1
                continue
            seen.add((prompt_id, rnd))
            rec = self._own_record(learner, prompt_id, rnd, current)
            if rec is not None and rec.kind == "informative":
                records.append((rec, rnd))
            elif rec is not None:
                skipped += 1
        if skipped:
            log.warning("node %s: refused %d upload requests for groups that are not informative, repeated, of a "
                        "round it has not reached, or beyond %d in one answer", self.node_id, skipped,
                        MAX_DIGESTS_PER_CALL)
            self.uploads_refused += skipped
        try:
            return self.client.upload_missing(records)
        except UPLOAD_REFUSALS as exc:
            # refusals of these bundles, not a lost broker: the offers to this node still come
            self._uploads_refused(sorted({r for _, r in records}), exc)  # async: of several rounds
            return getattr(exc, "sent", 0)

    def _uploads_refused(self, rounds: int | Sequence[int], exc: FederationError, then: str = "") -> None:
        """Count and say why the broker refused bundles this node uploaded (some, each for
        itself: BundlesRefused; or all: PERMISSION_DENIED, say while it is quarantined, or
        RESOURCE_EXHAUSTED, its bundle quota used up) of the round, or rounds, they belong to;
        `then`: what the node does about it, added to the warning."""
        self.uploads_refused_by_broker += getattr(exc, "refused", 1)
        if isinstance(exc, PermissionDenied):
            then = then or "; peers are not offered its groups meanwhile, but it still receives theirs"
        rounds = [rounds] if isinstance(rounds, int) else list(rounds)
        which = (f"round {rounds[0]}'s" if len(rounds) == 1 else f"rounds {', '.join(map(str, rounds))}'" if rounds
                 else "its")
        log.warning("node %s: the broker refused %s bundles (%s)%s", self.node_id, which, exc, then)

    def _skipped(self, connected: bool, **more: float) -> dict[str, Any]:
        """The metrics of a step that trained without the exchange: whether the broker was
        there, the rounds waiting in the backlog, and `more`."""
        return {"federation/connected": float(connected), "federation/skipped": 1.0, **more,
                "federation/backlog_rounds": float(len(self.backlog))}

    def _defer(self, rnd: int, summaries: list[SummaryRow]) -> None:
        """Keep a round's summaries for publishing once the broker is back."""
        self.backlog_dropped += self._keep(self.backlog, rnd, summaries, MAX_BACKLOG_ROUNDS, "summaries")

    def _defer_report(self, rnd: int, entries: list[ReportEntry]) -> None:
        """Keep a round's compatibility report, which the broker could not be reached for, for
        sending once it is back (the broker counts a group's verdict once, so a report that
        did arrive before its answer was lost changes nothing when sent again)."""
        if entries:
            self._keep(self.report_backlog, rnd, entries, MAX_REPORT_BACKLOG_ROUNDS, "compatibility report")

    def _keep(self, backlog: OrderedDict, rnd: int, item: Any, limit: int, what: str) -> int:
        """Put `item` in `backlog` under round `rnd`, its oldest rounds dropped (with a warning)
        beyond `limit`; returns how many were dropped. `_drain` sends them."""
        backlog[rnd] = item
        dropped = 0
        while len(backlog) > limit:
            old, _ = backlog.popitem(last=False)
            dropped += 1
            log.warning("node %s: %s backlog over %d rounds; round %d's %s will not reach the broker", self.node_id,
                        what, limit, old, what)
        return dropped

    def _flush_reports(self) -> int:
        """Send the oldest kept reports (at most BACKLOG_ROUNDS_PER_STEP), as `_drain` does;
        a refusal (the round pruned at the broker, say) drops that round's report. Returns
        the reports sent."""
        return self._drain(self.report_backlog, lambda rnd, entries: self.client.report(rnd, entries),
                           (FailedPrecondition, InvalidArgument), "compatibility report kept")

    def _flush_backlog(self, learner: GRPOTrainer) -> int:
        """Publish the oldest backlog rounds (at most BACKLOG_ROUNDS_PER_STEP), as `_drain`
        does; with share_all and recorded groups, their informative bundles too. Returns the
        rounds published."""
        def upload(rnd: int, rows: list[SummaryRow]) -> None:
            store = learner.store
            if self.privacy is Privacy.SHARE_ALL and store is not None:
                informative = [r.prompt_id for r in rows if 0 < r.k < r.n]
                recs = store.lookup(informative, step=rnd, run_id=learner.run_id)
                try:
                    self.client.upload_missing((rec, rnd) for rec in recs.values())
                except UPLOAD_REFUSALS as exc:
                    self._uploads_refused(rnd, exc)
                except (*PERMANENT, ResourceExhausted) as exc:
                    log.warning("node %s: bundles of backlog round %d refused (%s: %s)", self.node_id, rnd,
                                exc.status, exc)
        return self._drain(self.backlog, lambda rnd, rows: self.client.publish(rnd, rows), PERMANENT,
                           "summaries from the backlog", upload)

    def _drain(self, backlog: OrderedDict, send: Any, refused: tuple, what: str, sent: Any = None) -> int:
        """Send the oldest rounds of `backlog` (at most BACKLOG_ROUNDS_PER_STEP) with
        `send(round, item)`, then `sent(round, item)`. Rate limited (RESOURCE_EXHAUSTED): the
        rest waits for the next step. Another transient failure leaves the rest for the next
        step and is raised (a lost connection). A refusal in `refused` drops that round with
        a warning: it would be refused again. Returns the rounds sent."""
        done = 0
        while backlog and done < BACKLOG_ROUNDS_PER_STEP:
            rnd, item = next(iter(backlog.items()))
            try:
                send(rnd, item)
            except ResourceExhausted:
                break
            except refused as exc:
                log.warning("node %s: the broker refused round %d's %s (%s: %s); dropping it", self.node_id, rnd,
                            what, exc.status, exc)
                backlog.pop(rnd, None)
                continue
            backlog.pop(rnd, None)
            done += 1
            if sent is not None:
                sent(rnd, item)
        return done
