"""Bundle transfer throughput through the broker against raw gRPC streaming of the same bytes.

A real BrokerServer (SqliteState in a temp dir, balance none, 1 MiB chunks) and a trivial
raw-bytes stream server run in child processes on 127.0.0.1:0. For each bundle size a
source node publishes an informative summary and uploads a GroupRecord whose texts are
long enough to reach the size (BrokerClient.upload: canonical JSON encode, sha256, chunked
stream; the broker re-hashes, decodes, checks the record against its summary and stores it
in SQLite with an fsync); a receiver that failed the prompt gets matched and fetches it
(BrokerClient.fetch: chunked stream, sha256, JSON decode, record validation). The baseline
streams the same bytes in the same 1 MiB chunks to a stream-in handler that joins them, and
back from a stream-out handler, on the same loopback, interleaved rep by rep.

    .venv/bin/python bench/broker/bundle_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import string
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from _common import RAW_SERVICE, ChildServer, add_broker_set, broker_sets, machine, machine_line, median, write_prompts, write_results  # noqa: E402
from graft_fed.federation.transport import grpc_options  # noqa: E402
from graft_fed.core.records import GroupRecord  # noqa: E402
from graft_fed.data.config import DataConfig, load_prompts  # noqa: E402
from graft_fed.federation.bundles import decode_bundle, digest_of, encode_bundle  # noqa: E402
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version  # noqa: E402
from graft_fed.node.client import BrokerClient  # noqa: E402
from graft_fed.proto import broker_pb2 as pb  # noqa: E402
from graft_fed.rewards.config import VerifierConfig  # noqa: E402

N = 8
K = 4
CHUNK_KIB = 1024
VERIFIER = "math_verify"
MIB = 2 ** 20


def make_record(prompt, size: int, rng: random.Random) -> GroupRecord:
    lps = tuple(-rng.uniform(0.01, 3.0) for _ in range(N))
    rewards = tuple(1.0 if i < K else 0.0 for i in range(N))
    adv = tuple(1.0 if r else -1.0 for r in rewards)

    def rec(text_len: int) -> GroupRecord:
        texts = tuple("".join(rng.choices(string.ascii_letters + string.digits + " ", k=text_len)) for _ in range(N))
        return GroupRecord(prompt_id=prompt.id, step=0, model_id="src", tokenizer_id="tok", problem=prompt.problem,
                           answer=prompt.answer, rewards=rewards, advantages=adv, texts=texts,
                           finish_reasons=("stop",) * N, lengths=tuple(max(1, text_len // 4) for _ in range(N)),
                           mean_logprobs=lps)

    overhead = len(encode_bundle(rec(1))) - N
    return rec(max(1, (size - overhead) // N))


def summary_of(rec: GroupRecord, round: int, k: int | None = None) -> pb.GroupSummary:
    k = rec.k if k is None else k
    return pb.GroupSummary(prompt_id=rec.prompt_id, round=round, policy_version=rec.step, n=N, k=k, reward_mean=k / N,
                           reward_std=math.sqrt(k / N * (1 - k / N)), lengths=list(rec.lengths),
                           mean_logprobs=list(rec.mean_logprobs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 64 KiB and 1 MiB, 3 reps each")
    ap.add_argument("--sizes-kib", type=int, nargs="*", default=[64, 1024, 16384])
    ap.add_argument("--reps", type=int, nargs="*", default=[30, 12, 4], help="reps per size (same order)")
    ap.add_argument("--name", default=None)
    add_broker_set(ap)
    args = ap.parse_args()
    if args.quick:
        args.sizes_kib, args.reps = [64, 1024], [3, 3]
    reps = dict(zip(args.sizes_kib, args.reps + [args.reps[-1]] * len(args.sizes_kib)))
    name = args.name or ("bundle_throughput_quick" if args.quick else "bundle_throughput")
    info = machine()
    t_start = time.monotonic()
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="graft-bench-bundle-") as tmpd:
        tmp = Path(tmpd)
        total = sum(reps.values())
        prompts_path = write_prompts(tmp / "prompts.jsonl", total)
        prompts = load_prompts(DataConfig(source=str(prompts_path)))
        cfg = {"listen": "127.0.0.1:0", "http": "", "db": str(tmp / "broker.sqlite"),
               "data": {"source": str(prompts_path)}, "verifier": {"name": VERIFIER}, "seed": 0, "n": N,
               "prompts_per_round": 8, "mode": "sync", "balance": "none", "round_deadline_s": 600.0,
               "heartbeat_interval_s": 2.0, "offline_after_s": 600.0, "chunk_kib": CHUNK_KIB, "max_message_mib": 16,
               "max_bundle_mib": 64, **broker_sets(args.set)}
        broker = ChildServer("broker", cfg=cfg)
        raw = ChildServer("raw", max_message_mib=16, chunk=CHUNK_KIB * 1024)
        manifest = Manifest(federation_id="graft-fed", protocol_version=PROTOCOL_VERSION,
                            dataset_id=prompts[0].dataset, dataset_hash=dataset_hash(prompts), seed=0, n=N,
                            prompts_per_round=8, mode="sync", verifier_name=VERIFIER,
                            verifier_version=verifier_version(VerifierConfig(name=VERIFIER)), staleness_rounds=4, advantage="group/sample")
        src = BrokerClient(broker.address, "src", rpc_timeout_s=60, chunk_kib=CHUNK_KIB)
        dst = BrokerClient(broker.address, "dst", rpc_timeout_s=60, chunk_kib=CHUNK_KIB)
        chan = grpc.insecure_channel(raw.address, options=grpc_options(16))
        put = chan.stream_unary(f"/{RAW_SERVICE}/Put")
        get = chan.unary_stream(f"/{RAW_SERVICE}/Get")
        chunk = CHUNK_KIB * 1024
        try:
            src.join("src", "tok", manifest, "share_all", 0)
            dst.join("dst", "tok", manifest, "share_all", 0)
            put(iter([b"warm"]), timeout=30)
            list(get(b"", timeout=30))
            round = 0
            for size_kib in args.sizes_kib:
                size = size_kib * 1024
                t = {"broker_up": [], "broker_down": [], "raw_up": [], "raw_down": [], "encode": [], "sha256": [],
                     "decode": [], "bytes_up": [], "bytes_down": []}
                nbytes = 0
                for rep in range(reps[size_kib]):
                    rec = make_record(prompts[round], size, rng)
                    # client-side pieces of the broker path, timed apart (not part of the raw baseline)
                    t0 = time.perf_counter()
                    data = encode_bundle(rec)
                    t["encode"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    digest = digest_of(data)
                    t["sha256"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    decode_bundle(data, digest)
                    t["decode"].append(time.perf_counter() - t0)
                    nbytes = len(data)
                    src.publish(round, [summary_of(rec, round)])
                    dst.publish(round, [summary_of(rec, round, k=0)])

                    def raw_up() -> None:
                        t0 = time.perf_counter()
                        n = put(iter([data[o:o + chunk] for o in range(0, len(data), chunk)]), timeout=120)
                        t["raw_up"].append(time.perf_counter() - t0)
                        assert int.from_bytes(n, "big") == len(data)

                    def broker_up() -> None:
                        # the bytes the client encoded and hashed (timed apart above) through
                        # the broker: what raw gRPC streaming is the baseline for
                        t0 = time.perf_counter()
                        d, stored = src._upload_bytes(data, digest, rec.prompt_id, round)
                        t["bytes_up"].append(time.perf_counter() - t0)
                        t["broker_up"].append(t["bytes_up"][-1] + t["encode"][-1] + t["sha256"][-1])
                        assert stored and d == digest

                    def raw_down() -> None:
                        t0 = time.perf_counter()
                        got = b"".join(get(b"", timeout=120))
                        t["raw_down"].append(time.perf_counter() - t0)
                        assert len(got) == len(data)

                    def broker_down() -> None:
                        m = dst.get_matches(round, 30.0)
                        assert m.ready and m.offers and m.offers[0].digest == digest, m
                        t0 = time.perf_counter()  # the bytes and their digest, as a node receives them
                        got = b"".join(c.data for c in dst.stub.FetchBundle(pb.FetchBundleRequest(
                            node_id=dst.node_id, session_id=dst.session, digest=digest), timeout=120))
                        t["bytes_down"].append(time.perf_counter() - t0)
                        assert digest_of(got) == digest
                        t0 = time.perf_counter()  # BrokerClient.fetch: the same, then decode and validate
                        back = dst.fetch(digest)
                        t["broker_down"].append(time.perf_counter() - t0)
                        assert back == rec

                    order = [raw_up, broker_up] if rep % 2 == 0 else [broker_up, raw_up]
                    order += [raw_down, broker_down] if rep % 2 == 0 else [broker_down, raw_down]
                    for f in order:
                        f()
                    round += 1
                mib = nbytes / MIB
                row = {"size_kib": size_kib, "bytes": nbytes, "reps": reps[size_kib],
                       **{f"{k}_median_s": median(v) for k, v in t.items()}}
                for d in ("up", "down"):
                    row[f"broker_{d}_mib_s"] = mib / row[f"broker_{d}_median_s"]
                    row[f"raw_{d}_mib_s"] = mib / row[f"raw_{d}_median_s"]
                    row[f"ratio_{d}"] = row[f"broker_{d}_mib_s"] / row[f"raw_{d}_mib_s"]
                    row[f"bytes_{d}_mib_s"] = mib / row[f"bytes_{d}_median_s"]
                    row[f"ratio_bytes_{d}"] = row[f"bytes_{d}_mib_s"] / row[f"raw_{d}_mib_s"]
                rows.append(row)
                print(f"{size_kib:>6} KiB: bytes up {row['ratio_bytes_up']:.3f}x down {row['ratio_bytes_down']:.3f}x raw | "
                      f"upload broker {row['broker_up_mib_s']:8.1f} MiB/s raw "
                      f"{row['raw_up_mib_s']:8.1f} ({row['ratio_up']:.3f}x) | fetch broker {row['broker_down_mib_s']:8.1f}"
                      f" raw {row['raw_down_mib_s']:8.1f} ({row['ratio_down']:.3f}x) | encode "
                      f"{1e3 * row['encode_median_s']:.1f} ms sha256 {1e3 * row['sha256_median_s']:.1f} ms decode "
                      f"{1e3 * row['decode_median_s']:.1f} ms", flush=True)
            stats = broker.rpc_stats()
        finally:
            src.close()
            dst.close()
            chan.close()
            broker.stop()
            raw.stop()
    payload = {"machine": info, "command": " ".join(["bench/broker/bundle_throughput.py", *sys.argv[1:]]),
               "chunk_kib": CHUNK_KIB, "rows": rows, "servicer": stats, "total_s": time.monotonic() - t_start}
    md = [f"### Bundle transfer throughput ({info['date']})", "",
          machine_line(info) + f" Command: `{payload['command']}`. Chunks of {CHUNK_KIB} KiB; medians over reps.", "",
          "| bundle | reps | upload bytes (MiB/s) | ratio | upload incl. encode (MiB/s) | upload raw (MiB/s) | ratio | "
          "fetch bytes (MiB/s) | ratio | fetch incl. decode (MiB/s) | fetch raw (MiB/s) | ratio | client encode (ms) | "
          "sha256 (ms) | client decode (ms) |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['size_kib']} KiB | {r['reps']} | {r['bytes_up_mib_s']:.1f} | {r['ratio_bytes_up']:.3f} | "
                  f"{r['broker_up_mib_s']:.1f} | {r['raw_up_mib_s']:.1f} | {r['ratio_up']:.3f} | "
                  f"{r['bytes_down_mib_s']:.1f} | {r['ratio_bytes_down']:.3f} | "
                  f"{r['broker_down_mib_s']:.1f} | {r['raw_down_mib_s']:.1f} | "
                  f"{r['ratio_down']:.3f} | {1e3 * r['encode_median_s']:.1f} | {1e3 * r['sha256_median_s']:.1f} | "
                  f"{1e3 * r['decode_median_s']:.1f} |")
    md += ["", "upload bytes = the encoded bundle through BrokerClient's chunked stream (broker: hash as the chunks "
           "arrive, decode, summary check, the bundle's file and its row, both fsynced); upload incl. encode adds the "
           "client's encode and sha256 (BrokerClient.upload). fetch bytes = FetchBundle's chunks joined and hashed; fetch incl. decode = "
           "BrokerClient.fetch (the same, then decode and validate). raw = the same bytes in the same chunks to/from a "
           "generic stream handler. The last three columns are the client-side pieces, timed apart.", ""]
    write_results(name, payload, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
