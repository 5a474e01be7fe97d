"""Broker configuration (`graft-fed broker --config broker.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import math

from graft_fed.configbase import load_config, require, require_address
from graft_fed.core.advantages import ADVANTAGES, PAPER_ADVANTAGE
from graft_fed.core.records import MAX_GROUP_N
from graft_fed.data.config import DataConfig
from graft_fed.federation.limits import MAX_PER_ROUND_FACTOR
from graft_fed.rewards.config import VerifierConfig


@dataclass(frozen=True)
class BrokerConfig:
    """One federation's broker: its manifest, its limits, where it keeps state."""

    #: gRPC listen address. Off loopback the broker needs TLS (tls_cert/tls_key) or `insecure`.
    listen: str = "127.0.0.1:50551"
    #: The broker's TLS certificate and key (PEM), e.g. from `graft-fed certs issue`.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: The federation CA: set it for mutual TLS, where each node's identity is the common
    #: name of its certificate (and a node can act only as itself).
    client_ca: str | None = None
    #: Allow plaintext gRPC on a non-loopback address (logged as a warning at every start).
    insecure: bool = False
    #: The operator's allowlist file (`graft-fed broker nodes add|list|revoke`); null = every
    #: node (with a valid certificate, under mutual TLS) may join.
    allowlist: str | None = None
    #: HTTP address of /metrics (Prometheus text) and /healthz; "" = off.
    http: str = "127.0.0.1:9464"
    #: State database: a SQLite file (WAL; restored on restart) or ":memory:" (tests).
    db: str = "runs/broker/broker.sqlite"
    #: Name of the federation (nodes may pin it).
    federation_id: str = "graft-fed"
    #: The shared training prompt set; its id and content hash go into the manifest.
    data: DataConfig = field(default_factory=DataConfig)
    #: The verifier every node must run (name and version go into the manifest).
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    #: Federation seed: round r's prompt batch is a function of (dataset, seed, r).
    seed: int = 0
    #: Responses per prompt every node samples.
    n: int = 8
    #: Prompts per round (each node's prompts_per_step).
    prompts_per_round: int = 32
    #: How every node normalises its group advantages, "<algorithm.scale_rewards>/<algorithm.std>"
    #: of the nodes' configs: group/sample (the paper), group/population, none/sample or
    #: none/population. Receivers train on the source's advantages, so a node that computes
    #: them otherwise is refused at join.
    advantage: str = PAPER_ADVANTAGE
    #: "sync": a round is matched when every online node has published or the deadline
    #: passes; "async": a node is matched at once against the freshest groups within
    #: `staleness_rounds`.
    mode: str = "sync"
    #: Asynchronous mode: how many rounds old a source group may be.
    staleness_rounds: int = 4
    #: Synchronous mode: seconds after a round's first publish when it is matched without
    #: the nodes that have not published (slow nodes do not stall the federation); nodes
    #: that publish a round after it was matched wait for each other at most this long
    #: from the first one's question.
    round_deadline_s: float = 120.0
    #: Synchronous mode: a round also waits (until its deadline) for at least this many
    #: nodes to publish, so nodes that start a little later still join the first rounds.
    min_nodes: int = 1
    #: Interval nodes are told to heartbeat at.
    heartbeat_interval_s: float = 2.0
    #: A node silent for this long is offline (not waited for in synchronous rounds).
    offline_after_s: float = 15.0
    #: The most heartbeats per second the whole federation is asked to send: beyond
    #: max_heartbeats_per_s x heartbeat_interval_s nodes, the interval nodes are told (in Join
    #: and in every heartbeat answer) and offline_after_s grow in proportion (1,000 nodes
    #: at the defaults: every 10 s, offline after 75 s). 0 = the interval stays fixed.
    max_heartbeats_per_s: float = 100.0
    #: Balancing between sources and receivers: "pairwise" (the default: for two nodes
    #: exactly the paper's rule; for more, each pair balanced the same way, so exchange
    #: stays mutual and no node becomes a pure donor), "per_receiver_cap" (every
    #: candidate, at most `per_receiver_cap` groups per receiver and round) or "none".
    balance: str = "pairwise"
    #: The cap of the per_receiver_cap policy.
    per_receiver_cap: int = 8
    #: Quarantine a source once this share of the groups receivers received from it was
    #: rejected by their re-verification (its claimed rewards were wrong): it is no longer
    #: matched as a source and its uploads are refused. Groups a receiver reports undelivered
    #: do not count (a liar withholding groups would dilute its rate). The operator lifts it
    #: with `graft-fed broker nodes release` (needs `allowlist`). 1.0 = never.
    quarantine_rejection_rate: float = 0.5
    #: ... once receivers reported on at least this many of its groups they received.
    quarantine_min_reports: int = 8
    #: Quarantine needs rejections from at least this many distinct receivers, each
    #: receiver's rejection rate weighing the same however many groups it reported (one
    #: receiver, however many groups it was given, cannot quarantine a source on its own).
    #: Set 1 for a federation of two nodes.
    quarantine_min_receivers: int = 2
    #: Before counting a rejection, the broker re-verifies the group itself when it holds
    #: the bundle (with the federation's verifier against the dataset's answer): a rejection
    #: of a group whose claimed rewards do verify is not counted (it is a false accusation;
    #: counted as graft_fed_disputed_rejections_total).
    recheck_rejections: bool = True
    #: Per-node rate limit on publishes, per second (a token bucket with a burst of 4x). 0 = off.
    max_publishes_per_s: float = 20.0
    #: Per-node rate limit on all requests, per second (a token bucket with a burst of 4x),
    #: under mutual TLS (keyed on the certificate's name). 0 = off. A graft-fed node sends a
    #: heartbeat every `heartbeat_interval_s` and a few dozen calls per step.
    max_requests_per_s: float = 100.0
    #: Per-node storage quota for uploaded bundles, MiB (0 = off): the bundles a node
    #: uploaded that the broker still holds (retention, `max_bundle_gib`, frees it). Past it
    #: the node's uploads are refused (RESOURCE_EXHAUSTED); it still receives its peers'.
    #: The broker logs a warning when a node passes 80% of it; status and /metrics show
    #: what each node holds.
    max_node_bundle_mib: int = 1024
    #: Per-node quota of stored summaries (0 = off): a publish that would take the
    #: summaries the broker holds of one node past it is refused (RESOURCE_EXHAUSTED) until
    #: retention (`keep_rounds`) drops some. What bounds the state of a node that publishes
    #: round after round far ahead of the others. An honest node adds prompts_per_round a
    #: round, so with retention off (keep_rounds null, the default) it is refused after
    #: max_node_summaries / prompts_per_round rounds (10,000,000: 312,500 rounds of 32
    #: prompts, 2,441 of 4,096; the broker says so at start): set keep_rounds for longer runs.
    #: A warning is logged when a node passes 80% of it; status and /metrics show what each
    #: node holds.
    max_node_summaries: int = 10_000_000
    #: Replay protection: every state-changing request carries a request id and the node's
    #: send time. The broker refuses a request id it has already applied for that node
    #: (ALREADY_EXISTS) and a send time more than this many seconds from its own clock
    #: (FAILED_PRECONDITION: a stale request, or the node's clock is off; use NTP).
    replay_window_s: float = 300.0
    #: Refuse state-changing requests that carry no request id (INVALID_ARGUMENT). graft-fed
    #: nodes always send one; false admits hand-written or older clients, unprotected.
    require_request_ids: bool = True
    #: Worker threads serving RPCs, all started with the broker (about 128 KiB each while
    #: parked); the thread that went idle last takes the next call, so a steady load keeps
    #: the ones it needs warm and the others parked (broker/workers.py).
    max_workers: int = 128
    #: Serve gRPC from a second process (the front, broker/front.py): it takes every call
    #: (TLS included) and hands it to the broker over a private Unix socket, so the broker's
    #: interpreter no longer spends half of a busy round in grpcio's per-call work. For large
    #: federations on a machine with a core to spare (at 1,000 nodes x 128 prompts on 2
    #: cores, match p99 ~35% lower: docs/performance.md). If the front exits, the broker stops.
    front_process: bool = False
    #: glibc malloc arenas of the `graft-fed broker` process (0: glibc's default, 8 per
    #: core; the environment's MALLOC_ARENA_MAX wins when set). With hundreds of worker
    #: threads each arena keeps its own peak of freed memory: under 256 nodes x 256 prompts
    #: RSS grew 16.5 MiB/min with the default and 5.9 with 2 (docs/performance.md, issue 13);
    #: with 1 and `malloc_tcache: false`, every thread reuses the same freed memory.
    malloc_arena_max: int = 1
    #: Keep glibc's per-thread caches of freed blocks (tcache) in the `graft-fed broker`
    #: process. Off by default: with hundreds of threads each keeps freed blocks for itself
    #: and the heap took about half an hour to settle. Off, with one arena, under 256 nodes x
    #: 256 prompts the RSS after a 5-minute warm-up rose 0.26 +- 1.24 MiB/min at about 187
    #: MiB, against 2.2-3.3 at about 235 with both on (docs/performance.md, issue 13,
    #: "forty-third pass"). glibc reads it only from the environment at start, so the
    #: command re-executes itself once (same pid) with
    #: GLIBC_TUNABLES=glibc.malloc.tcache_count=0 added; a GLIBC_TUNABLES that sets
    #: tcache_count already is left alone.
    malloc_tcache: bool = False
    #: Let protobuf's upb extension call malloc_trim(0) on every 10,000th block its message
    #: arenas free. Off by default: in the broker that handed 15-25 MiB of the heap's free
    #: pages back to the kernel every 10-25 s, for the next round to fault in again, so
    #: RSS sawed by that much (docs/performance.md, issue 13, "forty-fourth pass"); upstream
    #: protobuf has since compiled the call out. Off, the extension's entry for it is pointed
    #: at a function that returns at once (broker/heap.py); `malloc_trim_s` still trims. Off
    #: costs heartbeats nothing measurable: under 64 x 1,024 over mutual TLS, three alternating
    #: pairs of one tree gave p99 53.5-57.2 ms off and 48.3-59.6 on ("forty-fifth pass").
    protobuf_malloc_trim: bool = False
    #: Seconds between the housekeeping's malloc_trim(0) (glibc), which hands the free pages
    #: inside the C heap back to the kernel (0: never). Freed memory otherwise stays in the
    #: process, counted in its RSS, until a later allocation reuses it: set it (e.g. 60) where
    #: a burst (a large bundle, a big round) leaves a high-water mark to give back. Off by
    #: default: under a steady 256 x 256 load, trimming every 60 s or every 10 s did not change RSS
    #: (docs/performance.md, issue 13, "eleventh pass" and "thirty-first pass").
    malloc_trim_s: float = 0.0
    #: GetMatches long-polls allowed to wait at once, all nodes together (RESOURCE_EXHAUSTED
    #: beyond; each node may have at most 2 waiting). Keep it below max_workers so that
    #: heartbeats and the other short calls always find a thread, and at or above the
    #: number of nodes (each graft-fed node has one waiting at a time). It also sizes gRPC
    #: core's queue of calls that arrived before the server took them: 4 per long-poll. With
    #: `front_process`, a waiting long-poll holds no thread (parked until its round or its
    #: bundles wake it): the long-polls' lane then has max_workers - max_long_polls threads
    #: (at least 8), as the other calls' lanes, which only build answers.
    max_long_polls: int = 96
    #: Calls doing heavy CPU work at once (decoding, validating and writing a publish;
    #: matching a round and building a GetMatches answer); the others wait for a slot,
    #: blocked. Python runs one thread at a time, so dozens of such calls at once only make
    #: every call, heartbeats included, wait its turn among them for the interpreter.
    work_slots: int = 2
    #: Milliseconds a thread runs Python before the interpreter passes to another that wants
    #: it (sys.setswitchinterval; 0 keeps Python's 5 ms), set where `graft-fed broker`
    #: starts. A call that waited on the network (a heartbeat arriving, grpcio's serving
    #: thread taking it) waits up to that long at each such step while a report or a publish
    #: is being checked: with 64 nodes x 4,096 prompts reporting, heartbeat p99 was 250-335 ms
    #: at 5 ms and 51-69 ms at 0.5, ingest and matching unchanged (docs/performance.md,
    #: thirty-eighth pass).
    switch_interval_ms: float = 0.5
    #: Publishes decoded, checked and stored by one thread in batches (one commit each,
    #: broker/publishqueue.py) while the threads that received them wait. Faster ingest and
    #: rounds at every size measured (64 x 256 to 64 x 4,096, 256 x 256, 1,000 x 128) and
    #: faster heartbeats where nodes train between rounds. Its cost: under a load that never
    #: lets the broker rest (every node publishing again the moment its matches are ready),
    #: that thread holds the interpreter for whole batches and heartbeats wait longer (at
    #: 256 x 256, p99 about 380 ms against 51 ms with it off). Off: each receiving thread
    #: decodes, checks and stores its own publish (docs/performance.md, twenty-fifth and
    #: twenty-sixth passes).
    publish_queue: bool = True
    #: Largest gRPC message accepted or sent, MiB (both directions, set explicitly).
    max_message_mib: int = 16
    #: Bundle chunk size, KiB.
    chunk_kib: int = 1024
    #: Largest bundle accepted, MiB.
    max_bundle_mib: int = 64
    #: Of the (source, receiver) pairs that exchanged groups (N nodes make up to N x (N - 1),
    #: a million at a thousand nodes), the most any one view shows: the Status RPC (and
    #: `graft-fed status`) lists the pairs with the most groups and says how many there are;
    #: /metrics has one pair_groups_total series per pair while there are at most this many
    #: and leaves them all out beyond (pair_series_omitted 1: counters that come and go
    #: would mislead; per-node totals stay); the live page's matrices show the 64 nodes that
    #: exchanged most.
    max_pairs_shown: int = 10000
    #: Retention: keep this many most recent rounds of summaries and matches, and the bundles
    #: their summaries name (null = all).
    keep_rounds: int | None = None
    #: Retention, with keep_rounds: how far behind the median online node an online node may
    #: hold retention back, in rounds (null = however far). Retention counts keep_rounds back
    #: from the lowest round an online node has come to (so that ids publishing far ahead do
    #: not make it drop the groups of the nodes at work), so one node stuck far behind (a slow
    #: site, or one claiming to be) keeps every round since its own. A node further behind than
    #: this no longer does: the broker logs it, and the rounds it comes to later may have lost
    #: its peers' groups. The median is of the rounds the online nodes published (claims do
    #: not count); ids publishing ahead move it only when they are half the online nodes or
    #: more: without an allowlist ids are free, so use this with one.
    retention_max_lag_rounds: int | None = None
    #: Retention: total bundle bytes kept, GiB; the oldest go first (null = unbounded).
    max_bundle_gib: float | None = None

    def __post_init__(self) -> None:
        require_address(self.listen, "broker.listen")
        if self.http:
            require_address(self.http, "broker.http (\"\" turns it off)")
        require((self.tls_cert is None) == (self.tls_key is None), "broker: give both tls_cert and tls_key, or neither")
        require(self.client_ca is None or self.tls_cert is not None,
                "broker.client_ca (mutual TLS) needs the broker's own tls_cert and tls_key")
        require(self.mode in ("sync", "async"), f"broker.mode must be sync or async, got {self.mode!r}")
        require(self.advantage in ADVANTAGES,
                f"broker.advantage must be one of {list(ADVANTAGES)}, got {self.advantage!r}")
        require(self.balance in ("pairwise", "per_receiver_cap", "none"),
                "broker.balance must be pairwise, per_receiver_cap or none")
        require(self.per_receiver_cap >= 1, "broker.per_receiver_cap must be >= 1")
        # the manifest's fields as the wire carries them (uint64 seed, uint32 counts)
        require(0 <= self.seed < 2**64, f"broker.seed must be in [0, 2^64), got {self.seed}")
        require(2 <= self.n <= MAX_GROUP_N, f"broker.n must be in [2, {MAX_GROUP_N}], got {self.n}")
        require(1 <= self.prompts_per_round < 2**31, f"broker.prompts_per_round must be >= 1 and < 2^31, "
                f"got {self.prompts_per_round}")
        require(0 <= self.staleness_rounds < 2**31, f"broker.staleness_rounds must be >= 0 and < 2^31, "
                f"got {self.staleness_rounds}")
        require(self.round_deadline_s > 0, "broker.round_deadline_s must be > 0")
        require(self.min_nodes >= 1, "broker.min_nodes must be >= 1")
        require(0 < self.quarantine_rejection_rate <= 1, "broker.quarantine_rejection_rate must be in (0, 1]")
        require(self.quarantine_min_reports >= 1, "broker.quarantine_min_reports must be >= 1")
        require(self.quarantine_min_receivers >= 1, "broker.quarantine_min_receivers must be >= 1")
        require(self.keep_rounds is None or self.mode != "async" or self.keep_rounds > self.staleness_rounds,
                f"broker.keep_rounds ({self.keep_rounds}) must be above staleness_rounds ({self.staleness_rounds}) in "
                "async mode: a receiver is offered groups up to staleness_rounds old, and retention would drop them "
                "before it fetches them")
        require(8 <= self.max_workers <= 4096, "broker.max_workers must be in [8, 4096] (every worker thread is "
                "started with the broker)")
        require(self.malloc_arena_max >= 0, "broker.malloc_arena_max must be >= 0 (0: glibc's default)")
        require(self.malloc_trim_s == 0 or self.malloc_trim_s >= 1,
                "broker.malloc_trim_s must be 0 (never) or >= 1 second")
        require(self.work_slots >= 1, "broker.work_slots must be >= 1")
        require(self.switch_interval_ms == 0 or 0.01 <= self.switch_interval_ms <= 1000,
                "broker.switch_interval_ms must be 0 (Python's default) or in [0.01, 1000]")
        require(1 <= self.max_long_polls <= self.max_workers - 4,
                "broker.max_long_polls must be >= 1 and leave at least 4 of max_workers to other calls")
        require(0 <= self.max_publishes_per_s < math.inf,
                "broker.max_publishes_per_s must be >= 0 and finite (0 = off)")
        require(0 <= self.max_requests_per_s < math.inf,
                "broker.max_requests_per_s must be >= 0 and finite (0 = off)")
        require(self.max_node_bundle_mib >= 0, "broker.max_node_bundle_mib must be >= 0 (0 = off)")
        require(self.max_node_summaries == 0
                or MAX_PER_ROUND_FACTOR * self.prompts_per_round <= self.max_node_summaries < 2**62,
                f"broker.max_node_summaries must be 0 (off) or at least what one publish may carry, "
                f"{MAX_PER_ROUND_FACTOR} x prompts_per_round = {MAX_PER_ROUND_FACTOR * self.prompts_per_round}; got "
                f"{self.max_node_summaries}")
        require(1 <= self.replay_window_s < math.inf, "broker.replay_window_s must be >= 1 and finite (seconds of "
                "clock skew and delay tolerated between a node sending a request and the broker receiving it)")
        require(0.1 <= self.heartbeat_interval_s < self.offline_after_s and math.isfinite(self.offline_after_s),
                "broker.heartbeat_interval_s must be >= 0.1 s and below offline_after_s (finite)")
        require(self.max_heartbeats_per_s == 0 or self.max_heartbeats_per_s >= 1,
                "broker.max_heartbeats_per_s must be 0 (a fixed heartbeat interval) or >= 1")
        require(1 <= self.max_message_mib <= 1024, "broker.max_message_mib must be in [1, 1024]")
        require(16 <= self.chunk_kib <= 1024 * self.max_message_mib // 2,
                "broker.chunk_kib must be >= 16 and at most half of max_message_mib")
        require(self.max_bundle_mib >= 1, "broker.max_bundle_mib must be >= 1")
        require(self.max_pairs_shown >= 0, "broker.max_pairs_shown must be >= 0")
        require(self.keep_rounds is None or 1 <= self.keep_rounds < 2**62,
                f"broker.keep_rounds must be >= 1 (and < 2^62) or null, got {self.keep_rounds}")
        require(self.retention_max_lag_rounds is None or 0 <= self.retention_max_lag_rounds < 2**62,
                f"broker.retention_max_lag_rounds must be >= 0 (and < 2^62) or null, got "
                f"{self.retention_max_lag_rounds}")
        require(self.retention_max_lag_rounds is None or self.keep_rounds is not None,
                "broker.retention_max_lag_rounds bounds how far back retention keeps rounds for a node behind the "
                "others, and retention is off (keep_rounds is null): set keep_rounds too, or remove it")
        require(self.max_bundle_gib is None or (math.isfinite(self.max_bundle_gib) and self.max_bundle_gib >= 0),
                f"broker.max_bundle_gib must be a finite number of GiB >= 0 or null (unbounded), "
                f"got {self.max_bundle_gib}")


def load_broker_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> BrokerConfig:
    return load_config(BrokerConfig, path, overrides, "broker config")
