"""Broker process: the gRPC server; over HTTP the live page (/), its data (/api/status),
/metrics and /healthz; retention."""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Sequence

import grpc

from graft_fed.broker.auth import Allowlist, IdentityInterceptor
from graft_fed.broker.blas import one_blas_thread
from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.handlers import Federation
from graft_fed.broker.front import FrontLink
from graft_fed.broker.heap import (decline_protobuf_trims, keep_chunk_buffers, limit_malloc_arenas, memory_usage,
                                   process_memory, tcache_off, trim_heap)
from graft_fed.broker.live import RefusalLog, ScalarLog, node_metrics, status_view
from graft_fed.broker.servicer import (METHODS, SERVICE, BrokerServicer, TimingInterceptor, add_to_server,
                                       method_handlers)
from graft_fed.broker.spool import Spool, requests_dir
from graft_fed.broker.state import BrokerState
from graft_fed.broker.web import serve_http
from graft_fed.broker.workers import Workers
from graft_fed.errors import GraftFedError
from graft_fed.federation.certcheck import check_broker_certificate
from graft_fed.federation.transport import check_plaintext, grpc_options, server_credentials

log = logging.getLogger("graft_fed.broker")


def open_state(db: str) -> BrokerState:
    if db == ":memory:":
        from graft_fed.broker.state_memory import InMemoryState

        return InMemoryState()
    from graft_fed.broker.state_sqlite import SqliteState

    try:
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GraftFedError(f"cannot create the folder of broker.db {db}: {exc.strerror or exc} "
                            f"({exc.filename or Path(db).parent}); choose another with --set db=PATH") from None
    return SqliteState(db)


