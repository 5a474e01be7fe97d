"""A federation node: the GRAFT trainer with the broker as its exchange partner.

Per step: sample -> verify -> publish summaries -> (upload bundles) -> receive matches ->
fetch peer groups -> re-verify, re-tokenise, score compatibility (trainer/graft.py) ->
report compatibility -> optimise peer-last -> checkpoint. When the broker is unreachable
or slow, the step goes on as plain GRPO and the node reconnects with backoff and jitter;
the summaries of the steps it could not publish wait in a backlog and are published once
it is back (idempotent: a publish whose answer was lost is counted as a duplicate, never
stored twice), so the broker ends up with every group the node sampled.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from graft_fed.configbase import load_config, require
from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.errors import ConfigError
from graft_fed.federation.errors import PERMANENT, FailedPrecondition, FederationError, InvalidArgument, \
    ResourceExhausted
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version
from graft_fed.federation.messages import MatchResult, Offer, Privacy, ReportEntry, SummaryRow, summarise
from graft_fed.federation.signing import ProvenanceError
from graft_fed.node.client import Backoff, BrokerClient
from graft_fed.trainer.config import TrainConfig
from graft_fed.trainer.graft import offer_metrics, receive, to_record
from graft_fed.trainer.grpo import GRPOTrainer, Group, StepData

log = logging.getLogger("graft_fed.node")

#: Unpublished rounds kept for publishing later (the oldest go first beyond this).
MAX_BACKLOG_ROUNDS = 1024
#: Backlog rounds published per step once the broker is back (bounded so a long outage
#: does not turn one step into a burst the broker's rate limit refuses).
BACKLOG_ROUNDS_PER_STEP = 16


@dataclass(frozen=True)
class FederationSection:
    """How this node takes part in a federation."""

    #: The broker's address, HOST:PORT.
    broker: str = "127.0.0.1:50551"
    #: This node's name in the federation (default: run.name).
    node_id: str = ""
    #: What may leave the site: "share_all" (every informative group's trajectories go to
    #: the broker, so peers joining later can learn from them), "matched_only" (only groups
    #: a receiver was matched to), "summaries_only" (no trajectories ever; still receives).
    privacy: str = "share_all"
    #: Refuse a broker whose federation id differs (null = accept any).
    federation_id: str | None = None
    #: The federation CA (PEM) that signed the broker's certificate: turns TLS on.
    tls_ca: str | None = None
    #: This node's certificate and key for mutual TLS (its identity is the certificate's name).
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Refuse peer bundles whose producer's signature does not check out against tls_ca (the
    #: certificate must be the CA's and name the source node; docs/security.md). null = yes
    #: when this node uses mutual TLS (then it also signs its own bundles); false accepts
    #: unsigned bundles (logged once, counted as federation/unsigned_bundles) but still
    #: refuses a signature that fails.
    require_signatures: bool | None = None
    #: The federation CA's list of revoked certificates (the revoked.json `graft-fed certs
    #: revoke` writes, copied here as the CA is): a peer bundle signed with a listed
    #: certificate is refused and reported, even one signed before the revocation. Re-read
    #: when the file changes; a file that turns bad keeps the last good list. Needs tls_ca.
    revoked_certs: str | None = None
    #: Allow plaintext gRPC to a non-loopback broker (logged as a warning at every start).
    insecure: bool = False
    #: Longest single long-poll for matches, seconds.
    match_wait_s: float = 10.0
    #: Give up the exchange of one step after this long and train plain GRPO.
    round_timeout_s: float = 180.0
    #: Wait at most this long for matched sources to upload their bundles.
    fetch_timeout_s: float = 30.0
    #: Deadline of ordinary RPCs, seconds.
    rpc_timeout_s: float = 10.0
    #: Largest gRPC message, MiB (keep equal to the broker's).
    max_message_mib: int = 16
    #: Bundle chunk size, KiB (at most the broker's).
    chunk_kib: int = 1024
    #: Reconnection backoff: first delay and cap, seconds (full jitter).
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 60.0

    def __post_init__(self) -> None:
        require(":" in self.broker, f"federation.broker must be HOST:PORT, got {self.broker!r}")
        require(self.privacy in Privacy.names(), f"federation.privacy must be one of {', '.join(Privacy.names())}")
        require(self.match_wait_s > 0 and self.round_timeout_s > 0 and self.fetch_timeout_s >= 0,
                "federation timeouts must be positive")
        require(0 < self.reconnect_min_s <= self.reconnect_max_s, "need 0 < reconnect_min_s <= reconnect_max_s")
        require((self.tls_cert is None) == (self.tls_key is None), "federation: give both tls_cert and tls_key")
        require(self.tls_cert is None or self.tls_ca is not None,
                "federation.tls_cert needs federation.tls_ca (the CA that signed the broker's certificate)")
        require(not self.require_signatures or self.tls_ca is not None,
                "federation.require_signatures needs federation.tls_ca (the federation CA) to check signatures")
        require(self.revoked_certs is None or self.tls_ca is not None,
                "federation.revoked_certs needs federation.tls_ca: revocations are checked on bundle signatures")


@dataclass(frozen=True)
class NodeConfig(TrainConfig):
    """A node: a training run plus its federation section."""

    federation: FederationSection = field(default_factory=FederationSection)

    def train_config(self) -> TrainConfig:
        return TrainConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)})

    @property
    def node_id(self) -> str:
        return self.federation.node_id or self.run.name


def load_node_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> NodeConfig:
    return load_config(NodeConfig, path, overrides, "node config")


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
    #: Groups refused for their provenance, reported to the broker as rejected so that its
    #: quarantine sees a source whose bundles do not check out.
    rejections: list[ReportEntry] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"federation/bad_signatures": float(self.bad_signatures),
                "federation/unsigned_bundles": float(self.unsigned)}


def fetch_offers(client: BrokerClient, offers: Sequence[Offer]) -> FetchedOffers:
    """Download and check every offered bundle: digest, record, and who produced it (the
    signature must be the offered source's, see graft_fed/federation/signing.py). A bundle
    that fails is skipped, never trained on; a failed signature is also reported as a
    rejected group of that source."""
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
            out.rejections.append(ReportEntry(source=o.source_node, prompt_id=o.prompt_id, mean_s=0.0,
                                              admitted_fraction=0.0, rejected=True))
            continue
        except RecordError as exc:
            log.warning("bundle from %s rejected: %s", o.source_node, exc)
            out.bad += 1
            continue
        if got.record.prompt_id != o.prompt_id:
            out.bad += 1
            continue
        out.unsigned += not got.signer
        # Name the source by its node id, so reports and metrics key on it.
        out.records[o.prompt_id] = dataclasses.replace(got.record, model_id=o.source_node)
    return out


class Node:
    def __init__(self, cfg: NodeConfig, resume: str | None = None, quiet: bool = False) -> None:
        self.cfg = cfg
        self.quiet = quiet
        self.trainer = GRPOTrainer(cfg.train_config(), resume=resume, quiet=True)
        f = cfg.federation
        self.client = BrokerClient(f.broker, cfg.node_id, max_message_mib=f.max_message_mib,
                                   rpc_timeout_s=f.rpc_timeout_s, chunk_kib=f.chunk_kib, tls_ca=f.tls_ca,
                                   tls_cert=f.tls_cert, tls_key=f.tls_key, insecure=f.insecure,
                                   require_signatures=f.require_signatures, revoked_certs=f.revoked_certs)
        t = self.trainer
        self.manifest = Manifest(
            federation_id=f.federation_id or "", protocol_version=PROTOCOL_VERSION,
            dataset_id=t.schedule.prompts[0].dataset, dataset_hash=dataset_hash(t.schedule.prompts),
            seed=cfg.run.seed, n=cfg.rollout.n, prompts_per_round=cfg.algorithm.prompts_per_step,
            mode="", verifier_name=cfg.verifier.name, verifier_version=verifier_version(cfg.verifier),
            staleness_rounds=0)
        self.connected = False
        self.backoff = Backoff(f.reconnect_min_s, f.reconnect_max_s)
        self.broker_manifest: Manifest | None = None
        # round -> summaries not (known to be) acknowledged by the broker, oldest first
        self.backlog: OrderedDict[int, list[SummaryRow]] = OrderedDict()
        self.backlog_dropped = 0

    def close(self, leave: bool = True) -> None:
        if leave and self.connected:
            self.client.leave()
        self.client.close()
        self.trainer.close()

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- connection -----------------------------------------------------------------------------
    def ensure_joined(self) -> bool:
        if self.connected and not self.client.session_lost.is_set():
            return True
        if not self.backoff.ready():
            return False
        self.client.wait_ready(self.cfg.federation.rpc_timeout_s)
        try:
            manifest, current, _ = self.client.join(self.trainer.model_id, self.trainer.tok_id, self.manifest,
                                                    self.cfg.federation.privacy, self.trainer.step)
        except PERMANENT as exc:
            raise ConfigError(f"the broker at {self.cfg.federation.broker} refused node "
                              f"{self.cfg.node_id!r}: {exc}") from None
        except FederationError as exc:
            self._lost(exc)
            return False
        pin = self.cfg.federation.federation_id
        if pin and manifest.federation_id != pin:
            raise ConfigError(f"broker {self.cfg.federation.broker} serves federation {manifest.federation_id!r}, "
                              f"not {pin!r}")
        self.broker_manifest = manifest
        self.connected = True
        self.backoff.succeeded()
        log.info("node %s joined federation %s at round %d", self.cfg.node_id, manifest.federation_id, current)
        return True

    def _lost(self, exc: FederationError) -> None:
        self.connected = False
        delay = self.backoff.failed()
        log.warning("exchange with broker %s failed (%s: %s); training plain GRPO, next attempt in %.1fs",
                    self.cfg.federation.broker, exc.status, exc, delay)

    # ----- one step -------------------------------------------------------------------------------
    def _record(self, group: Group) -> GroupRecord:
        t = self.trainer
        return to_record(group, t.step, t.model_id, t.tok_id, t.run_id)

    def _own_record(self, prompt_id: str, round: int, current: dict[str, Group]) -> GroupRecord | None:
        if round == self.trainer.step and prompt_id in current:
            return self._record(current[prompt_id])
        if self.trainer.store is not None:
            return self.trainer.store.lookup([prompt_id], step=round).get(prompt_id)
        return None

    def exchange(self, data: StepData) -> tuple[list[Group], dict[str, Any]]:
        """The federation part of a step; any broker failure leaves the own groups untouched."""
        t0 = time.perf_counter()
        groups = data.groups
        round = self.trainer.step
        summaries = [summary_of(g, self.cfg.node_id, round, self.trainer.step) for g in groups]
        metrics: dict[str, Any] = {"federation/connected": 0.0, "federation/skipped": 1.0}
        if not self.ensure_joined():
            self._defer(round, summaries)
            metrics["federation/backlog_rounds"] = float(len(self.backlog))
            return groups, metrics
        f = self.cfg.federation
        self.client.round = round
        by_prompt = {g.prompt.id: g for g in groups}
        published = False
        try:
            self.client.publish(round, summaries)
            published = True
            if f.privacy == "share_all":
                self.client.upload_missing((self._record(g), round) for g in groups if 0 < g.k < g.n)
            deadline = time.monotonic() + f.round_timeout_s
            resp = self.client.get_matches(round, f.match_wait_s)
            while not resp.ready and time.monotonic() < deadline:
                resp = self.client.get_matches(round, min(f.match_wait_s, max(0.1, deadline - time.monotonic())))
            if not resp.ready:
                metrics["federation/round_timeout"] = 1.0
                metrics["federation/backlog_published"] = float(self._flush_backlog())
                metrics["federation/backlog_rounds"] = float(len(self.backlog))
                metrics["federation/connected"] = 1.0
                return groups, metrics
            uploads_done = self._serve_uploads(resp, by_prompt)
            fetch_deadline = time.monotonic() + f.fetch_timeout_s
            while any(not o.digest for o in resp.offers) and time.monotonic() < fetch_deadline:
                time.sleep(0.05)
                resp = self.client.get_matches(round, 0.5)
                uploads_done += self._serve_uploads(resp, by_prompt)
            fetched = fetch_offers(self.client, resp.offers)
            offers, bad = fetched.records, fetched.bad
            metrics.update(fetched.metrics())
            result = receive(self.trainer, groups, offers)
            metrics.update(offer_metrics(groups, resp.candidates, resp.solved_by_peers, len(resp.offers)))
            try:
                self.client.report(round, fetched.rejections + [
                    ReportEntry(source=r.source, prompt_id=r.prompt_id,
                                mean_s=0.0 if math.isnan(r.mean_s) else r.mean_s,
                                admitted_fraction=r.admitted_fraction, rejected=r.rejected) for r in result.reports])
            except (FailedPrecondition, InvalidArgument) as exc:
                # the broker refused the report itself (not the connection): train on what was
                # received and say so, rather than dropping the step's exchange
                log.warning("node %s: the broker refused the compatibility report of round %d: %s",
                            self.cfg.node_id, round, exc)
                metrics["federation/report_refused"] = 1.0
            flushed = self._flush_backlog()
        except FederationError as exc:
            if not published:
                self._defer(round, summaries)
            self._lost(exc)
            metrics["federation/backlog_rounds"] = float(len(self.backlog))
            metrics["time/federation"] = time.perf_counter() - t0
            return groups, metrics
        metrics.update(result.metrics)
        metrics.update({"federation/connected": 1.0, "federation/skipped": 0.0,
                        "federation/backlog_published": float(flushed),
                        "federation/backlog_rounds": float(len(self.backlog)),
                        "federation/offers": float(len(resp.offers)),
                        "federation/bad_bundles": float(bad), "federation/uploads": float(uploads_done),
                        "time/federation": time.perf_counter() - t0})
        return result.groups, metrics

    def _defer(self, round: int, summaries: list[SummaryRow]) -> None:
        """Keep a round's summaries for publishing once the broker is back."""
        self.backlog[round] = summaries
        while len(self.backlog) > MAX_BACKLOG_ROUNDS:
            old, _ = self.backlog.popitem(last=False)
            self.backlog_dropped += 1
            log.warning("node %s: backlog over %d rounds; round %d's summaries will not reach the broker",
                        self.cfg.node_id, MAX_BACKLOG_ROUNDS, old)

    def _flush_backlog(self) -> int:
        """Publish the oldest backlog rounds (at most BACKLOG_ROUNDS_PER_STEP); with share_all
        and recorded groups, their informative bundles too. A transient failure leaves the
        rest for the next step (and is raised as a lost connection); a permanent refusal
        drops the round with a warning. Returns the rounds published."""
        done = 0
        while self.backlog and done < BACKLOG_ROUNDS_PER_STEP:
            rnd, rows = next(iter(self.backlog.items()))
            try:
                self.client.publish(rnd, rows)
            except ResourceExhausted:
                break  # rate limited: the rest waits for the next step
            except PERMANENT as exc:
                log.warning("node %s: the broker refused round %d's summaries from the backlog (%s: %s); "
                            "dropping them", self.cfg.node_id, rnd, exc.status, exc)
                self.backlog.pop(rnd, None)
                continue
            self.backlog.pop(rnd, None)
            done += 1
            store = self.trainer.store
            if self.cfg.federation.privacy == "share_all" and store is not None:
                informative = [r.prompt_id for r in rows if 0 < r.k < r.n]
                recs = store.lookup(informative, step=rnd, run_id=self.trainer.run_id)
                try:
                    self.client.upload_missing((rec, rnd) for rec in recs.values())
                except (*PERMANENT, ResourceExhausted) as exc:
                    log.warning("node %s: bundles of backlog round %d refused (%s: %s)", self.cfg.node_id, rnd,
                                exc.status, exc)
        return done

    def _serve_uploads(self, resp: MatchResult, current: dict[str, Group]) -> int:
        if self.cfg.federation.privacy == "summaries_only" or not resp.upload_requests:
            return 0
        records = []
        for prompt_id, rnd in resp.upload_requests:
            rec = self._own_record(prompt_id, rnd, current)
            if rec is not None:
                records.append((rec, rnd))
        return self.client.upload_missing(records)

    def train_step(self) -> dict[str, Any]:
        t = self.trainer
        t0 = time.perf_counter()
        data = t.collect()
        t.record(data.groups)
        groups, extra = self.exchange(data)
        return t.finish_step(data, groups, extra, t0)

    def train(self, evaluate_before_after: bool = True) -> dict[str, Any]:
        self.ensure_joined()  # join (and start heartbeats) before the first, long, rollout
        self.trainer.quiet = self.quiet
        return self.trainer.train(evaluate_before_after, step_fn=self.train_step)
