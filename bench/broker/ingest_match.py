"""Broker ingest rate and match latency for N simulated nodes and P prompts per round.

A real BrokerServer (SqliteState in a temp dir, or `--db memory`) runs in a child process
on 127.0.0.1:0 (its own GIL, as a deployed broker has); N node threads, each its own
BrokerClient, join and, for R rounds, publish P summaries each (random k in 0..n, n = 8,
k drawn from --k-mix: by default 30% all-fail, 50% informative, 20% all-pass, as real rounds have;
random lengths and negative mean log-probs) at a barrier, then long-poll GetMatches until
the round is ready.

- ingest: summaries accepted / (first publish sent .. last publish acknowledged), per round,
  aggregated over rounds.
- match latency: last publish acknowledged .. each node's GetMatches returning ready=true
  (the broker matches the round inside the first GetMatches that finds it complete). The
  node threads call the stub and let protobuf parse the answer; they do not build Python
  objects per offer (64 threads share this process's interpreter, a real node does not).
- baseline, same run, same cell: a no-op unary gRPC server (generic handler, bytes in, a
  2-byte ack out, same thread pool and channel options) in a child process receiving the
  same serialized PublishRequest bytes from the same N threads at the same barrier, run
  before the broker and again after it (the cell's raw figure pools both: this machine's
  speed drifts within a minute, and a raw run of 64 x 4,096 lasts half a second).
  ratio = broker ingest / raw gRPC throughput.

    .venv/bin/python bench/broker/ingest_match.py            # full grid, ~5 min budget
    .venv/bin/python bench/broker/ingest_match.py --quick    # tiny grid
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from _common import K_MIX, RAW_SERVICE, ChildServer, add_broker_set, broker_sets, machine, machine_line, make_summaries, percentile, run_threads, stack_summary, write_prompts, write_results  # noqa: E402
from graft_fed.federation.codec import columns_to_pb  # noqa: E402
from graft_fed.federation.transport import TIMING_KEY, grpc_options, parse_timing  # noqa: E402
from graft_fed.data.config import DataConfig, load_prompts  # noqa: E402
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version  # noqa: E402
from graft_fed.node.client import BrokerClient, new_tag  # noqa: E402
from graft_fed.proto import broker_pb2 as pb  # noqa: E402
from graft_fed.rewards.config import VerifierConfig  # noqa: E402

GROUP_N = 8
FIXED_S = 8.0  # two child servers started and stopped, joins, request building
VERIFIER = "math_verify"


class Barrier:
    def __init__(self, n: int, timeout: float) -> None:
        self.b = threading.Barrier(n, timeout=timeout)

    def wait(self) -> None:
        self.b.wait()


def _timed(method, request, timeout_s: float, timing: bool) -> tuple:
    """(answer, its times or None): with `timing`, the call asks the broker for its times
    (TIMING_KEY) and returns (sent, picked, entered, left, received) in Unix seconds, the
    first and last by this process's clock, the others by the broker's (one machine)."""
    if not timing:
        return method(request, timeout=timeout_s), None
    sent = time.time()
    answer, call = method.with_call(request, timeout=timeout_s, metadata=((TIMING_KEY, "1"),))
    received = time.time()
    broker = parse_timing(call.trailing_metadata())
    return answer, None if broker is None else (sent, *broker, received)


def run_node(c: BrokerClient, i: int, requests: list[pb.PublishRequest], rounds: int, barrier, timeout_s: float,
             out: dict, timing: bool = False, reports: bool = False) -> None:
    """One simulated node's rounds: publish at the barrier, then long-poll until matched; with
    `reports`, then, once every node has its answer, report on every group offered (what a
    node does once it has scored them)."""
    for r in range(rounds):
        req = requests[r]
        req.session_id = c.session
        req.tag.CopyFrom(new_tag())  # replay protection: fresh id and send time per request
        barrier.wait()
        out["t_send"][r][i] = time.perf_counter()
        sent = time.monotonic()
        resp, out["publish_times"][r][i] = _traced(f"{c.node_id} round {r} PublishSummaries", out["t_send"][r][i],
                                                   lambda: _timed(c.stub.PublishSummaries, req, timeout_s, timing))
        out["t_ack"][r][i] = time.perf_counter()
        c.answered("PublishSummaries", sent)  # what BrokerClient.publish does: no heartbeat needed for a while
        out["accepted"][r][i] = resp.accepted
        while True:
            out["polls"][r][i] += 1
            # the raw stub: the answer parsed by protobuf (C), not turned into Python Offer
            # objects, so that node threads sharing a process's GIL do not add their
            # decoding to each other's latency (a real node is a process)
            ask = pb.MatchRequest(node_id=c.node_id, session_id=c.session, round=r, wait_ms=30000)
            sent = time.monotonic()
            m, out["match_times"][r][i] = _traced(f"{c.node_id} round {r} GetMatches #{out['polls'][r][i]}",
                                                  out["t_send"][r][i],
                                                  lambda: _timed(c.stub.GetMatches, ask, timeout_s, timing))
            c.answered("GetMatches", sent)
            if m.ready:
                break
        out["t_ready"][r][i] = time.perf_counter()
        out["offers"][r][i] = len(m.offers)
        if reports:
            # a node reports once it has fetched and scored the groups, after its training
            # step: seconds to minutes after the answer, so after every node has its answer
            barrier.wait()
        if reports and m.offers:
            out["report_s"][r][i] = _traced(f"{c.node_id} round {r} ReportCompatibility", out["t_send"][r][i],
                                            lambda: _report(c, r, m.offers, timeout_s))


def _report(c: BrokerClient, r: int, offers, timeout_s: float) -> float:
    """Report on every offered group (a made-up score, none rejected); the call's seconds."""
    rng = random.Random(f"{c.node_id}/{r}")
    req = pb.CompatibilityReport(node_id=c.node_id, session_id=c.session, round=r, tag=new_tag(), entries=[
        pb.CompatibilityReport.Entry(source_node_id=o.source_node_id, prompt_id=o.prompt_id,
                                     mean_s=rng.uniform(0.2, 2.0), admitted_fraction=rng.random())
        for o in offers])
    t0 = time.perf_counter()
    c.stub.ReportCompatibility(req, timeout=timeout_s)
    return time.perf_counter() - t0


