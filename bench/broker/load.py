"""Load: N simulated nodes x P summaries per round over mutual TLS on loopback, for a set
duration, with the broker SIGKILLed and restarted on the same SQLite file in the middle.

    .venv/bin/python bench/broker/load.py                      # 64 nodes x 256 summaries, 600 s
    .venv/bin/python bench/broker/load.py --duration 60        # a shorter run
    .venv/bin/python bench/broker/load.py --nodes 4 --prompts 16 --duration 4 --out-dir /tmp/x   # smoke

What runs:

- A federation CA, a broker certificate (127.0.0.1) and one certificate per node, made by
  graft_fed/federation/certs.py in a temporary directory; the broker requires them (mTLS).
- The broker: `graft-fed broker` in a subprocess (its defaults: sync rounds, pairwise
  balance, SqliteState with WAL and synchronous=FULL, 2 s heartbeats, 15 s offline cut-off).
  At `--restart-at` seconds (default: half the duration) it is SIGKILLed and started again
  on the same file and port.
- The nodes: `--procs` worker processes, each running its share of the N nodes as threads.
  A node is a real BrokerClient (its own TLS channel and certificate, its heartbeat thread)
  and no model: per round it publishes P summaries (random k in 0..8 of n = 8, random
  lengths and mean log-probs) and long-polls GetMatches until the round is matched, then
  goes to the next round: at once (the default: the broker never rests, as in a federation
  that publishes as fast as it is served), or after `--train-s` seconds, as a node that
  trains between rounds. Any failed call is retried after a jittered exponential backoff
  (0.2 s doubling to `--backoff-cap-s`, 5 s); a node that lost its session joins again; a publish is
  repeated until acknowledged (publishing is idempotent).
- The last `--probes` nodes (default 1) each run alone in a process of their own, as a real
  node does (its heartbeats leave its own process); the others share `--procs` processes.
  Every heartbeat is stamped by the node (sent, received) and by the broker (serving thread
  took it, handler entered, handler returned: the `graft-timing` trailing metadata), and
  the probes' and the simulated nodes' heartbeats are reported apart, each split into
  those four segments.
- Every `--sample-s` seconds the broker's VmRSS (/proc/PID/status), its child processes'
  (the front with `--set front_process=true`) and the 1-minute load average are sampled;
  with children, the flat verdict is on the broker and its children together. Per broker
  life: the RSS slope after the first minute, and after `--warmup-s` (300 s: the replay
  guard's window) whether it is flat (rss_lives), and
  whether the run can tell: the slope's standard error allows for a heap that churns
  (samples that follow each other), and a verdict whose interval of two standard errors
  straddles the flat limit is reported as not shown, whichever side the slope is on. Every
  `--memory-s` seconds the broker's own /metrics says where its memory is
  (`graft_fed_broker_memory_bytes{kind}`: C heap in use and free, SQLite, resident anonymous
  and file pages; threads; Python's blocks; the replay guard's request ids), each kind's
  slope per life (memory_lives).

At the end the broker is stopped and its SQLite file read directly: every acknowledged
(node, round) must hold exactly its P summaries (none lost), no (node, round, prompt) may
appear twice, and each node's `published` count must equal the rows it holds (a retried
publish counted as new would show here). Results: `<out-dir>/<name>.json` and `.md`
(default bench/broker/results/load.*). Exit status 1 when anything acknowledged was lost or
duplicated.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, ROOT, machine, machine_line, make_summaries, percentile, write_prompts  # noqa: E402

GROUP_N = 8
VERIFIER = "math_verify"
NAN = float("nan")
#: heartbeats sent from a SIGKILL until this long after the broker listens again are counted
#: apart (the node's channel reconnects with a backoff of at most 2 s)
RESTART_WINDOW_S = 5.0


# ----- the simulated nodes (worker processes) -------------------------------------------------------


def run_node(i: int, ctx: dict, out: dict) -> None:
    import grpc

    from graft_fed.federation.errors import FederationError, Unauthenticated
    from graft_fed.federation.transport import TIMING_KEY, parse_timing
    from graft_fed.node.client import Backoff, BrokerClient
    from graft_fed.proto import broker_pb2 as pb

    name = f"node{i:02d}"
    rng = random.Random(ctx["seed"] * 7919 + i)
    lat: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    # round -> (accepted, duplicates, unix time) of the publish that was acknowledged
    acked: dict[int, tuple[int, int, float]] = {}
    ready_wait: list[float] = []
    certs = Path(ctx["certs"])
    tls = {} if ctx.get("plaintext") else {"tls_ca": str(certs / "ca.pem"), "tls_cert": str(certs / f"{name}.pem"),
                                           "tls_key": str(certs / f"{name}.key")}
    client = BrokerClient(ctx["address"], name, rpc_timeout_s=ctx["rpc_timeout_s"], **tls)
    heartbeat = client.stub.Heartbeat.with_call
    # per heartbeat: (sent, picked, entered, left, received), Unix seconds; the middle three are
    # the broker's (TIMING_KEY), nan when it sent none; a failed one: (sent, received, code)
    beats: list[tuple[float, ...]] = []
    failed_beats: list[tuple[float, float, str]] = []

    def timed_heartbeat(request, timeout=None):  # the client's own heartbeat thread calls this
        t0, sent = time.perf_counter(), time.time()
        try:
            resp, rpc = heartbeat(request, timeout=timeout, metadata=((TIMING_KEY, "1"),))
        except grpc.RpcError as exc:
            errors[f"Heartbeat {exc.code().name}"] += 1
            failed_beats.append((sent, time.time(), exc.code().name))
            raise
        lat["Heartbeat"].append(time.perf_counter() - t0)
        beats.append((sent, *(parse_timing(rpc.trailing_metadata()) or (NAN, NAN, NAN)), time.time()))
        return resp

    client.stub.Heartbeat = timed_heartbeat
    # heartbeats every interval, busy or not: their latency under load is what this bench
    # measures (a BrokerClient otherwise lets its other calls stand in for them)
    client.answered = lambda rpc, sent: None

    def call(rpc: str, fn):
        t0 = time.perf_counter()
        try:
            result = fn()
        except FederationError as exc:
            errors[f"{rpc} {exc.status}"] += 1
            raise
        lat[rpc].append(time.perf_counter() - t0)
        return result

    backoff = Backoff(0.2, ctx["backoff_cap_s"], rng)
    end = ctx["end"]
    joined, rnd, published, t_ack, t_ready = False, 0, False, 0.0, 0.0
    summaries = make_summaries(rng, ctx["prompt_ids"], rnd, GROUP_N)
    joins = retries = 0
    try:
        while time.time() < end:
            try:
                if not joined or client.session_lost.is_set():
                    call("Join", lambda: client.join(f"model-{name}", "tok", ctx["manifest"], "share_all", rnd))
                    joined, joins = True, joins + 1
                if not published and ctx["train_s"] > 0 and rnd > 0:
                    # a node trains between a round's matches and its next publish
                    time.sleep(min(max(0.0, t_ready + ctx["train_s"] - time.perf_counter()),
                                   max(0.0, end - time.time())))
                    if time.time() >= end:
                        break
                if not published:
                    accepted, dups = call("PublishSummaries", lambda: client.publish(rnd, summaries))
                    acked[rnd] = (accepted, dups, time.time())
                    published, t_ack = True, time.perf_counter()
                while time.time() < end:
                    res = call("GetMatches", lambda: client.get_matches(rnd, ctx["match_wait_s"]))
                    if res.ready:
                        t_ready = time.perf_counter()
                        ready_wait.append(t_ready - t_ack)
                        if ctx.get("reports") and res.offers:
                            # as a node does once it has scored the groups it was given (made-up
                            # scores, none rejected); best effort: a failed report is counted, and
                            # the node goes on to its next round
                            entries = [pb.CompatibilityReport.Entry(source_node_id=o.source_node,
                                                                    prompt_id=o.prompt_id,
                                                                    mean_s=rng.uniform(0.2, 2.0),
                                                                    admitted_fraction=rng.random())
                                       for o in res.offers]
                            try:
                                call("ReportCompatibility", lambda: client.report(rnd, entries))
                            except FederationError:
                                pass
                        rnd, published = rnd + 1, False
                        summaries = make_summaries(rng, ctx["prompt_ids"], rnd, GROUP_N)
                        break
                backoff.succeeded()
            except FederationError as exc:
                retries += 1
                if isinstance(exc, Unauthenticated):
                    joined = False
                time.sleep(min(backoff.failed(), max(0.0, end - time.time())))
        try:
            client.leave()
        except FederationError:
            pass
    finally:
        client.close()
    out[name] = {"acked": acked, "lat": dict(lat), "errors": dict(errors), "ready_wait": ready_wait,
                 "rounds_ready": len(ready_wait), "joins": joins, "retries": retries, "beats": beats,
                 "failed_beats": failed_beats}


def worker(node_ids: list[int], ctx: dict, queue, go, end) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    import graft_fed.node.client  # noqa: F401 - the imports take seconds: before the clock starts
    from graft_fed.federation.manifest import Manifest

    queue.put("ready")
    go.wait()
    ctx = dict(ctx, manifest=Manifest(**ctx["manifest"]), end=end.value)
    out: dict = {}
    threads = [threading.Thread(target=run_node, args=(i, ctx, out), daemon=True) for i in node_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=ctx["end"] - time.time() + 4 * ctx["rpc_timeout_s"] + 60)
    queue.put(out)


# ----- the broker (subprocess) --------------------------------------------------------------------

class Broker:
    def __init__(self, cfg_path: Path, work: Path, env: dict[str, str] | None = None) -> None:
        self.cfg_path, self.work = cfg_path, work
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lives: list[dict] = []
        self.log = open(work / "broker.log", "ab")

    def start(self) -> float:
        port_file = self.work / "port"
        port_file.unlink(missing_ok=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "broker", "--config", str(self.cfg_path),
                                      "--port-file", str(port_file)], cwd=ROOT, stdout=self.log, stderr=self.log,
                                     env=self.env)
        self.lives.append({"pid": self.proc.pid, "t0": t0})
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited at start (code {self.proc.returncode}); see "
                                   f"{self.work / 'broker.log'}")
            if time.monotonic() - t0 > 120:
                raise RuntimeError("the broker did not start within 120 s")
            time.sleep(0.02)
        up = time.monotonic() - t0
        self.lives[-1]["started_s"] = up
        return up

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def children_rss_kib(pid: int) -> int | None:
    """VmRSS of `pid`'s child processes together (the front with `front_process: true`, which
    holds gRPC core and its memory), None when it has none."""
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return None
    sizes = [k for k in (rss_kib(c) for c in kids) if k is not None]
    return sum(sizes) if sizes else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- verification -------------------------------------------------------------------------------

def verify(db: Path, nodes: dict, n_prompts: int) -> dict:
    from graft_fed.broker.state_sqlite import SqliteState

    st = SqliteState(db)  # the broker has stopped; summaries are stored as blocks, read through the state
    rows: Counter[tuple[str, int]] = Counter()
    dup_keys = total_rows = 0
    try:
        published = {n.node_id: n.published for n in st.list_nodes()}
        for node in sorted(set(published) | set(nodes)):  # a node at a time: a long run holds tens of millions
            heads = st.summary_heads(node_id=node)
            keys = Counter((h.round, h.prompt_id) for h in heads)
            rows.update((node, h.round) for h in heads)
            dup_keys += sum(1 for c in keys.values() if c > 1)
            total_rows += len(heads)
            del heads, keys
        rounds_matched = st._read("SELECT COUNT(*) FROM rounds WHERE state = 'matched'")[0][0]
    finally:
        st.close()
    lost = extra = acked_summaries = 0
    lost_where: list[str] = []
    unacked_rows = 0
    for name, res in nodes.items():
        acked = {int(r) for r in res["acked"]}
        for r in acked:
            acked_summaries += n_prompts
            held = rows.get((name, r), 0)
            if held < n_prompts:
                lost += n_prompts - held
                lost_where.append(f"{name} round {r}: {held}/{n_prompts}")
            extra += max(0, held - n_prompts)
        unacked_rows += sum(c for (n, r), c in rows.items() if n == name and r not in acked)
    per_node_rows = Counter()
    for (n, _), c in rows.items():
        per_node_rows[n] += c
    count_mismatch = {n: (published.get(n, 0), per_node_rows[n]) for n in nodes
                      if published.get(n, 0) != per_node_rows[n]}
    return {"acknowledged_summaries": acked_summaries, "rows": total_rows, "lost": lost, "lost_where": lost_where[:20],
            "extra_rows_in_acknowledged_rounds": extra, "duplicate_keys": dup_keys,
            "rows_never_acknowledged": unacked_rows, "published_count_mismatch": count_mismatch,
            "rounds_matched": rounds_matched}


# ----- main ---------------------------------------------------------------------------------------

def summarise_latencies(nodes: dict) -> dict:
    pooled: dict[str, list[float]] = defaultdict(list)
    for res in nodes.values():
        for rpc, xs in res["lat"].items():
            pooled[rpc].extend(xs)
        pooled["round ready (publish ack .. matches ready)"].extend(res["ready_wait"])
    return {rpc: {"count": len(xs), "p50_ms": 1e3 * percentile(xs, 50), "p99_ms": 1e3 * percentile(xs, 99),
                  "max_ms": 1e3 * max(xs) if xs else float("nan")} for rpc, xs in sorted(pooled.items())}


SEGMENTS = ("node to the broker's serving thread", "serving thread to a worker", "handler",
            "broker back to the node")


def _dist(xs: list[float]) -> dict:
    xs = [x for x in xs if x == x]
    return {"count": len(xs), "p50_ms": 1e3 * percentile(xs, 50), "p90_ms": 1e3 * percentile(xs, 90),
            "p99_ms": 1e3 * percentile(xs, 99), "max_ms": 1e3 * max(xs) if xs else NAN}


def heartbeat_split(beats: list[tuple[float, ...]], failed: list[tuple], restarts: list[dict]) -> dict:
    """Heartbeats of one population: the round trip, and where it went (SEGMENTS, from the
    node's and the broker's stamps; both on this machine's clock), for all calls and for those
    sent outside a restart window (a SIGKILL until RESTART_WINDOW_S after listening again);
    and, for the slowest 1% of calls, the mean of each segment (where the tail's time goes)."""
    windows = [(r["killed_at_unix"], r["killed_at_unix"] + r["start_s"] + RESTART_WINDOW_S) for r in restarts
               if r["killed_at_unix"] == r["killed_at_unix"]]
    outside = [b for b in beats if not any(lo <= b[0] <= hi for lo, hi in windows)]
    total = [b[4] - b[0] for b in beats]
    seg = [[b[j + 1] - b[j] for b in beats] for j in range(4)]
    cut = percentile(total, 99)
    tail = [b for b, t in zip(beats, total) if t >= cut]
    return {"calls": len(beats), "failed": len(failed), "round_trip": _dist(total),
            "round_trip_outside_restarts": _dist([b[4] - b[0] for b in outside]),
            "segments": {name: _dist(xs) for name, xs in zip(SEGMENTS, seg)},
            "slowest_1pct_mean_ms": {name: 1e3 * sum(b[j + 1] - b[j] for b in tail) / len(tail) if tail else NAN
                                     for j, name in enumerate(SEGMENTS)},
            "timed_by_broker": sum(1 for b in beats if b[2] == b[2])}


def _fit(pts: list[tuple[float, float]]) -> tuple[float, float, float, float] | None:
    """The least-squares line through (seconds, MiB) points: (mean x, mean y, the sum of
    squared x deviations, the slope per second); None when x does not vary."""
    mx, my = sum(a for a, _ in pts) / len(pts), sum(b for _, b in pts) / len(pts)
    sxx = sum((a - mx) ** 2 for a, _ in pts)
    return (mx, my, sxx, sum((a - mx) * (b - my) for a, b in pts) / sxx) if sxx else None


def slope(pts: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(pts) < 3:
        return NAN
    fit = _fit(pts)
    return 60 * fit[3] if fit else NAN


def slope_se(pts: list[tuple[float, float]]) -> float:
    """The standard error of `slope` (MiB per minute), allowing for samples that are not
    independent: a heap that churns leaves residuals that follow each other, so their
    lag-1 autocorrelation r (0 to 0.99) inflates the variance by (1 + r) / (1 - r), as an
    AR(1) series' effective count is n (1 - r) / (1 + r)."""
    n = len(pts)
    fit = _fit(pts) if n >= 4 else None
    if fit is None:
        return NAN
    mx, my, sxx, b = fit
    res = [y - my - b * (a - mx) for a, y in pts]
    ss = sum(e * e for e in res)
    if not ss:
        return 0.0
    r = min(max(sum(res[i] * res[i - 1] for i in range(1, n)) / ss, 0.0), 0.99)
    return 60 * math.sqrt(ss / (n - 2) / sxx * (1 + r) / (1 - r))


def scrape_memory(http: str) -> dict[str, float] | None:
    """The broker's graft_fed_broker_memory_bytes{kind}, its threads, Python's blocks, the
    replay guard's request ids (the cache that fills for replay_window_s) and the (source,
    receiver) pairs that exchanged groups (they keep arriving for minutes) from its /metrics."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    except (OSError, ValueError):
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("graft_fed_broker_memory_bytes{"):
            out[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith(("graft_fed_process_threads ", "graft_fed_python_allocated_blocks ",
                              "graft_fed_replay_request_ids ", "graft_fed_pairs ",
                              "graft_fed_publish_queue_waiting ", *QUEUE_COUNTERS)):
            out[line.split()[0].removeprefix("graft_fed_")] = float(line.split()[-1])
        elif line.startswith("graft_fed_calls_waiting{"):  # every pool's, together
            out["calls_waiting"] = out.get("calls_waiting", 0.0) + float(line.split()[-1])
        elif line.startswith(('graft_fed_rpc_seconds_sum{method="PublishSummaries"}',
                              'graft_fed_rpc_seconds_count{method="PublishSummaries"}')):
            out["publish_rpc_" + line.split("{")[0].rsplit("_", 1)[-1]] = float(line.split()[-1])
    return out


#: the publish queue's counters (cumulative; `queue_windows` turns them into rates)
QUEUE_COUNTERS = ("graft_fed_publish_batches_total ", "graft_fed_publish_batched_total ",
                  "graft_fed_publish_busy_seconds_total ", "graft_fed_publish_waited_seconds_total ")
CUMULATIVE = tuple(c.strip().removeprefix("graft_fed_") for c in QUEUE_COUNTERS) + ("publish_rpc_sum",
                                                                                    "publish_rpc_count")


def queue_windows(samples: list[dict], n_lives: int, window_s: float) -> list[list[dict]]:
    """Per broker life, the publish queue in successive windows of `window_s` of its age
    (from the counters' differences between a window's first and last sample): publishes
    run, the mean batch, how busy its thread was, its work and the wait per publish, and the
    broker's whole PublishSummaries time per call. Does the broker slow as a life goes on?"""
    out = []
    for life in range(n_lives):
        mine = [s for s in samples if s["life"] == life and all(k in s["memory"] for k in CUMULATIVE)]
        rows, start = [], 0.0
        while mine and start < mine[-1]["age"]:
            pts = [s for s in mine if start <= s["age"] < start + window_s]
            if len(pts) >= 2:
                a, b = pts[0], pts[-1]
                d = {k: b["memory"][k] - a["memory"][k] for k in CUMULATIVE}
                dt = b["age"] - a["age"]
                n = d["publish_batched_total"]
                rows.append({"from_s": a["age"], "to_s": b["age"], "publishes": n,
                             "per_s": n / dt if dt > 0 else NAN,
                             "mean_batch": n / d["publish_batches_total"] if d["publish_batches_total"] else NAN,
                             "busy": d["publish_busy_seconds_total"] / dt if dt > 0 else NAN,
                             "work_ms": 1e3 * d["publish_busy_seconds_total"] / n if n else NAN,
                             "wait_ms": 1e3 * d["publish_waited_seconds_total"] / n if n else NAN,
                             "rpc_ms": 1e3 * d["publish_rpc_sum"] / d["publish_rpc_count"]
                             if d["publish_rpc_count"] else NAN,
                             "waiting_mean": sum(s["memory"].get("publish_queue_waiting", 0.0) for s in pts) / len(pts)})
            start += window_s
        out.append(rows)
    return out


#: counts, not bytes (calls and publishes waiting: what the broker is behind by when sampled)
COUNTS = ("process_threads", "python_allocated_blocks", "replay_request_ids", "pairs", "calls_waiting",
          "publish_queue_waiting")


def windows_of(late: list[tuple[float, float]], warmup_s: float, window_s: float) -> list[dict]:
    """Successive windows of `window_s` of age from the warm-up on, each with its mean, its
    last value and its least-squares slope per minute: does the slope settle?"""
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"a window must last a finite number of seconds > 0, not {window_s}")
    windows, start = [], warmup_s
    while late and start + window_s / 2 <= late[-1][0]:
        pts = [p for p in late if start <= p[0] < start + window_s]
        if len(pts) >= 3:
            windows.append({"from_s": start, "to_s": min(start + window_s, pts[-1][0]),
                            "mean": sum(b for _, b in pts) / len(pts), "last": pts[-1][1], "slope_per_min": slope(pts)})
        start += window_s
    return windows


def with_derived(mem: dict[str, float]) -> dict[str, float]:
    """`mem` with two kinds derived from the others, where they are there: `heap_size`, what
    glibc's heap holds from the kernel (bytes in use + free: it rises in steps when a request
    finds no free chunk large enough, and never falls without a trim), and
    `anon_outside_heap`, the resident anonymous memory that is not the heap's nor a block it
    mapped whole (Python's object arenas, thread stacks, gRPC's and OpenSSL's own maps)."""
    if "malloc_in_use" not in mem or "malloc_free" not in mem:
        return mem
    out = {**mem, "heap_size": mem["malloc_in_use"] + mem["malloc_free"]}
    if "resident_anon" in mem:
        out["anon_outside_heap"] = mem["resident_anon"] - out["heap_size"] - mem.get("malloc_mmapped", 0.0)
    return out


def memory_lives(samples: list[dict], n_lives: int, warmup_s: float, window_s: float = 0.0) -> list[dict]:
    """Per broker life and kind of memory (graft_fed_broker_memory_bytes): first and last
    value and the slope after the warm-up (MiB/min; counts per minute for threads and
    Python's blocks), to tell live C memory, heap kept free, SQLite and Python apart; with
    `window_s`, the same per window of age (`windows_of`)."""
    out = []
    for life in range(n_lives):
        mine = [{**s, "memory": with_derived(s["memory"])} for s in samples if s["life"] == life]
        if not mine:
            continue
        kinds = {}
        for kind in sorted({k for s in mine for k in s["memory"]} - set(CUMULATIVE)):
            scale = 1 if kind in COUNTS else 2**20
            pts = [(s["age"], s["memory"][kind] / scale) for s in mine if kind in s["memory"]]
            late = [p for p in pts if p[0] >= warmup_s]
            kinds[kind] = {"first": pts[0][1], "last": pts[-1][1], "slope_per_min_after_warmup": slope(late)}
            if window_s:
                kinds[kind]["windows"] = windows_of(late, warmup_s, window_s)
        out.append(kinds)
    return out


def rss_lives(samples: list[dict], n_lives: int, warmup_s: float, window_s: float = 120.0) -> list[dict]:
    """Per broker life: RSS first / max / last, the least-squares slope after its first minute,
    and over what follows its warm-up (`warmup_s` of its age): span, slope, max - min and the
    verdict. Flat: a window of at least FLAT_MIN_SPAN_S whose slope is at most FLAT_SLOPE of
    the window's mean RSS per minute (0.25%/min: about 1 MiB/min at 400 MiB, a leak that
    would grow the broker by 15% an hour)."""
    out = []
    for life in range(n_lives):
        pts = [(s["age"], s["rss_kib"] / 1024) for s in samples if s["life"] == life]
        if not pts:
            continue
        late = [p for p in pts if p[0] >= warmup_s]
        span = late[-1][0] - late[0][0] if late else 0.0
        mean = sum(b for _, b in late) / len(late) if late else NAN
        k, se = slope(late), slope_se(late)
        limit = FLAT_SLOPE * mean
        judged = span >= FLAT_MIN_SPAN_S
        windows = [{"from_s": w["from_s"], "to_s": w["to_s"], "mean_mib": w["mean"], "slope_mib_per_min": w["slope_per_min"]}
                   for w in windows_of(late, warmup_s, window_s)]
        out.append({"life": life, "samples": len(pts), "lasted_s": pts[-1][0], "first_mib": pts[0][1],
                    "max_mib": max(b for _, b in pts), "last_mib": pts[-1][1],
                    "slope_after_first_minute_mib_per_min": slope([p for p in pts if p[0] >= 60]),
                    "after_warmup": {"span_s": span, "slope_mib_per_min": k, "slope_se_mib_per_min": se,
                                     "flat_limit_mib_per_min": limit, "mean_mib": mean,
                                     "max_minus_min_mib": (max(b for _, b in late) - min(b for _, b in late))
                                     if late else NAN,
                                     "flat": abs(k) <= limit if judged else None,
                                     "decided": decided(k, se, limit) if judged else None,
                                     "windows": windows}})
    return out


def decided(k: float, se: float, limit: float) -> bool:
    """Whether the slope's interval of two standard errors either way lies wholly within
    the flat limit (flat, shown) or wholly beyond it (growing or shrinking, shown); when
    it straddles the limit the run cannot tell, whatever the slope's own value says."""
    if not all(math.isfinite(x) for x in (k, se, limit)):
        return False
    lo, hi = k - 2 * se, k + 2 * se
    return (-limit <= lo and hi <= limit) or lo > limit or hi < -limit


FLAT_MIN_SPAN_S = 120.0
WINDOW_S = 120.0  # the default of --window-s
QUEUE_WINDOW_S = 60.0  # the publish queue's windows (queue_windows)
FLAT_SLOPE = 0.0025
WINDOW_KINDS = ("malloc_in_use", "malloc_free", "heap_size", "anon_outside_heap", "sqlite", "process_threads",
                "python_allocated_blocks")


def markdown(payload: dict) -> str:
    a, info, v = payload["args"], payload["machine"], payload["verify"]
    lines = [f"### Broker load: {a['nodes']} nodes x {a['prompts']} summaries per round, {a['duration']:.0f} s, "
             "restart at " + ", ".join(f"{t:.0f}" for t in a["restart_at"]) + f" s ({info['date']})", "",
             machine_line(info) + f" Command: `{payload['command']}`.", "",
             f"- {'plaintext (no TLS: a diagnosis)' if a.get('plaintext') else 'mutual TLS'} on 127.0.0.1, "
             f"{a['procs']} node processes, broker defaults (sync, pairwise, SQLite "
             "WAL + synchronous=FULL)",
             ("- each node publishes its next round at once after its matches (the broker never rests)"
              if not a.get("train_s") else
              f"- each node waits {a['train_s']:g} s (its training) between its matches and its next publish"),
             *(["- each node reports on every group it was offered (ReportCompatibility) once it has its matches"]
               if a.get("reports") else []),
             f"- load average (1 min) during the run: min {payload['load']['min']:.2f}, median "
             f"{payload['load']['median']:.2f}, max {payload['load']['max']:.2f}",
             f"- broker restart: SIGKILL at {payload['restart']['killed_at_s']:.1f} s, listening again after "
             f"{payload['restart']['start_s']:.2f} s (process start + state open + quick_check on a "
             f"{payload['restart']['db_mib_at_restart']:.0f} MiB file); "
             f"{payload['restart']['publishes_acknowledged_after']:,} publishes acknowledged after it"
             + "".join(f"; then SIGKILL at {r['killed_at_s']:.1f} s, listening again after {r['start_s']:.2f} s "
                       f"({r['db_mib_at_restart']:.0f} MiB), {r['publishes_acknowledged_after']:,} publishes "
                       "acknowledged after it" for r in payload["restarts"][1:]),
             f"- rounds matched: {v['rounds_matched']}; rounds completed per node: min {payload['rounds']['min']}, "
             f"median {payload['rounds']['median']}, max {payload['rounds']['max']}",
             f"- summaries acknowledged: {v['acknowledged_summaries']:,}; held by the broker: {v['rows']:,} "
             f"({v['rows_never_acknowledged']:,} applied but never acknowledged: the publish in flight when "
             "the run ended)",
             f"- **lost: {v['lost']}**, "
             f"**duplicated: {v['duplicate_keys'] + v['extra_rows_in_acknowledged_rounds']}**, "
             f"nodes whose `published` count differs from the rows held: {len(v['published_count_mismatch'])}",
             f"- node retries after a failed call: {payload['retries']}; joins: {payload['joins']}", "",
             "| RPC (client side) | calls | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|"]
    for rpc, s in payload["latency"].items():
        lines.append(f"| {rpc} | {s['count']:,} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} |")
    hb, sim_per_proc = payload["heartbeats"], (a["nodes"] - len(payload["probe_nodes"])) / max(1, a["procs"])
    label = {"probe": f"probe: {len(payload['probe_nodes'])} node(s), each alone in its process",
             "simulated": f"simulated nodes: about {sim_per_proc:.0f} per process"}
    lines += ["", "Heartbeats by where they were sent from (a real node sends its heartbeats from its own process, "
              "like the probe; the simulated nodes' heartbeats also wait for their peers in the same interpreter). "
              f"'Outside restarts': sent before a SIGKILL or over {RESTART_WINDOW_S:.0f} s after the broker "
              "listened again.", "",
              "| heartbeats from | calls | failed | p50 ms | p90 ms | p99 ms | max ms | p99 outside restarts ms |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for who, h in hb.items():
        r, o = h["round_trip"], h["round_trip_outside_restarts"]
        lines.append(f"| {label[who]} | {h['calls']:,} | {h['failed']:,} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {r['max_ms']:.1f} | {o['p99_ms']:.1f} |")
    if any(h["timed_by_broker"] for h in hb.values()):
        lines += ["", "Where a heartbeat's time went (node and broker stamps, one clock): p50 / p99 of each "
                  "segment, and its mean over the slowest 1% of round trips:", "",
                  "| segment | probe p50 / p99 ms | probe slowest 1% mean ms | simulated p50 / p99 ms | "
                  "simulated slowest 1% mean ms |", "|---|---:|---:|---:|---:|"]
        for name in SEGMENTS:
            p_, s_ = hb["probe"]["segments"][name], hb["simulated"]["segments"][name]
            lines.append(f"| {name} | {p_['p50_ms']:.1f} / {p_['p99_ms']:.1f} | "
                         f"{hb['probe']['slowest_1pct_mean_ms'][name]:.1f} | {s_['p50_ms']:.1f} / {s_['p99_ms']:.1f} | "
                         f"{hb['simulated']['slowest_1pct_mean_ms'][name]:.1f} |")
    lines += ["", "Failed calls by RPC and status: " + (", ".join(f"{k} {v}" for k, v in
                                                               sorted(payload["errors"].items())) or "none") + ".",
              "", "Broker RSS (MiB) over time:", "", "| t (s) | broker life | RSS MiB | load avg |",
              "|---:|---:|---:|---:|"]
    samples = payload["rss"]
    step = max(1, len(samples) // 40)
    for s in samples[::step] + ([samples[-1]] if samples and (len(samples) - 1) % step else []):
        lines.append(f"| {s['t']:.1f} | {s['life']} | {s['rss_kib'] / 1024:.1f} | {s['load1']:.2f} |")
    flat = payload["rss_flat_after_warmup"]
    lines += ["", f"Broker RSS per life (warm-up: the first {a['warmup_s']:.0f} s of a life; flat: at least "
              f"{FLAT_MIN_SPAN_S:.0f} s after it, with a least-squares slope of at most {100 * FLAT_SLOPE:.2f}% of "
              "the mean RSS per minute; shown: the slope's interval of two standard errors either way, its samples' "
              "autocorrelation allowed for, on one side of that limit):", "",
              *rss_table(payload["rss_per_life"])]
    if payload.get("service_rss_per_life"):
        lines += ["", "The broker and its child processes together (the front, `front_process: true`, which holds "
                  "gRPC core's memory; the broker's figures above leave it out), judged the same way; the verdict "
                  "below is on these:", "", *rss_table(payload["service_rss_per_life"])]
    if payload.get("memory_per_life"):
        kinds = sorted({k for life in payload["memory_per_life"] for k in life})
        lines += ["", "Where the broker's memory is, per life (`graft_fed_broker_memory_bytes{kind}` and counts from "
                  f"its /metrics every {a['memory_s']:.0f} s): first -> last, and the slope after the warm-up "
                  "(MiB/min; per minute for the counts):", "",
                  "| kind | " + " | ".join(f"life {i}" for i in range(len(payload["memory_per_life"]))) + " |",
                  "|---|" + "---:|" * len(payload["memory_per_life"])]
        for kind in kinds:
            cells = []
            for life in payload["memory_per_life"]:
                m = life.get(kind)
                cells.append("-" if m is None else f"{m['first']:.1f} -> {m['last']:.1f} "
                             f"({m['slope_per_min_after_warmup']:+.2f}/min)")
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    windowed = [(l["life"], l["after_warmup"].get("windows")) for l in payload["rss_per_life"]]
    window_s = payload.get("window_s", WINDOW_S)
    if any(w for _, w in windowed):
        lines += ["", f"RSS after the warm-up in windows of {window_s:.0f} s of a life's age (does the slope settle?):",
                  "", "| life | window s | mean MiB | slope MiB/min |", "|---:|---|---:|---:|"]
        for i, ws in windowed:
            for w in ws or []:
                lines.append(f"| {i} | {w['from_s']:.0f}-{w['to_s']:.0f} | {w['mean_mib']:.1f} | "
                             f"{w['slope_mib_per_min']:.2f} |")
    for i, life in enumerate(payload.get("memory_per_life") or []):
        kinds = [k for k in WINDOW_KINDS if life.get(k, {}).get("windows")]
        if not kinds:
            continue
        lines += ["", f"Memory by kind in the same windows, life {i}: the value at the window's end (slope per "
                      "minute; MiB, counts for threads and blocks):", "",
                  "| window s | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
        for j, w in enumerate(life[kinds[0]]["windows"]):
            cells = []
            for k in kinds:
                ws = life[k]["windows"]
                cells.append(f"{ws[j]['last']:.1f} ({ws[j]['slope_per_min']:+.2f})" if j < len(ws) else "-")
            lines.append(f"| {w['from_s']:.0f}-{w['to_s']:.0f} | " + " | ".join(cells) + " |")
    for i, rows in enumerate(payload.get("publish_queue_per_life") or []):
        if not rows:
            continue
        lines += ["", f"The publish queue, life {i}, in windows of {QUEUE_WINDOW_S:.0f} s of its age (from the "
                      "broker's /metrics counters): publishes run, the mean batch, the share of the wall time its "
                      "thread spent running batches, its work and the mean wait per publish, the broker's whole "
                      "PublishSummaries time per call, and the publishes waiting when sampled:", "",
                  "| age s | publishes | per s | mean batch | thread busy | work ms / publish | wait ms | "
                  "PublishSummaries ms | waiting (mean) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['from_s']:.0f}-{r['to_s']:.0f} | {r['publishes']:.0f} | {r['per_s']:.1f} | "
                         f"{r['mean_batch']:.1f} | {r['busy']:.2f} | {r['work_ms']:.2f} | {r['wait_ms']:.1f} | "
                         f"{r['rpc_ms']:.1f} | {r['waiting_mean']:.1f} |")
    lines += ["", "**RSS flat after warm-up: " + ("not shown (no life lasted long enough past its warm-up)"
                                                  if flat is None else verdict(flat, payload["rss_verdict_decided"]))
              + "**", ""]
    return "\n".join(lines)


def rss_table(lives: list[dict]) -> list[str]:
    """rss_lives' summaries as a markdown table, a row per life."""
    lines = ["| life | lasted s | first MiB | max MiB | last MiB | slope after 1st minute MiB/min | after warm-up: "
             "span s | slope MiB/min (± 2 SE) | flat limit MiB/min | max - min MiB | flat |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for l in lives:
        w = l["after_warmup"]
        judged = (f"{w['slope_mib_per_min']:.2f} (± {2 * w['slope_se_mib_per_min']:.2f}) | "
                  f"{w['flat_limit_mib_per_min']:.2f} | {w['max_minus_min_mib']:.1f}"
                  if w["flat"] is not None else "- | - | -")
        lines.append(f"| {l['life']} | {l['lasted_s']:.0f} | {l['first_mib']:.1f} | {l['max_mib']:.1f} | {l['last_mib']:.1f} | "
                     f"{l['slope_after_first_minute_mib_per_min']:.2f} | {w['span_s']:.0f} | {judged} | "
                     f"{verdict(w['flat'], w['decided'])} |")
    return lines


def verdict(flat: bool | None, shown: bool | None) -> str:
    """A flat verdict in words: yes / no, and whether the slope's uncertainty lets the run
    tell (`decided`)."""
    if flat is None:
        return "-"
    if shown is not False:  # shown, or not judged for its uncertainty
        return "yes" if flat else "no"
    return (f"not shown (the slope is {'within' if flat else 'beyond'} the limit, but its ± 2 SE interval "
            "straddles it)")


def per_life(payload: dict, n_lives: int, warmup_s: float, window_s: float) -> None:
    """The payload's per-life summaries (rss_per_life, memory_per_life) at windows of
    `window_s`; a width other than the default is recorded and reports memory by kind per
    window too, so that the default's report stays as it was."""
    payload.pop("window_s", None)
    if window_s != WINDOW_S:
        payload["window_s"] = window_s
    payload["rss_per_life"] = rss_lives(payload["rss"], n_lives, warmup_s, window_s)
    judged_lives = payload["rss_per_life"]
    payload.pop("service_rss_per_life", None)
    if any("children_rss_kib" in s for s in payload["rss"]):
        # a broker with child processes (the front) is judged on all of them: gRPC core's
        # memory lives in the front there, out of the broker process's own RSS
        together = [{**s, "rss_kib": s["rss_kib"] + s["children_rss_kib"]} for s in payload["rss"]
                    if "children_rss_kib" in s]
        judged_lives = payload["service_rss_per_life"] = rss_lives(together, n_lives, warmup_s, window_s)
    judged = [life["after_warmup"] for life in judged_lives if life["after_warmup"]["flat"] is not None]
    payload["rss_flat_after_warmup"] = all(w["flat"] for w in judged) if judged else None
    # shown when every judged life's interval is on one side of the limit, or (for "no") when
    # one life shows growth
    payload["rss_verdict_decided"] = (all(w["decided"] for w in judged) or any(
        w["decided"] and not w["flat"] for w in judged)) if judged else None
    payload["memory_per_life"] = memory_lives(payload.get("memory", []), n_lives, warmup_s,
                                              window_s if window_s != WINDOW_S else 0.0)
    payload["publish_queue_per_life"] = queue_windows(payload.get("memory", []), n_lives, QUEUE_WINDOW_S)


def render(path: Path, window_s: float | None = None, out: Path | None = None) -> int:
    """Recompute a result's per-life summaries from its samples and write its report (to
    `out`, by default the result's .md), with windows of `window_s` (default: the run's)."""
    payload = json.loads(path.read_text(encoding="utf-8"))
    a = payload["args"]
    a.setdefault("memory_s", 10.0)
    n_lives = 1 + max((s["life"] for s in payload["rss"]), default=0)
    per_life(payload, n_lives, a["warmup_s"], window_s or payload.get("window_s", WINDOW_S))
    md = markdown(payload)
    (out or path.with_suffix(".md")).write_text(md, encoding="utf-8")
    print(md)
    return 0


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256, help="summaries per node and round")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--restart-at", type=float, nargs="*", default=None,
                    help="SIGKILL + restart the broker at each of these seconds (default: half the duration; "
                         "< 0 = never)")
    ap.add_argument("--procs", type=int, default=4, help="node worker processes (nodes are threads in them)")
    ap.add_argument("--probes", type=int, default=1,
                    help="of the nodes, how many run each alone in a process of their own (a real node's "
                         "heartbeats leave its own process); their heartbeats are reported apart")
    ap.add_argument("--warmup-s", type=float, default=300.0,
                    help="a broker life's warm-up for the RSS verdict: the broker's replay_window_s (its memory "
                         "of request ids fills for that long)")
    ap.add_argument("--sample-s", type=float, default=2.0, help="RSS / load sampling interval")
    ap.add_argument("--memory-s", type=float, default=10.0,
                    help="interval of reading the broker's memory by kind from its /metrics (0: never)")
    ap.add_argument("--rpc-timeout-s", type=float, default=30.0)
    ap.add_argument("--match-wait-s", type=float, default=10.0)
    ap.add_argument("--train-s", type=float, default=0.0,
                    help="seconds each node waits between a round's matches and its next publish, as a node "
                         "training would (0: none, every node publishes again at once and the broker never rests)")
    ap.add_argument("--reports", action="store_true",
                    help="each node reports on every group it was offered once it has its matches, as real nodes do")
    ap.add_argument("--backoff-cap-s", type=float, default=5.0, help="longest wait between a node's retries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="load", help="results file stem")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--broker-env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="environment of the broker process only (e.g. MALLOC_ARENA_MAX=2)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="broker_set",
                    help="broker settings over the bench's (a YAML value each), e.g. malloc_trim_s=0")
    ap.add_argument("--plaintext", action="store_true",
                    help="no TLS: the broker on loopback without certificates, the nodes on plaintext channels "
                         "(a diagnosis of what mutual TLS costs; the targets are over mutual TLS)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (certs, db, broker.log)")
    ap.add_argument("--render", metavar="JSON",
                    help="run nothing: recompute the per-life summaries of a result file from its samples and "
                         "write its .md again (for results written by an older load.py)")
    ap.add_argument("--window-s", type=positive_seconds, default=None,
                    help=f"width of the windows of age the RSS slope is reported in after the warm-up (default "
                         f"{WINDOW_S:.0f}); other than the default, memory by kind is reported in them too")
    ap.add_argument("--render-to", metavar="MD", help="with --render: write the report there instead of the .md")
    args = ap.parse_args(argv)
    if args.render:
        return render(Path(args.render), args.window_s, Path(args.render_to) if args.render_to else None)
    restart_at = [args.duration / 2] if args.restart_at is None else args.restart_at
    info = machine()
    from graft_fed.configbase import parse_overrides
    from graft_fed.data.config import DataConfig, load_prompts
    from graft_fed.errors import ConfigError
    from graft_fed.federation import certs
    from graft_fed.federation.manifest import PROTOCOL_VERSION, dataset_hash, verifier_version
    from graft_fed.rewards.config import VerifierConfig

    work = Path(tempfile.mkdtemp(prefix="graft-load-"))
    print(f"work directory {work}", flush=True)
    certs.loopback_pki(work / "certs", "load", [f"node{i:02d}" for i in range(args.nodes)])
    prompts_path = write_prompts(work / "prompts.jsonl", args.prompts)
    prompts = load_prompts(DataConfig(source=str(prompts_path)))
    port = free_port()
    db = work / "broker.sqlite"
    c = work / "certs"
    http = f"127.0.0.1:{free_port()}" if args.memory_s > 0 else ""
    cfg = {"listen": f"127.0.0.1:{port}", "http": http, "db": str(db), "data": {"source": str(prompts_path)},
           "verifier": {"name": VERIFIER}, "seed": args.seed, "n": GROUP_N, "prompts_per_round": args.prompts,
           "tls_cert": str(c / "broker.pem"), "tls_key": str(c / "broker.key"), "client_ca": str(c / "ca.pem")}
    if args.plaintext:  # a diagnosis: what TLS (OpenSSL, 256 connections) adds to the broker's memory and time
        for key in ("tls_cert", "tls_key", "client_ca"):
            del cfg[key]
    if args.nodes > 90:  # one waiting GetMatches per node must fit (docs/deploy.md, "What one broker holds")
        cfg["max_long_polls"] = args.nodes + 8
        cfg["max_workers"] = args.nodes + 64
    cfg_path = work / "broker.yaml"
    try:
        cfg.update(parse_overrides(args.broker_set))  # as `graft-fed broker --set` reads them
    except ConfigError as exc:
        ap.error(str(exc))
    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
    manifest = {"federation_id": "graft-fed", "protocol_version": PROTOCOL_VERSION,
                "dataset_id": prompts[0].dataset, "dataset_hash": dataset_hash(prompts), "seed": args.seed,
                "n": GROUP_N, "prompts_per_round": args.prompts, "mode": "sync", "verifier_name": VERIFIER,
                "verifier_version": verifier_version(VerifierConfig(name=VERIFIER)), "staleness_rounds": 4,
                "advantage": "group/sample"}

    broker = Broker(cfg_path, work, dict(e.split("=", 1) for e in args.broker_env))
    samples: list[dict] = []
    memory: list[dict] = []
    stop_sampling = threading.Event()
    procs: list = []
    try:
        broker.start()

        def sample() -> None:
            while not stop_sampling.is_set():
                proc = broker.proc
                if proc is not None and proc.poll() is None:
                    kib = rss_kib(proc.pid)
                    if kib is not None:
                        now = time.monotonic()
                        samples.append({"t": now - t_start, "life": len(broker.lives) - 1,
                                        "age": now - broker.lives[-1]["t0"], "rss_kib": kib,
                                        "load1": os.getloadavg()[0]})
                        kids = children_rss_kib(proc.pid)
                        if kids is not None:
                            samples[-1]["children_rss_kib"] = kids
                    if http and (not memory or now - t_start - memory[-1]["t"] >= args.memory_s):
                        got = scrape_memory(http)
                        if got is not None and proc is broker.proc:
                            memory.append({"t": now - t_start, "life": len(broker.lives) - 1,
                                           "age": now - broker.lives[-1]["t0"], "memory": got})
                stop_sampling.wait(args.sample_s)

        sampler = threading.Thread(target=sample, daemon=True)
        ctx = {"address": f"127.0.0.1:{port}", "certs": str(c), "prompt_ids": [p.id for p in prompts],
               "manifest": manifest, "rpc_timeout_s": args.rpc_timeout_s, "match_wait_s": args.match_wait_s,
               "backoff_cap_s": args.backoff_cap_s, "seed": args.seed, "plaintext": args.plaintext,
               "train_s": args.train_s, "reports": args.reports}
        mpctx = mp.get_context("spawn")
        queue, go, end = mpctx.Queue(), mpctx.Event(), mpctx.Value("d", 0.0)
        # the last `--probes` nodes each run alone in a process, as a real node does; the
        # others share `--procs` processes
        n_probes = min(args.probes, args.nodes)
        shared = list(range(args.nodes - n_probes))
        shares = [shared[k::args.procs] for k in range(args.procs)] + [[i] for i in range(len(shared), args.nodes)]
        procs += [mpctx.Process(target=worker, args=(share, ctx, queue, go, end), daemon=True)
                  for share in shares if share]
        for p in procs:
            p.start()
        for _ in procs:
            assert queue.get(timeout=300) == "ready"
        t_start = time.monotonic()  # the clock starts when every node process is ready
        end.value = time.time() + args.duration
        go.set()
        sampler.start()
        restarts = []
        for at in sorted(t for t in restart_at if 0 <= t < args.duration):
            restart = {"killed_at_s": float("nan"), "start_s": float("nan"), "db_mib_at_restart": float("nan"),
                       "killed_at_unix": float("nan")}
            time.sleep(max(0.0, at - (time.monotonic() - t_start)))
            restart["killed_at_s"] = time.monotonic() - t_start
            restart["killed_at_unix"] = time.time()
            broker.kill()
            restart["db_mib_at_restart"] = sum(os.path.getsize(p) for p in work.glob("broker.sqlite*")) / 2**20
            restart["start_s"] = broker.start()
            restarts.append(restart)
            print(f"broker SIGKILLed at {restart['killed_at_s']:.1f} s, listening again after "
                  f"{restart['start_s']:.2f} s", flush=True)
        if not restarts:
            restarts.append({"killed_at_s": float("nan"), "start_s": float("nan"), "db_mib_at_restart": float("nan"),
                             "killed_at_unix": float("nan")})
        restart = restarts[0]
        nodes: dict = {}
        deadline = time.monotonic() + args.duration + 4 * args.rpc_timeout_s + 120
        for _ in procs:
            nodes.update(queue.get(timeout=max(1.0, deadline - time.monotonic())))
        for p in procs:
            p.join(timeout=30)
        stop_sampling.set()
        sampler.join(timeout=10)
    finally:  # whatever happened, no broker or node process outlives the run
        stop_sampling.set()
        for p in procs:
            if p.is_alive():
                p.terminate()
        code = broker.stop()
        broker.log.close()
    v = verify(db, nodes, args.prompts)
    for r_ in restarts:
        r_["publishes_acknowledged_after"] = sum(1 for r in nodes.values() for a in r["acked"].values()
                                                 if a[2] > r_["killed_at_unix"])
    summaries = {"rss": samples, "memory": memory}
    per_life(summaries, len(broker.lives), args.warmup_s, args.window_s or WINDOW_S)
    probe_names = {f"node{i:02d}" for i in range(args.nodes - min(args.probes, args.nodes), args.nodes)}
    heartbeats = {}
    for who, names in (("probe", probe_names), ("simulated", set(nodes) - probe_names)):
        heartbeats[who] = heartbeat_split([b for n in names if n in nodes for b in nodes[n]["beats"]],
                                          [b for n in names if n in nodes for b in nodes[n]["failed_beats"]], restarts)
    loads = sorted(s["load1"] for s in samples) or [float("nan")]
    rounds = sorted(r["rounds_ready"] for r in nodes.values()) or [0]
    errors: Counter[str] = Counter()
    for r in nodes.values():
        errors.update(r["errors"])
    payload = {
        "machine": info, "command": " ".join(["bench/broker/load.py", *(argv if argv is not None else sys.argv[1:])]),
        "args": {**vars(args), "restart_at": restart_at}, "broker_exit_code": code, "restart": restart, "restarts": restarts,
        "verify": v, "latency": summarise_latencies(nodes), "errors": dict(errors),
        "rounds": {"min": rounds[0], "median": rounds[len(rounds) // 2], "max": rounds[-1]},
        "retries": sum(r["retries"] for r in nodes.values()), "joins": sum(r["joins"] for r in nodes.values()),
        "load": {"min": loads[0], "median": loads[len(loads) // 2], "max": loads[-1]},
        **summaries, "nodes_reporting": len(nodes),
        "heartbeats": heartbeats, "probe_nodes": sorted(probe_names),
        "probe_beats": {n: nodes[n]["beats"] for n in sorted(probe_names) if n in nodes},
        "wall_s": time.monotonic() - t_start,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(payload)
    (out_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    (out_dir / f"{args.name}.md").write_text(md, encoding="utf-8")
    print(md)
    print(f"wrote {out_dir / args.name}.json and .md")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    ok = (v["lost"] == 0 and v["duplicate_keys"] == 0 and v["extra_rows_in_acknowledged_rounds"] == 0
          and len(nodes) == args.nodes)
    if not ok:
        print("FAILED: " + json.dumps({k: v[k] for k in ("lost", "lost_where", "duplicate_keys")}) +
              f", {len(nodes)} of {args.nodes} nodes reported", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