def render_metrics(fed: Federation, servicer: BrokerServicer, refusals: RefusalLog | None = None,
                   front_pid: int | None = None, pools: Sequence[Workers] = ()) -> str:
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP graft_fed_{name} {help_}")
        lines.append(f"# TYPE graft_fed_{name} {kind}")
        for labels, value in samples:
            lines.append(f"graft_fed_{name}{labels} {value}")

    if fed.allowlist is not None:  # an alert's handle on a bad edit, which only the log told before
        metric("allowlist_valid", "gauge", "1 when the allowlist file is the list in force; 0 while it is "
               "malformed, missing or unreadable and the last good list stands in (the log says why).",
               [("", 0 if fed.allowlist.current_problem() else 1)])
    st = fed.status(pairs=False)
    states: dict[str, int] = {"online": 0, "offline": 0, "left": 0, "registered": 0, "quarantined": 0, "revoked": 0}
    for n in st["nodes"]:
        states[n["state"]] = states.get(n["state"], 0) + 1
    metric("nodes", "gauge", "Nodes by lifecycle state.", [(f'{{state="{k}"}}', v) for k, v in states.items()])
    metric("current_round", "gauge", "Highest round seen.", [("", st["current_round"])])
    metric("bundles", "gauge", "Trajectory bundles held.", [("", st["bundles"])])
    metric("bundle_bytes", "gauge", "Bytes of trajectory bundles held.", [("", st["bundle_bytes"])])
    metric("retention_nodes_left_behind", "gauge", "Online nodes further than broker.retention_max_lag_rounds "
           "behind the median online node at the last retention pass: retention no longer keeps the rounds since "
           "theirs (the log names them).", [("", len(fed.left_behind()))])
    c = fed.counters
    for key, help_ in [("summaries", "Group summaries accepted."), ("duplicate_summaries", "Retried summaries ignored."),
                       ("rounds_matched", "Rounds matched."), ("matches", "Groups matched to a receiver."),
                       ("bundles_stored", "Bundles stored."), ("bundles_duplicate", "Bundles already held."),
                       ("bundles_signed", "Bundles stored with their producer's signature."),
                       ("bundles_unsigned", "Bundles stored unsigned (no mutual TLS or no signature)."),
                       ("bundle_bytes_in", "Bundle bytes uploaded."), ("bundle_bytes_out", "Bundle bytes served."),
                       ("bundles_damaged", "Stored bundles found not to hash to their digest when first fetched "
                        "(not served; the log names each): a damaged volume."),
                       ("reports", "Compatibility reports (one per group)."),
                       ("duplicate_reports", "Repeated reports ignored (a group counts once)."),
                       ("rejected_groups", "Groups rejected by receivers."),
                       ("report_calls", "ReportCompatibility calls stored (each a receiver's report of a round)."),
                       ("report_commits", "Transactions that stored them: reports that arrive together share one "
                        "(over report_calls_total, the mean batch)."),
                       ("joins", "Joins."), ("rejected_join", "Joins refused for a manifest mismatch."),
                       ("disputed_rejections", "Rejections the broker did not count: re-verified as false, or of a "
                        "group its source never uploaded (no receiver can have received it)."),
                       ("long_polls_refused", "GetMatches refused: too many already waiting (per node or in all).")]:
        metric(f"{key}_total", "counter", help_, [("", c.get(key, 0))])
    queue = fed.publishing.queue
    # how far behind the broker is: calls that hold a worker thread, calls that wait for one,
    # publishes that wait for the publish queue (each holds its request's bytes meanwhile)
    loads = [(w.name, *w.load()) for w in pools]
    metric("worker_threads_busy", "gauge", "Worker threads running a call, by pool (front_process: the main pool "
           "and its lanes).", [(f'{{pool="{name}"}}', busy) for name, busy, _ in loads])
    metric("calls_waiting", "gauge", "Calls waiting for a worker thread, by pool: above 0 for long, the broker is "
           "behind its callers (docs/deploy.md, Monitoring).", [(f'{{pool="{name}"}}', waiting)
                                                                 for name, _, waiting in loads])
    metric("long_polls", "gauge", "GetMatches calls open now (waiting for their round or bundles, or being "
           "answered), against broker.max_long_polls; with front_process: true, waiting ones hold no thread.",
           [("", fed.answers.long_polls())])
    metric("publish_queue_waiting", "gauge", "Publishes waiting to be stored by the publish queue.",
           [("", queue.waiting())])
    metric("publish_batches_total", "counter", "Batches the publish queue ran (each decoded, checked and stored "
           "together: docs/architecture.md).", [("", queue.batches)])
    metric("publish_batched_total", "counter", "Publishes the publish queue ran; over publish_batches_total, the "
           "mean batch.", [("", queue.items)])
    metric("publish_busy_seconds_total", "counter", "Seconds the publish queue's thread spent running batches: its "
           "rate near 1, the thread is saturated and publishes queue behind it.", [("", queue.busy_s)])
    metric("publish_waited_seconds_total", "counter", "Seconds publishes waited for the publish queue to take them, "
           "summed; over publish_batched_total, the mean wait.", [("", queue.waited_s)])
    stats = servicer.stats
    replay = fed.replay.counters
    metric("replay_refused_total", "counter", "State-changing requests refused by replay protection, by reason.",
           [(f'{{reason="{r}"}}', replay.get(f"refused_{r}", 0)) for r in ("duplicate", "stale", "inflight",
                                                                            "untagged")])
    metric("replay_request_ids", "gauge", "Request ids remembered for replay protection.",
           [("", fed.replay.remembered())])
    metric("rpc_total", "counter", "RPCs by method and status code.",
           [(f'{{method="{m}",code="{code}"}}', v) for (m, code), v in sorted(stats.calls.items())])
    samples = []
    for m, counts in sorted(stats.hist.items()):
        for b, cumulative in zip(stats.BUCKETS, counts):
            le = "+Inf" if b == float("inf") else repr(b)
            samples.append((f'_bucket{{method="{m}",le="{le}"}}', cumulative))
        samples.append((f'_sum{{method="{m}"}}', stats.sum[m]))
        samples.append((f'_count{{method="{m}"}}', counts[-1]))
    metric("rpc_seconds", "histogram", "RPC latency.", samples)
    mem = memory_usage()
    counts = {"threads": ("process_threads", "Threads of the broker process."),
              "python_blocks": ("python_allocated_blocks", "Objects held by Python's allocator.")}
    metric("broker_memory_bytes", "gauge", "The broker process's memory by where it is: resident anonymous and "
           "file pages; the C heap's bytes in use, free and mapped whole; SQLite's (docs/deploy.md, Monitoring).",
           [(f'{{kind="{k}"}}', v) for k, v in mem.items() if k not in counts])
    for key, (name, help_) in counts.items():
        if key in mem:
            metric(name, "gauge", help_, [("", mem[key])])
    if front_pid is not None:  # front_process: the process serving gRPC (broker/front.py)
        front = process_memory(front_pid)
        metric("front_memory_bytes", "gauge", "The front process's resident memory (front_process: true).",
               [(f'{{kind="{k}"}}', v) for k, v in front.items() if k != "threads"])
        metric("front_threads", "gauge", "Threads of the front process.", [("", front.get("threads", 0))])
    checkpointer = getattr(fed.state, "checkpointer", None)  # a SQLite state's (broker/checkpointer.py)
    if checkpointer is not None:
        metric("state_wal_bytes", "gauge", "Size of the state's WAL file (checkpointed each time it grows by 64 MiB).",
               [("", checkpointer.wal_bytes())])
        metric("state_checkpoints_total", "counter", "WAL checkpoints the state's checkpointer thread ran.",
               [("", checkpointer.runs)])
        metric("state_wal_truncations_total", "counter", "WAL files truncated after a quiet checkpoint that copied "
               "every frame.", [("", checkpointer.truncations)])
        metric("state_checkpoint_failures_total", "counter", "WAL checkpoints that failed (each logged, then retried).",
               [("", checkpointer.failures)])
        metric("state_checkpointer_up", "gauge", "1 while the state's checkpointer thread runs.",
               [("", int(checkpointer.alive))])
    lines += node_metrics(fed, servicer.scalars, refusals, st)
    return "\n".join(lines) + "\n"