def _traced(what: str, t_round: float, call):
    """call(), a failure re-raised with the call, the node, the round and the seconds since the
    node sent its publish (a gRPC error alone says none of these)."""
    try:
        return call()
    except grpc.RpcError as exc:
        raise RuntimeError(f"{what} failed {time.perf_counter() - t_round:.1f} s after its publish was sent: "
                           f"{exc.code().name} {exc.details()!r}") from None


class _ProcessBarrier:
    """The barrier of one client process's node threads, whose last arrival also waits for
    every other client process (through the parent: "arrived", then "go"), so that no
    semaphore is shared by a thousand threads of eight processes. run_threads aborts `.b`
    when a node fails; a thread still on its way out of the barrier then raises
    BrokenBarrierError and never publishes (what made 1,000 x 128 look as if the barrier
    kept threads asleep: calls refused before they reached the broker, issue 13)."""

    def __init__(self, count: int, conn) -> None:
        self.conn = conn
        self.b = threading.Barrier(count, action=self._all_processes)

    def _all_processes(self) -> None:
        self.conn.send("arrived")
        if self.conn.recv() != "go":
            raise threading.BrokenBarrierError

    def wait(self) -> None:
        self.b.wait()


def _client_proc(conn, address: str, ids: list[int], payloads: list[list[bytes]], rounds: int, manifest: Manifest,
                 timeout_s: float, timing: bool = False, reports: bool = False) -> None:
    """Child process: the nodes `ids`, each a thread with its own channel and heartbeat
    thread. Reports the sessions after joining, waits for "go", reports the timings
    (time.perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process)."""
    clients = {i: BrokerClient(address, f"node{i:02d}", rpc_timeout_s=timeout_s) for i in ids}
    out = {key: [dict() for _ in range(rounds)] for key in ("t_send", "t_ack", "t_ready", "accepted", "polls",
                                                             "offers", "publish_times", "match_times",
                                                             "report_s")}
    for key in ("accepted", "polls", "offers"):
        for per in out[key]:
            per.update({i: 0 for i in ids})
    try:
        for i, c in clients.items():
            c.join(f"model{i}", "tok", manifest, "share_all", 0)
        conn.send({f"node{i:02d}": c.session for i, c in clients.items()})
        requests = {i: [pb.PublishRequest.FromString(b) for b in payloads[k]] for k, i in enumerate(ids)}
        order = list(ids)
        shared = _ProcessBarrier(len(order), conn)
        every = float(os.environ.get("GRAFT_BENCH_PROGRESS_S", "0"))
        if every > 0:
            def progress() -> None:
                t0 = time.monotonic()
                while True:
                    time.sleep(every)
                    print(f"[clients {ids[0]} +{time.monotonic() - t0:.0f}s] sent/acked/ready per round "
                          f"{[(len([v for v in out['t_send'][r].values() if v]), len([v for v in out['t_ack'][r].values() if v]), len([v for v in out['t_ready'][r].values() if v])) for r in range(rounds)]}",
                          file=sys.stderr, flush=True)
                    if os.environ.get("GRAFT_BENCH_STACKS_AT_S") and time.monotonic() - t0 >= float(
                            os.environ["GRAFT_BENCH_STACKS_AT_S"]):
                        stack_summary(f"clients {ids[0]} stacks")
                        os.environ.pop("GRAFT_BENCH_STACKS_AT_S")
            threading.Thread(target=progress, daemon=True).start()
        run_threads(lambda k: run_node(clients[order[k]], order[k], requests[order[k]], rounds, shared, timeout_s, out,
                                       timing, reports), len(order), timeout_s * rounds, shared)
        conn.send(out)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent (as text: gRPC errors do not pickle)
        conn.send(RuntimeError(f"client process of nodes {ids[0]}.. failed: {exc!r}"[:2000]))
    finally:
        for c in clients.values():
            c.close()


