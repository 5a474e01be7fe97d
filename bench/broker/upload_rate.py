"""Many small bundle uploads at once: the broker's bundles per second against raw gRPC.

A share_all node uploads every informative group of every round (HasBundles, then one
UploadBundle stream per bundle), so a federation of N nodes x P prompts sends the broker
about N x P / 2 small bundles a round, all within seconds of each other. A real
BrokerServer (SqliteState in a temp dir) runs in a child process on 127.0.0.1:0; N node
threads, each its own BrokerClient, join, publish P summaries (k = 4 of n = 8) and then, at
one barrier, upload the P bundles those summaries describe (BrokerClient.upload_missing:
HasBundles, then the uploads one after another, each record already encoded). A probe
sends a heartbeat every 50 ms throughout.

- bundles/s: uploads stored / (barrier .. last upload acknowledged).
- baseline, same run: a raw-bytes stream server in a child process receiving the same
  encoded bundles, in the same chunks, from the same N threads at the same barrier
  (one stream per bundle, as UploadBundle). ratio = broker / raw.

    .venv/bin/python bench/broker/upload_rate.py --nodes 64 --prompts 32 --kib 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import random
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from _common import RAW_SERVICE, ChildServer, add_broker_set, broker_sets, machine, machine_line, percentile, run_threads, write_prompts, write_results  # noqa: E402
from bundle_throughput import N, VERIFIER, make_record, summary_of  # noqa: E402
from graft_fed.data.config import DataConfig, load_prompts  # noqa: E402
from graft_fed.federation.bundles import digest_of, encode_bundle  # noqa: E402
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version  # noqa: E402
from graft_fed.federation.transport import grpc_options  # noqa: E402
from graft_fed.node.client import BrokerClient, new_tag  # noqa: E402
from graft_fed.proto import broker_pb2 as pb  # noqa: E402
from graft_fed.rewards.config import VerifierConfig  # noqa: E402

CHUNK = 1024 * 1024


def timed_at_barrier(count: int, timeout_s: float, work) -> float:
    """Seconds from releasing `count` threads at one barrier to the last of them finishing
    work(i) (the broker's uploads and the raw baseline are timed alike)."""
    barrier = threading.Barrier(count, timeout=timeout_s)
    start, done = [0.0], [0.0] * count

    def one(i: int) -> None:
        barrier.wait()
        if i == 0:
            start[0] = time.perf_counter()
        work(i)
        done[i] = time.perf_counter()

    run_threads(one, count, timeout_s, barrier)
    return max(done) - start[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32, help="bundles each node uploads")
    ap.add_argument("--kib", type=int, default=32, help="size of each bundle")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", default=None, help="write NAME.json and NAME.md here instead of bench/broker/results")
    ap.add_argument("--quick", action="store_true", help="8 nodes x 8 bundles")
    add_broker_set(ap)
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.prompts, args.name = 8, 8, args.name or "upload_rate_quick"
    info = machine()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="graft-bench-uploads-") as tmpd:
        tmp = Path(tmpd)
        prompts_path = write_prompts(tmp / "prompts.jsonl", args.prompts)
        prompts = load_prompts(DataConfig(source=str(prompts_path)))
        # every node's records (the bundles' bytes differ per node: texts are random)
        records = [[make_record(p, args.kib * 1024, rng) for p in prompts] for _ in range(args.nodes)]
        encoded = [[encode_bundle(r) for r in per] for per in records]

        # raw baseline: the same bytes, one stream each, same threads and barrier
        raw = ChildServer("raw", max_message_mib=16, chunk=CHUNK)
        chans = [grpc.insecure_channel(raw.address, options=grpc_options(16)) for _ in range(args.nodes)]
        puts = [ch.stream_unary(f"/{RAW_SERVICE}/Put") for ch in chans]
        try:
            for put in puts:
                put(iter([b"warm"]), timeout=args.timeout_s)

            def raw_node(i: int) -> None:
                for data in encoded[i]:
                    puts[i](iter([data[o:o + CHUNK] for o in range(0, len(data), CHUNK)]), timeout=args.timeout_s)

            raw_s = timed_at_barrier(args.nodes, args.timeout_s, raw_node)
        finally:
            for ch in chans:
                ch.close()
            raw.stop()

        cfg = {"listen": "127.0.0.1:0", "http": "", "db": str(tmp / "broker.sqlite"),
               "data": {"source": str(prompts_path)}, "verifier": {"name": VERIFIER}, "seed": 0, "n": N,
               "prompts_per_round": args.prompts, "mode": "sync", "round_deadline_s": 3600.0,
               "heartbeat_interval_s": 2.0, "offline_after_s": 3600.0, "max_bundle_mib": 64}
        if args.nodes > 90:
            cfg["max_long_polls"], cfg["max_workers"] = args.nodes + 8, args.nodes + 64
        cfg.update(broker_sets(args.set))
        broker = ChildServer("broker", cfg=cfg)
        manifest = Manifest(federation_id="graft-fed", protocol_version=PROTOCOL_VERSION,
                            dataset_id=prompts[0].dataset, dataset_hash=dataset_hash(prompts), seed=0, n=N,
                            prompts_per_round=args.prompts, mode="sync", verifier_name=VERIFIER,
                            verifier_version=verifier_version(VerifierConfig(name=VERIFIER)), staleness_rounds=4,
                            advantage="group/sample")
        clients = [BrokerClient(broker.address, f"node{i:03d}", rpc_timeout_s=args.timeout_s)
                   for i in range(args.nodes)]
        hb: list[float] = []
        stop = threading.Event()
        sent = [0] * args.nodes
        try:
            for i, c in enumerate(clients):
                c.join(f"model{i}", "tok", manifest, "share_all", 0)
                c.publish(0, [summary_of(r, 0) for r in records[i]])

            def probe() -> None:
                c = clients[0]
                while not stop.wait(0.05):
                    t0 = time.perf_counter()
                    c.stub.Heartbeat(pb.HeartbeatRequest(node_id=c.node_id, session_id=c.session, round=0,
                                                         tag=new_tag()),
                                     timeout=args.timeout_s)
                    hb.append(time.perf_counter() - t0)

            prober = threading.Thread(target=probe, daemon=True)
            prober.start()

            def node(i: int) -> None:
                c = clients[i]
                digests = [digest_of(d) for d in encoded[i]]
                present = c.has_bundles(digests)
                for rec, data, digest in zip(records[i], encoded[i], digests):
                    if digest not in present and c._upload_bytes(data, digest, rec.prompt_id, 0)[1]:
                        sent[i] += 1

            broker_s = timed_at_barrier(args.nodes, args.timeout_s, node)
            stop.set()
            prober.join(timeout=10)
            stats = broker.rpc_stats()
        finally:
            for c in clients:
                c.close()
            broker.stop()
    total = sum(sent)
    res = {"nodes": args.nodes, "bundles_per_node": args.prompts, "bundle_bytes": len(encoded[0][0]),
           "stored": total, "broker_s": broker_s, "broker_bundles_per_s": total / broker_s,
           "raw_s": raw_s, "raw_bundles_per_s": args.nodes * args.prompts / raw_s,
           "heartbeats": len(hb), "heartbeat_p50_s": percentile(hb, 50), "heartbeat_p99_s": percentile(hb, 99),
           "servicer": stats}
    res["ratio"] = res["broker_bundles_per_s"] / res["raw_bundles_per_s"]
    print(f"{args.nodes} nodes x {args.prompts} bundles of {res['bundle_bytes']:,} bytes: broker "
          f"{res['broker_bundles_per_s']:,.0f}/s ({broker_s:.2f} s), raw {res['raw_bundles_per_s']:,.0f}/s "
          f"({raw_s:.2f} s), ratio {res['ratio']:.3f}; heartbeat p50 {1e3 * res['heartbeat_p50_s']:.0f} ms "
          f"p99 {1e3 * res['heartbeat_p99_s']:.0f} ms", flush=True)
    payload = {"machine": info, "command": " ".join(["bench/broker/upload_rate.py", *sys.argv[1:]]), **res}
    md = [f"### Small bundle uploads at once ({info['date']})", "",
          machine_line(info) + f" Command: `{payload['command']}`.", "",
          "| nodes | bundles each | bytes each | broker bundles/s | raw gRPC bundles/s | ratio | heartbeat p50 / p99 (ms) |",
          "|---:|---:|---:|---:|---:|---:|---:|",
          f"| {args.nodes} | {args.prompts} | {res['bundle_bytes']:,} | {res['broker_bundles_per_s']:,.0f} | "
          f"{res['raw_bundles_per_s']:,.0f} | {res['ratio']:.3f} | {1e3 * res['heartbeat_p50_s']:.0f} / "
          f"{1e3 * res['heartbeat_p99_s']:.0f} |", ""]
    name = args.name or "upload_rate"
    if args.out_dir:
        out = Path(args.out_dir)
        (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
        (out / f"{name}.md").write_text("\n".join(md), encoding="utf-8")
    else:
        write_results(name, payload, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