def _finite(value):
    """JSON has no NaN: missing values become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def live_page() -> bytes:
    """The live federation page: one self-contained HTML file (no CDN, no build step)."""
    from importlib.resources import files

    return files("graft_fed.broker").joinpath("live.html").read_bytes()


def pending_calls(max_long_polls: int) -> int:
    """How many calls may wait for a worker: four per node (see pending_call_options)."""
    return max(1000, 4 * max_long_polls)


def pending_call_options(max_long_polls: int) -> list[tuple[str, int]]:
    """gRPC core holds calls that arrived before the server asked for the next one (grpcio's
    synchronous server asks one call at a time, from one thread that needs the interpreter).
    By default it refuses arrivals at random once 1,000 wait there (RESOURCE_EXHAUSTED, "Too
    many pending requests for this server") and cancels any that waited 30 s. When a thousand
    nodes published at once, about 220 of their calls failed without reaching a handler while
    the broker had idle threads; with these limits the same run completed (issue 13, third
    pass). Here the queue may hold four calls per node (`max_long_polls` is sized to the
    federation's nodes) and a call waits as long as its client's deadline says."""
    pending = pending_calls(max_long_polls)
    return [("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", 3 * pending),
            ("grpc.server_max_unrequested_time_in_server", 3600)]


class BrokerServer:
    def __init__(self, cfg: BrokerConfig, state: BrokerState | None = None) -> None:
        one_blas_thread()  # matching's matrix products, without OpenBLAS threads spinning for a busy core
        self.cfg = cfg
        if not (cfg.tls_cert and cfg.tls_key):  # before anything is opened
            check_plaintext(cfg.listen, cfg.insecure, "broker")
        else:  # gRPC would only say it cannot bind the port
            check_broker_certificate(cfg.tls_cert, cfg.tls_key, cfg.client_ca)
        self.state = state or open_state(cfg.db)
        try:  # a bad allowlist, a state of another federation, prompts that do not load
            allowlist = Allowlist(cfg.allowlist) if cfg.allowlist else None
            self.fed = Federation(cfg, self.state, allowlist=allowlist)
        except BaseException:
            if state is None:  # opened here: closed here (its lock would outlive the refusal)
                self.state.close()
            raise
        # operators' requests to this running broker (`graft-fed broker forget-secret`), for a state on disk
        self.spool: Spool | None = None
        db_path = getattr(self.state, "path", None)
        if isinstance(db_path, str):
            try:
                self.spool = Spool(db_path, {"forget_secret": self.fed.forget_secret})
            except (OSError, GraftFedError) as exc:
                log.warning("cannot take operators' requests in %s (%s): `graft-fed broker forget-secret` then "
                            "needs this broker stopped", requests_dir(db_path), exc)
        self.servicer = BrokerServicer(self.fed)
        self.refusals = RefusalLog()
        self.servicer.scalars = ScalarLog()
        # the timing interceptor first: a call that asks is timed from before the identity check
        interceptors = [TimingInterceptor(),
                        IdentityInterceptor(require_certificate=cfg.client_ca is not None, allowlist=allowlist,
                                            max_requests_per_s=cfg.max_requests_per_s, refusals=self.refusals)]
        # no SO_REUSEPORT: a second broker on a taken port must fail, not share it
        options = (grpc_options(cfg.max_message_mib) + [("grpc.so_reuseport", 0)]
                   + pending_call_options(cfg.max_long_polls))
        tls = (cfg.tls_cert, cfg.tls_key, cfg.client_ca) if cfg.tls_cert and cfg.tls_key else None
        #: set, with `failure`, when the broker cannot serve any more (its front process exited)
        self.failed = threading.Event()
        self.failure = ""
        self.grpc: grpc.Server | None = None
        self.pool: Workers | None = None
        self.front: FrontLink | None = None
        if cfg.front_process:
            # gRPC served by a process of its own, which hands every call over (broker/front.py)
            try:
                if tls:
                    server_credentials(*tls)  # a missing or unreadable file: its ConfigError here, not the front's
                # the broker's threads in lanes that cannot take each other's: long-polls, bundle
                # streams (which wait on slow clients) and every other call max_workers -
                # max_long_polls each; heartbeats 8 of their own, never behind a publish. A
                # waiting long-poll holds no thread here (parked: FrontLink._park), so its lane
                # only builds answers
                rest = max(8, cfg.max_workers - cfg.max_long_polls)
                self.front = FrontLink(SERVICE, [(name, kind) for name, (kind, _, _) in METHODS.items()],
                                       method_handlers(self.servicer, front=True), interceptors, rest, self._front_lost,
                                       lanes=[(("GetMatches",), rest),
                                              (("UploadBundle", "FetchBundle"), rest), (("Heartbeat",), 8)])
                # requests handed over and not answered: at most 8 of the largest message (128 MiB)
                self.port = self.front.start(cfg.listen, options, tls,
                                             cfg.max_workers + pending_calls(cfg.max_long_polls),
                                             budget_bytes=8 * cfg.max_message_mib * 2**20,
                                             malloc_arena_max=cfg.malloc_arena_max, chunk_bytes=cfg.chunk_kib * 1024)
            except BaseException:
                if self.front is not None:
                    self.front.stop(0)
                self.state.close()
                raise
        else:
            self.pool = Workers(cfg.max_workers, "broker")  # all started now, the last idle serving (workers.py)
            try:
                self.grpc = grpc.server(self.pool, options=options, interceptors=interceptors)
                add_to_server(self.servicer, self.grpc)
                if tls:
                    self.port = self.grpc.add_secure_port(cfg.listen, server_credentials(*tls))
                else:
                    self.port = self.grpc.add_insecure_port(cfg.listen)
                if self.port == 0:
                    raise OSError(f"cannot listen on {cfg.listen}")
            except BaseException:
                self.pool.shutdown(wait=False)
                self.state.close()
                raise
        self.http: ThreadingHTTPServer | None = None
        self.http_port: int | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        host = self.cfg.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def _serve_http(self) -> None:
        if not self.cfg.http:
            return
        fed, servicer, refusals = self.fed, self.servicer, self.refusals
        front_pid = self.front.proc.pid if self.front is not None and self.front.proc is not None else None
        pools = self.front.pools if self.front is not None else [self.pool] if self.pool is not None else []
        routes = {
            "/metrics": lambda: (render_metrics(fed, servicer, refusals, front_pid, pools).encode(),
                                 "text/plain; version=0.0.4"),
            "/healthz": lambda: (b"ok\n", "text/plain"),
            "/api/status": lambda: (json.dumps(_finite(status_view(fed, servicer.scalars, refusals))).encode(),
                                    "application/json"),
            "/": lambda: (live_page(), "text/html; charset=utf-8"),
        }
        routes["/index.html"] = routes["/"]
        self.http = serve_http(self.cfg.http, routes)  # bounded connections and reads (broker/web.py)
        self.http_port = self.http.server_address[1]

    def _housekeeping(self) -> None:
        last_trim = time.monotonic()
        while not self._stop.wait(1.0):
            if self.cfg.malloc_trim_s and time.monotonic() - last_trim >= self.cfg.malloc_trim_s:
                trim_heap()  # free pages inside the C heap back to the kernel (broker/heap.py)
                last_trim = time.monotonic()
            self.fed.rescale_heartbeats()  # before readiness: it decides who is offline
            self.fed.wake_ready_rounds()  # rounds closed by a node going offline
            self.fed.replay.expire()
            try:
                self.fed.flush_liveness()
            except Exception:  # noqa: BLE001 - liveness is best effort
                log.exception("persisting liveness failed")
            if self.cfg.keep_rounds or self.cfg.max_bundle_gib:
                try:
                    self.fed.prune()
                except Exception:  # noqa: BLE001 - retention must never take the broker down
                    log.exception("retention failed")
            if self.spool is not None:
                try:
                    self.spool.serve()
                except Exception:  # noqa: BLE001 - as retention: never take the broker down
                    log.exception("operators' requests failed")

    def _front_lost(self, why: str) -> None:
        log.error("%s", why)
        self.failure = why
        self.failed.set()

    def start(self) -> "BrokerServer":
        keep_chunk_buffers(self.cfg.chunk_kib * 1024)  # heap/page-fault costs per chunk (broker/heap.py)
        if self.grpc is not None:
            self.grpc.start()
        if self.front is not None:
            self.front.serve()
        try:
            self._serve_http()
        except BaseException:
            self._stop_grpc(0)
            self.state.close()
            raise
        t = threading.Thread(target=self._housekeeping, name="broker-housekeeping", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("broker listening on %s (http %s), federation %s, dataset %s, mode %s", self.address,
                 self.http_port, self.cfg.federation_id, self.fed.manifest.dataset_id, self.cfg.mode)
        _say_quota_reach(self.cfg)
        return self

    def wait(self) -> None:
        """Until the broker stops (or, with the front, fails)."""
        if self.grpc is not None:
            self.grpc.wait_for_termination()
        else:
            while not (self._stop.wait(0.5) or self.failed.is_set()):
                pass

    def _stop_grpc(self, grace: float) -> None:
        if self.grpc is not None:
            self.grpc.stop(grace).wait()
        if self.pool is not None:
            self.pool.shutdown(wait=False)  # its threads end as they finish their calls
        if self.front is not None:
            self.front.stop(grace)

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self._stop_grpc(grace)
        self.fed.stop()  # the publishes already queued are stored (the state is still open)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        try:
            self.fed.flush_liveness()
        except Exception:  # noqa: BLE001 - a failing disk must not stop the shutdown
            log.exception("persisting liveness failed")
        self.state.close()


def _say_quota_reach(cfg: BrokerConfig) -> None:
    """How many rounds a node may publish before `max_node_summaries` refuses it, when that
    is not far: with retention keeping every round, or keeping more than the quota holds."""
    quota, per_round = cfg.max_node_summaries, cfg.prompts_per_round
    if not quota:
        return
    rounds = quota // per_round
    if cfg.keep_rounds is None:
        log.info("retention keeps every round (keep_rounds: null): a node publishing %d summaries a round reaches "
                 "max_node_summaries (%d) after about %d rounds and its publishes are refused from then on; set "
                 "keep_rounds for longer runs", per_round, quota, rounds)
    elif rounds < cfg.keep_rounds + 2:
        log.warning("max_node_summaries (%d) holds %d rounds of %d summaries, fewer than retention keeps (keep_rounds "
                    "%d): every node will have its publishes refused once it has published that many rounds; raise "
                    "max_node_summaries or lower keep_rounds", quota, rounds, per_round, cfg.keep_rounds)

def start_broker(cfg: BrokerConfig, state: BrokerState | None = None) -> BrokerServer:
    """Start a broker as `graft-fed broker` runs one, in a process of its own (the command
    and the benchmarks' broker processes both start it here): the C heap's arenas capped
    before any worker thread exists, then, once serving, everything loaded so far (modules,
    the state's caches) frozen out of the garbage collector's sight, so that a full
    collection walks only what serving allocates rather than ~40,000 more objects with the
    GIL held, where every heartbeat waits (issue 13, fourth pass); and the interpreter's
    switch interval set (`switch_interval_ms`). Not for a process that starts several
    brokers (the tests): the freeze and the interval are for the process's whole life."""
    limit_malloc_arenas(cfg.malloc_arena_max)
    log.info("C heap: %s malloc arena(s), glibc's per-thread caches %s, protobuf's malloc_trim calls %s",
             cfg.malloc_arena_max or "glibc's default", "off" if tcache_off() else "on",
             "let through" if cfg.protobuf_malloc_trim else decline_protobuf_trims())
    # numpy 2.x imports numpy.ma on the first np.unique (it asks np.ma.is_masked): 7-9 ms of
    # imports with the GIL held alone, more among the broker's threads, in the middle of the
    # first round that called it (issue 13, docs/performance.md, fortieth pass); imported
    # here, before the freeze, instead
    import numpy.ma  # noqa: F401
    if cfg.switch_interval_ms:
        sys.setswitchinterval(cfg.switch_interval_ms / 1000)
    server = BrokerServer(cfg, state).start()
    gc.collect()
    gc.freeze()
    return server