def run_client_procs(address: str, n_nodes: int, procs: int, requests: list[list[pb.PublishRequest]], rounds: int,
                     manifest: Manifest, timeout_s: float, prober_client: BrokerClient, probe, hb_stop,
                     timing: bool = False, reports: bool = False) -> list[dict]:
    """The nodes spread over `procs` spawned processes (node i in process i % procs)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    children = []
    for p in range(procs):
        ids = list(range(p, n_nodes, procs))
        mine, theirs = ctx.Pipe()
        payloads = [[req.SerializeToString() for req in requests[i]] for i in ids]
        proc = ctx.Process(target=_client_proc, args=(theirs, address, ids, payloads, rounds, manifest, timeout_s, timing,
                                                         reports),
                           daemon=True)
        proc.start()
        children.append((proc, mine))
    try:
        sessions = {}
        for proc, conn in children:
            got = conn.recv() if conn.poll(timeout_s) else RuntimeError("a client process did not join")
            if isinstance(got, Exception):
                raise got
            sessions.update(got)
        prober_client.session = sessions["node00"]
        prober = threading.Thread(target=probe, args=(prober_client,), daemon=True)
        prober.start()
        try:
            for _ in range(rounds * (2 if reports else 1)):  # every process's nodes at their barrier, then all go
                for proc, conn in children:
                    got = conn.recv() if conn.poll(timeout_s) else RuntimeError("a client process timed out")
                    if isinstance(got, Exception):
                        raise got
                for _, conn in children:
                    conn.send("go")
            results = []
            for proc, conn in children:
                got = conn.recv() if conn.poll(timeout_s * rounds) else RuntimeError("a client process timed out")
                if isinstance(got, Exception):
                    raise got
                results.append(got)
        finally:
            hb_stop.set()
            prober.join(timeout=timeout_s)
        return results
    finally:
        for proc, _ in children:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def run_broker_cell(n_nodes: int, n_prompts: int, rounds: int, db: str, tmp: Path, seed: int,
                    requests: list[list[pb.PublishRequest]], prompts_path: Path, cell_timeout_s: float,
                    liveness: bool = False, overrides: dict | None = None, client_procs: int = 1,
                    timing: bool = False, reports: bool = False) -> dict:
    cfg = {"listen": "127.0.0.1:0", "http": "", "db": db, "data": {"source": str(prompts_path)},
           "verifier": {"name": VERIFIER}, "seed": seed, "n": GROUP_N, "prompts_per_round": n_prompts,
           "mode": "sync", "round_deadline_s": 3600.0, "heartbeat_interval_s": 2.0, "offline_after_s": 3600.0}
    if liveness:  # the broker's defaults (2 s heartbeats, offline after 15 s): a slow broker marks nodes offline
        cfg["offline_after_s"] = 15.0
    if n_nodes > 90:  # one waiting GetMatches per node must fit, with threads to spare for the rest
        cfg["max_long_polls"] = n_nodes + 8
        cfg["max_workers"] = n_nodes + 64
    cfg.update(overrides or {})
    server = ChildServer("broker", cfg=cfg)
    prompts = load_prompts(DataConfig(source=str(prompts_path)))
    manifest = Manifest(federation_id="graft-fed", protocol_version=PROTOCOL_VERSION, dataset_id=prompts[0].dataset,
                        dataset_hash=dataset_hash(prompts), seed=seed, n=GROUP_N, prompts_per_round=n_prompts,
                        mode="sync", verifier_name=VERIFIER,
                        verifier_version=verifier_version(VerifierConfig(name=VERIFIER)), staleness_rounds=4, advantage="group/sample")
    t_send = [[0.0] * n_nodes for _ in range(rounds)]
    t_ack = [[0.0] * n_nodes for _ in range(rounds)]
    t_ready = [[0.0] * n_nodes for _ in range(rounds)]
    accepted = [[0] * n_nodes for _ in range(rounds)]
    polls = [[0] * n_nodes for _ in range(rounds)]
    offers = [[0] * n_nodes for _ in range(rounds)]
    out = {"t_send": t_send, "t_ack": t_ack, "t_ready": t_ready, "accepted": accepted, "polls": polls,
           "offers": offers, "publish_times": [[None] * n_nodes for _ in range(rounds)],
           "match_times": [[None] * n_nodes for _ in range(rounds)],
           "report_s": [[None] * n_nodes for _ in range(rounds)]}
    hb_lat: list[float] = []
    hb_online: list[int] = []
    hb_stop = threading.Event()

    def probe(c: BrokerClient) -> None:
        # Heartbeats sampled every 50 ms through the whole cell (publishes and matching
        # included): what a node's liveness waits for while the broker is busy. The online
        # count is taken from 1 s on: the broker caches it for 0.5 s, and the first answers
        # may still count the joins of the moment before.
        t_start = time.perf_counter()
        while not hb_stop.wait(0.05):
            t0 = time.perf_counter()
            try:
                resp = c.stub.Heartbeat(pb.HeartbeatRequest(node_id=c.node_id, session_id=c.session, round=0,
                                                            tag=new_tag()), timeout=cell_timeout_s)
            except grpc.RpcError:
                continue
            hb_lat.append(time.perf_counter() - t0)
            if t0 - t_start >= 1.0:
                hb_online.append(resp.online_nodes)

    try:
        if client_procs <= 1:
            clients = [BrokerClient(server.address, f"node{i:02d}", rpc_timeout_s=cell_timeout_s) for i in range(n_nodes)]
            barrier = Barrier(n_nodes, timeout=cell_timeout_s)
            try:
                for i, c in enumerate(clients):
                    c.join(f"model{i}", "tok", manifest, "share_all", 0)
                prober = threading.Thread(target=probe, args=(clients[0],), daemon=True)
                prober.start()
                try:
                    run_threads(lambda i: run_node(clients[i], i, requests[i], rounds, barrier, cell_timeout_s, out,
                                                   timing, reports), n_nodes, cell_timeout_s * rounds, barrier)
                finally:
                    hb_stop.set()
                    prober.join(timeout=cell_timeout_s)
            finally:
                for c in clients:
                    c.close()
        else:
            prober_client = BrokerClient(server.address, "node00", rpc_timeout_s=cell_timeout_s)
            try:
                results = run_client_procs(server.address, n_nodes, client_procs, requests, rounds, manifest,
                                           cell_timeout_s, prober_client, probe, hb_stop, timing, reports)
            finally:
                prober_client.close()
            for res in results:
                for key, per_round in res.items():
                    for r, values in enumerate(per_round):
                        for i, v in values.items():
                            out[key][r][i] = v
        stats = server.rpc_stats()
    finally:
        server.stop()
    windows = [max(t_ack[r]) - min(t_send[r]) for r in range(rounds)]
    total = sum(sum(a) for a in accepted)
    lat = [t_ready[r][i] - max(t_ack[r]) for r in range(rounds) for i in range(n_nodes)]
    publish_lat = [t_ack[r][i] - t_send[r][i] for r in range(rounds) for i in range(n_nodes)]
    report_lat = [x for per in out["report_s"] for x in per if x is not None]
    reported = {"reports": len(report_lat), "report_p50_s": percentile(report_lat, 50),
                "report_p99_s": percentile(report_lat, 99), "report_max_s": max(report_lat),
                "match_p99_s_per_round": [percentile(lat[r * n_nodes:(r + 1) * n_nodes], 99) for r in range(rounds)]
                } if report_lat else {}
    return {"summaries": total, "ingest_per_s": total / sum(windows), "windows_s": windows,
            "match_p50_s": percentile(lat, 50), "match_p99_s": percentile(lat, 99), "match_max_s": max(lat),
            "publish_p50_s": percentile(publish_lat, 50), "publish_p99_s": percentile(publish_lat, 99),
            "round_s": [max(t_ready[r]) - min(t_send[r]) for r in range(rounds)],
            "getmatches_calls": sum(sum(p) for p in polls), "offers": sum(sum(o) for o in offers),
            "heartbeats": len(hb_lat), "heartbeat_p50_s": percentile(hb_lat, 50),
            "heartbeat_p99_s": percentile(hb_lat, 99), "heartbeat_max_s": max(hb_lat, default=float("nan")),
            "online_min": min(hb_online, default=-1), "offline_after_s": cfg["offline_after_s"],
            "servicer": stats, **reported, **({"timing": call_segments(out["publish_times"], out["match_times"])} if timing else {})}


SEGMENTS = (("queued", 0, 1), ("to a worker", 1, 2), ("handler", 2, 3), ("back", 3, 4))


def call_segments(publish_times: list, match_times: list) -> dict:
    """Where each call's time went (--timing), from (sent, picked, entered, left, received)
    per round and node: queued (sent .. grpcio's serving thread took the call), to a worker
    (.. a worker thread entered the handler chain), handler (.. it returned), back (.. the
    node had the answer); for the GetMatches that returned ready, also when the serving
    thread took it, when its handler returned and when the node had it, after the round's last publish was
    acknowledged. Each as p50 / p99 / max in seconds over every round's calls."""
    def dist(xs: list[float]) -> dict:
        return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs, default=float("nan"))}

    out: dict = {}
    for kind, per_round in (("publish", publish_times), ("matches", match_times)):
        rows = [t for per in per_round for t in per if t is not None]
        out[kind] = {name: dist([t[b] - t[a] for t in rows]) for name, a, b in SEGMENTS}
        out[kind]["calls"] = len(rows)
    after = {"picked": [], "left": [], "received": []}
    for pubs, matches in zip(publish_times, match_times):
        acked = [t[4] for t in pubs if t is not None]
        if not acked:
            continue
        last = max(acked)
        for t in matches:
            if t is not None:
                after["picked"].append(t[1] - last)
                after["left"].append(t[3] - last)
                after["received"].append(t[4] - last)
    out["matches"]["after_last_ack"] = {k: dist(v) for k, v in after.items()}
    return out


