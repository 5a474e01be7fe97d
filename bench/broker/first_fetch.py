"""What the broker's check of a bundle stored before its start costs its first fetch.

A broker reads a bundle it did not store itself in this life (one from before its start:
an earlier process's, a restored backup's) whole at its first fetch and hashes it before
serving it (broker/bundles.py, `_check_intact`); the bundles it stored itself were hashed on
their way in and are served without it. This bench uploads `--reps` bundles of `--size-kib`,
restarts the broker on the same state, uploads as many again, and times two fetches of each:
the first fetch of a bundle from before the start (the check, then the stream) against the
first fetch of one stored in this life, and each second fetch (neither checks), interleaved
bundle by bundle. The broker runs in a child process, as in bundle_throughput.py.

    .venv/bin/python bench/broker/first_fetch.py --size-kib 16384 --reps 8
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ChildServer, add_broker_set, broker_sets, machine, machine_line, median, write_prompts, write_results  # noqa: E402
from bundle_throughput import CHUNK_KIB, N, VERIFIER, make_record, summary_of  # noqa: E402
from graft_fed.data.config import DataConfig, load_prompts  # noqa: E402
from graft_fed.federation.bundles import digest_of  # noqa: E402
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version  # noqa: E402
from graft_fed.node.client import BrokerClient  # noqa: E402
from graft_fed.proto import broker_pb2 as pb  # noqa: E402
from graft_fed.rewards.config import VerifierConfig  # noqa: E402

MIB = 2 ** 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-kib", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=8, help="bundles from before the start, and as many after")
    ap.add_argument("--name", default="first_fetch")
    add_broker_set(ap)
    args = ap.parse_args()
    info = machine()
    rng = random.Random(0)
    size = args.size_kib * 1024
    with tempfile.TemporaryDirectory(prefix="graft-bench-first-fetch-") as tmpd:
        tmp = Path(tmpd)
        prompts_path = write_prompts(tmp / "prompts.jsonl", 2 * args.reps)
        prompts = load_prompts(DataConfig(source=str(prompts_path)))
        cfg = {"listen": "127.0.0.1:0", "http": "", "db": str(tmp / "broker.sqlite"),
               "data": {"source": str(prompts_path)}, "verifier": {"name": VERIFIER}, "seed": 0, "n": N,
               "prompts_per_round": 8, "mode": "sync", "balance": "none", "round_deadline_s": 600.0,
               "heartbeat_interval_s": 2.0, "offline_after_s": 600.0, "chunk_kib": CHUNK_KIB, "max_message_mib": 16,
               "max_bundle_mib": 64, "max_publishes_per_s": 0, **broker_sets(args.set)}
        manifest = Manifest(federation_id="graft-fed", protocol_version=PROTOCOL_VERSION,
                            dataset_id=prompts[0].dataset, dataset_hash=dataset_hash(prompts), seed=0, n=N,
                            prompts_per_round=8, mode="sync", verifier_name=VERIFIER,
                            verifier_version=verifier_version(VerifierConfig(name=VERIFIER)), staleness_rounds=4,
                            advantage="group/sample")

        def clients(broker: ChildServer) -> tuple[BrokerClient, BrokerClient]:
            src = BrokerClient(broker.address, "src", rpc_timeout_s=60, chunk_kib=CHUNK_KIB)
            dst = BrokerClient(broker.address, "dst", rpc_timeout_s=60, chunk_kib=CHUNK_KIB)
            src.join("src", "tok", manifest, "share_all", 0)
            dst.join("dst", "tok", manifest, "share_all", 0)
            return src, dst

        def upload(src: BrokerClient, dst: BrokerClient, rounds: range) -> list[str]:
            digests = []
            for r in rounds:
                rec = make_record(prompts[r], size, rng)
                src.publish(r, [summary_of(rec, r)])
                dst.publish(r, [summary_of(rec, r, k=0)])
                digest, stored = src.upload(rec, r)
                assert stored
                digests.append(digest)
            return digests

        broker = ChildServer("broker", cfg=cfg)
        src, dst = clients(broker)
        before = upload(src, dst, range(args.reps))
        src.close()
        dst.close()
        broker.stop()
        broker = ChildServer("broker", cfg=cfg)  # the same state: the bundles above are from before its start
        src, dst = clients(broker)
        after = upload(src, dst, range(args.reps, 2 * args.reps))
        times: dict[str, list[float]] = {"before_first": [], "before_second": [], "after_first": [],
                                         "after_second": []}

        def fetch(r: int, digest: str, key: str) -> None:
            m = dst.get_matches(r, 30.0)
            assert m.ready and [o.digest for o in m.offers] == [digest], m
            for which in ("first", "second"):
                t0 = time.perf_counter()
                got = b"".join(c.data for c in dst.stub.FetchBundle(pb.FetchBundleRequest(
                    node_id=dst.node_id, session_id=dst.session, digest=digest), timeout=120))
                times[f"{key}_{which}"].append(time.perf_counter() - t0)
                assert digest_of(got) == digest

        try:
            for i in range(args.reps):  # alternating which goes first
                pair = [(i, before[i], "before"), (args.reps + i, after[i], "after")]
                for r, digest, key in (pair if i % 2 == 0 else pair[::-1]):
                    fetch(r, digest, key)
        finally:
            src.close()
            dst.close()
            broker.stop()
    med = {k: median(v) for k, v in times.items()}
    mib = size / MIB
    rows = {k: {"median_ms": 1000 * v, "mib_s": mib / v} for k, v in med.items()}
    payload = {"machine": info, "command": " ".join(sys.argv), "size_kib": args.size_kib, "reps": args.reps,
               "times_s": times, "medians": rows,
               "first_fetch_ratio": med["before_first"] / med["after_first"]}
    md = [f"### The first fetch of a bundle from before the broker's start ({time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())})",
          "", machine_line(info) + " "
          f"Command: `{payload['command']}`. {args.reps} bundles of {args.size_kib} KiB from before a restart and "
          f"{args.reps} stored after it, each fetched twice, interleaved; medians.", "",
          "| bundle | first fetch (ms) | MiB/s | second fetch (ms) | MiB/s |", "|---|---:|---:|---:|---:|"]
    for key, label in (("before", "stored before the start (checked at its first fetch)"),
                       ("after", "stored in this life (hashed on its way in)")):
        f, s = rows[f"{key}_first"], rows[f"{key}_second"]
        md.append(f"| {label} | {f['median_ms']:.1f} | {f['mib_s']:.0f} | {s['median_ms']:.1f} | {s['mib_s']:.0f} |")
    md += ["", f"First fetch, from before the start against stored in this life: "
           f"{payload['first_fetch_ratio']:.2f}x the time.", ""]
    write_results(args.name, payload, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