def timing_table(cells: list[dict], backends: list[str]) -> list[str]:
    """The markdown of --timing's segments, one row per cell, backend and call."""
    md = ["", "Where the calls' time went (`--timing`; ms, p50 / p99; broker times from its trailing metadata):", "",
          "| nodes | prompts | state | call | queued | to a worker | handler | back | taken after the last ack | "
          "handler returned after the last ack | answered after the last ack |",
          "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        for b in backends:
            t = c[b].get("timing")
            if not t:
                continue
            for kind in ("publish", "matches"):
                seg = " | ".join(f"{1e3 * t[kind][n]['p50']:.1f} / {1e3 * t[kind][n]['p99']:.1f}" for n, _, _ in SEGMENTS)
                after = t[kind].get("after_last_ack")
                tail = (" | ".join(f"{1e3 * after[k]['p50']:.0f} / {1e3 * after[k]['p99']:.0f}"
                                   for k in ("picked", "left", "received")) if after else "- | - | -")
                md.append(f"| {c['nodes']} | {c['prompts']} | {b} | {'PublishSummaries' if kind == 'publish' else 'GetMatches (ready)'} | {seg} | {tail} |")
    return md


def run_raw_cell(n_nodes: int, rounds: int, payloads: list[list[bytes]], timeout_s: float) -> dict:
    server = ChildServer("raw")
    chans = [grpc.insecure_channel(server.address, options=grpc_options(16)) for _ in range(n_nodes)]
    calls = [ch.unary_unary(f"/{RAW_SERVICE}/Unary") for ch in chans]
    t_send = [[0.0] * n_nodes for _ in range(rounds)]
    t_ack = [[0.0] * n_nodes for _ in range(rounds)]
    barrier = Barrier(n_nodes, timeout=timeout_s)
    try:
        for call in calls:  # connect first, as Join does for the broker
            call(b"", timeout=timeout_s)

        def node(i: int) -> None:
            for r in range(rounds):
                barrier.wait()
                t_send[r][i] = time.perf_counter()
                calls[i](payloads[i][r], timeout=timeout_s)
                t_ack[r][i] = time.perf_counter()

        run_threads(node, n_nodes, timeout_s * rounds, barrier)
    finally:
        for ch in chans:
            ch.close()
        server.stop()
    windows = [max(t_ack[r]) - min(t_send[r]) for r in range(rounds)]
    msgs = n_nodes * rounds
    return {"messages": msgs, "windows_s": windows, "msgs_per_s": msgs / sum(windows),
            "bytes_per_round": sum(len(payloads[i][0]) for i in range(n_nodes))}


def pooled_raw(*runs: dict) -> dict:
    """Raw gRPC runs of one cell as one: their messages over their windows' total time, and
    each run's own rate (`runs_msgs_per_s`, in order)."""
    windows = [w for r in runs for w in r["windows_s"]]
    msgs = sum(r["messages"] for r in runs)
    return {"messages": msgs, "windows_s": windows, "msgs_per_s": msgs / sum(windows),
            "runs_msgs_per_s": [r["msgs_per_s"] for r in runs], "bytes_per_round": runs[0]["bytes_per_round"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny grid: N in {2, 4} x P in {32, 128}, 2 rounds")
    ap.add_argument("--nodes", type=int, nargs="*", default=[2, 8, 32, 64])
    ap.add_argument("--prompts", type=int, nargs="*", default=[128, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--db", choices=["sqlite", "memory", "both"], default="sqlite")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip cells predicted to overrun this")
    ap.add_argument("--cell-timeout-s", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing", action="store_true",
                    help="ask the broker for each publish's and ready GetMatches' times and report where they went "
                         "(queued for grpcio's serving thread, to a worker, handler, back)")
    ap.add_argument("--liveness", action="store_true",
                    help="the broker's default offline cut-off (15 s) instead of 3600 s; online_min then shows whether "
                         "any live node was marked offline")
    add_broker_set(ap)
    ap.add_argument("--k-mix", choices=sorted(K_MIX), default="realistic",
                    help="k per group: realistic (30%% all-fail, 50%% informative, 20%% all-pass) or uniform in 0..n")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="spread the simulated nodes over this many processes (each node a thread with its own "
                         "channel and heartbeat thread), so that 1,000 clients do not starve in one interpreter")
    ap.add_argument("--wire", choices=["columns", "messages"], default="columns",
                    help="publish as SummaryColumns (what nodes send) or as one GroupSummary message per group")
    ap.add_argument("--reports", action="store_true",
                    help="once every node has its round's answer, every node reports on the groups it was offered "
                         "(ReportCompatibility, as nodes do after their training step): the broker's compatibility "
                         "counts then grow with the pairs that exchanged, and the next rounds' matching reads them")
    ap.add_argument("--name", default=None, help="results file stem (default ingest_match[_quick])")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.prompts, args.rounds = [2, 4], [32, 128], 2
    backends = ["sqlite", "memory"] if args.db == "both" else [args.db]
    overrides = broker_sets(args.set)
    name = args.name or ("ingest_match_quick" if args.quick else "ingest_match")
    info = machine()
    t_start = time.monotonic()
    cells, skipped = [], []
    # cost model from the measured cells: a cell costs ~FIXED_S (two child servers, joins)
    # plus rounds x c * N^1.5 * P (ingest and matching grow with N * P; every publish also
    # wakes every waiting long-poll, hence the extra sqrt(N)); c is the largest seen so far
    coef: dict[str, float] = {}
    grid = sorted(((n, p) for n in args.nodes for p in args.prompts), key=lambda x: (x[0] * x[1], x[0]))
    with tempfile.TemporaryDirectory(prefix="graft-bench-broker-") as tmpd:
        tmp = Path(tmpd)
        for n_nodes, n_prompts in grid:
            left = args.budget_s - (time.monotonic() - t_start)
            per_round = sum(coef[b] * n_nodes ** 1.5 * n_prompts for b in backends if b in coef)
            rounds = args.rounds
            while rounds > 1 and FIXED_S + rounds * per_round > left:
                rounds -= 1
            if FIXED_S + rounds * per_round > left:
                skipped.append({"nodes": n_nodes, "prompts": n_prompts,
                                "why": f"predicted {FIXED_S + per_round:.0f} s for one round with {left:.0f} s "
                                       "of budget left"})
                print(f"skip N={n_nodes} P={n_prompts}: {skipped[-1]['why']}", flush=True)
                continue
            prompts_path = write_prompts(tmp / f"prompts-{n_prompts}.jsonl", n_prompts)
            ids = [p.id for p in load_prompts(DataConfig(source=str(prompts_path)))]
            rng = random.Random(args.seed * 1000003 + n_nodes * 7919 + n_prompts)
            def request(i: int, r: int) -> pb.PublishRequest:
                groups = make_summaries(rng, ids, r, GROUP_N, K_MIX[args.k_mix])
                if args.wire == "columns":  # what BrokerClient.publish sends
                    return pb.PublishRequest(node_id=f"node{i:02d}", session_id="x" * 32, round=r,
                                             columns=columns_to_pb(groups))
                return pb.PublishRequest(node_id=f"node{i:02d}", session_id="x" * 32, round=r, summaries=groups)

            requests = [[request(i, r) for r in range(rounds)] for i in range(n_nodes)]
            payloads = [[req.SerializeToString() for req in per] for per in requests]
            cell: dict = {"nodes": n_nodes, "prompts": n_prompts, "rounds": rounds, "k_mix": args.k_mix, "wire": args.wire,
                          "publish_bytes": len(payloads[0][0])}
            raw_before = run_raw_cell(n_nodes, rounds, payloads, args.cell_timeout_s)
            for b in backends:
                db = ":memory:" if b == "memory" else str(tmp / f"broker-{n_nodes}-{n_prompts}.sqlite")
                t0 = time.monotonic()
                res = run_broker_cell(n_nodes, n_prompts, rounds, db, tmp, args.seed, requests, prompts_path,
                                      args.cell_timeout_s, liveness=args.liveness, overrides=overrides,
                                      client_procs=args.client_procs, timing=args.timing, reports=args.reports)
                res["cell_s"] = time.monotonic() - t0
                coef[b] = max(coef.get(b, 0.0), max(res["round_s"]) / (n_nodes ** 1.5 * n_prompts))
                cell[b] = res
            cell["raw"] = pooled_raw(raw_before, run_raw_cell(n_nodes, rounds, payloads, args.cell_timeout_s))
            cell["raw"]["summaries_per_s"] = cell["raw"]["msgs_per_s"] * n_prompts
            for b in backends:
                cell[b]["ratio_vs_raw"] = cell[b]["ingest_per_s"] / cell["raw"]["summaries_per_s"]
            cells.append(cell)
            line = f"N={n_nodes:>3} P={n_prompts:>5} raw {cell['raw']['summaries_per_s']:>11,.0f} summ/s"
            for b in backends:
                r = cell[b]
                line += (f" | {b}: ingest {r['ingest_per_s']:>9,.0f}/s ({r['ratio_vs_raw']:.3f}x raw) match p50 "
                         f"{1e3 * r['match_p50_s']:.1f} ms p99 {1e3 * r['match_p99_s']:.1f} ms hb p99 "
                         f"{1e3 * r['heartbeat_p99_s']:.1f} ms online min {r['online_min']}/{n_nodes}")
                if "reports" in r:
                    line += (f" reports {r['reports']} p50 {1e3 * r['report_p50_s']:.1f} ms p99 "
                             f"{1e3 * r['report_p99_s']:.1f} ms; match p99 per round "
                             f"{[round(1e3 * x) for x in r['match_p99_s_per_round']]} ms")
            print(line, flush=True)
    payload = {"machine": info, "command": " ".join(["bench/broker/ingest_match.py", *sys.argv[1:]]),
               "client_procs": args.client_procs, "reports": args.reports,
               "n": GROUP_N, "backends": backends, "overrides": overrides, "cells": cells, "skipped": skipped,
               "total_s": time.monotonic() - t_start}
    md = [f"### Broker ingest and match latency ({info['date']})", "",
          machine_line(info) + f" Command: `{payload['command']}`. up to {args.rounds} rounds per cell (column `rounds`), n = {GROUP_N}, k mix {args.k_mix}, publishes as {args.wire}.", "",
          "| nodes | prompts/round | rounds | state | broker ingest (summaries/s) | raw gRPC (summaries/s) | ratio | "
          "match p50 (ms) | match p99 (ms) | publish p99 (ms) | heartbeat p99 (ms) | online min |",
          "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        for b in backends:
            r = c[b]
            md.append(f"| {c['nodes']} | {c['prompts']} | {c['rounds']} | {b} | {r['ingest_per_s']:,.0f} | "
                      f"{c['raw']['summaries_per_s']:,.0f} | {r['ratio_vs_raw']:.3f} | {1e3 * r['match_p50_s']:.1f} | "
                      f"{1e3 * r['match_p99_s']:.1f} | {1e3 * r['publish_p99_s']:.1f} | "
                      f"{1e3 * r['heartbeat_p99_s']:.1f} | {r['online_min']}/{c['nodes']} |")
    if args.reports:
        md += ["", "Every node reported on the groups it was offered once every node had the round's answer "
               "(`--reports`; report: the call's latency):", ""]
        md += [f"- {c['nodes']} x {c['prompts']} ({b}): {c[b]['reports']} reports, p50 "
               f"{1e3 * c[b]['report_p50_s']:.1f} ms, p99 {1e3 * c[b]['report_p99_s']:.1f} ms, max "
               f"{1e3 * c[b]['report_max_s']:.1f} ms; match p99 by round "
               f"{', '.join(f'{1e3 * x:.0f}' for x in c[b]['match_p99_s_per_round'])} ms"
               for c in cells for b in backends if "reports" in c[b]]
    if args.timing:
        md += timing_table(cells, backends)
    if skipped:
        md += ["", "Skipped (time budget " + f"{args.budget_s:.0f} s): " + "; ".join(
            f"N={s['nodes']} P={s['prompts']} ({s['why']})" for s in skipped) + "."]
    md += ["", "raw gRPC: the same serialized PublishRequest bytes to a no-op generic unary handler (same thread "
           "pool and options), same threads, same barrier, before and after the broker (pooled); its messages/s "
           "times P. Match latency: last publish "
           "acknowledged .. each node's GetMatches returning ready.", ""]
    write_results(name, payload, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
