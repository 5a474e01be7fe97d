"""Broker memory over many rounds, in-process: which structures grow, and which allocation sites.

    nice .venv/bin/python bench/broker/memory.py --quick             # 64 x 64, 80 rounds, a minute
    nice .venv/bin/python bench/broker/memory.py --rounds 600        # 256 x 256, as load.py's ten minutes

The broker's servicer (`BrokerServicer`: request parsing, the replay guard, the codec) and
its `Federation` over a SqliteState in a temporary directory are driven directly, without
gRPC, by one thread, on a simulated clock (`--round-s` seconds per round, 1.5 s as in
`load.py --nodes 256 --prompts 256`: 390 rounds in 600 s), so that the replay guard's
window (`replay_window_s`, 300 s) spans as many rounds as it does under the real load.
Per round, as load.py's nodes do: every node publishes `--prompts` summaries (the realistic
mix of k: 30% all-fail, 50% informative, 20% all-pass), heartbeats every
`heartbeat_interval_s` (2 s) of simulated time, and asks for its matches once the round
is complete; in addition (load.py does neither) `--uploaders` nodes upload a bundle for
`--bundles` of their informative groups before matching (so answers carry digests and the
grant map fills), and `--reporters` nodes report on up to 8 groups they were matched to.
The server's housekeeping (wake ready rounds, expire request ids, flush liveness) runs once
a round.

Every `--every` rounds it records the process's RSS, glibc's heap in use and free
(mallinfo2), the number of Python objects, the size of each broker cache, and (with
`--trace`, the default) a tracemalloc snapshot, and at the end the allocation sites that
grew most between the snapshot after `--warmup-rounds` and the last. Results:
bench/broker/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, machine, make_summaries, write_prompts, write_results  # noqa: E402
from graft_fed.broker.heap import malloc_stats  # noqa: E402

GROUP_N = 8
VARIANTS = 8


class Context:
    """What the servicer's methods use of a grpc.ServicerContext."""

    def abort(self, code, message):  # noqa: ANN001, ANN201 - grpc's signature
        raise RuntimeError(f"{code.name}: {message}")

    def auth_context(self) -> dict:
        return {}


class SimClock:
    def __init__(self, t0: float) -> None:
        self.t = t0

    def __call__(self) -> float:
        return self.t


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def structure_sizes(fed, servicer) -> dict:
    """Entries held by each of the broker's in-memory caches and maps."""
    idx = fed.index
    with idx.lock:
        books = list(idx._books.values())
    return {
        "grants (digests)": len(fed.grants),
        "grants (receiver entries)": fed.grants.entries(),
        "replay ids": fed.replay.remembered(),
        "answers cache": len(fed.answers._answers),
        "match sets": len(fed.matcher._sets),
        "round books": len(books),
        "round book digests": sum(sum(len(p) for p in b.digests.values()) for b in books),
        "round rows": len(fed.rounds._rounds),
        "ready memo": len(fed.rounds._ready_memo),
        "models memo": len(fed.answers._models),
        "wakeup keys": len(fed.wakeups.keys()),
        "registry nodes": len(fed.registry.all()),
        "exchange pairs": len(fed.matcher._exchange) if fed.matcher._exchange is not None else 0,
        "counters": len(fed.counters),
        "rpc stats keys": len(servicer.stats.calls),
        "rate buckets": len(fed.publishing._publish_rate._buckets),
        "python objects": len(gc.get_objects()),
    }


def _record(rng: random.Random, s, step: int, prompt, model: str):
    from graft_fed.core.records import GroupRecord

    k, n = s.k, s.n
    rewards = tuple([1.0] * k + [0.0] * (n - k))
    mean = k / n
    std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return GroupRecord(prompt_id=s.prompt_id, step=step, model_id=model, tokenizer_id="tok",
                       problem=prompt.problem, answer=prompt.answer, rewards=rewards,
                       advantages=tuple((r - mean) / std if std else 0.0 for r in rewards), texts=tuple(f"answer {rng.random()}" for _ in rewards),
                       finish_reasons=("stop",) * n, lengths=tuple(s.lengths), mean_logprobs=tuple(s.mean_logprobs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--every", type=int, default=25, help="rounds between measurements")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="the growth table compares the last snapshot with the one at this round (default: "
                         "the replay window's rounds, replay_window_s / round-s)")
    ap.add_argument("--round-s", type=float, default=1.5, help="simulated seconds per round")
    ap.add_argument("--uploaders", type=int, default=16, help="nodes that upload bundles each round")
    ap.add_argument("--bundles", type=int, default=8, help="bundles per uploader and round")
    ap.add_argument("--reporters", type=int, default=16, help="nodes that report on their matches each round")
    ap.add_argument("--threads", type=int, default=0,
                    help="worker threads serving the calls (0: all in the main thread)")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True, help="tracemalloc snapshots")
    ap.add_argument("--frames", type=int, default=1, help="tracemalloc frames per allocation")
    ap.add_argument("--broker", default="{}", help="broker config overrides, JSON")
    ap.add_argument("--quick", action="store_true", help="defaults of 64 nodes x 64 prompts, 80 rounds, every 10, "
                    "8 uploaders and reporters")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the SQLite file goes (default /dev/shm: memory is measured, not the disk's fsyncs; "
                         "the file's pages there are not the broker's RSS)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="memory")
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(nodes=64, prompts=64, rounds=80, every=10, uploaders=8, reporters=8)
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    from graft_fed.broker.config import BrokerConfig
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.servicer import BrokerServicer, _chunk_parser, _publish_parser
    from graft_fed.broker.state_sqlite import SqliteState
    from graft_fed.configbase import from_mapping
    from graft_fed.data.config import DataConfig, load_prompts
    from graft_fed.federation.bundles import digest_of, encode_bundle
    from graft_fed.federation.codec import columns_to_pb, manifest_to_pb
    from graft_fed.proto import broker_pb2 as pb

    info = machine()
    work = Path(tempfile.mkdtemp(prefix="graft-memory-", dir=args.dir))
    prompts_path = write_prompts(work / "prompts.jsonl", args.prompts)
    prompts = load_prompts(DataConfig(source=str(prompts_path)))
    by_id = {p.id: p for p in prompts}
    cfg_map = {"listen": "127.0.0.1:0", "http": "", "db": str(work / "broker.sqlite"),
               "data": {"source": str(prompts_path)}, "verifier": {"name": "math_verify"}, "seed": args.seed,
               "n": GROUP_N, "prompts_per_round": args.prompts, "max_long_polls": args.nodes + 8,
               "max_workers": args.nodes + 64, "max_publishes_per_s": 0}
    cfg_map.update(json.loads(args.broker))
    cfg = from_mapping(BrokerConfig, cfg_map)
    clock = SimClock(time.time())
    state = SqliteState(cfg.db)
    fed = Federation(cfg, state, clock=clock)
    servicer = BrokerServicer(fed)
    ctx = Context()
    rng = random.Random(args.seed)
    names = [f"node{i:03d}" for i in range(args.nodes)]
    warmup = args.warmup_rounds or int(cfg.replay_window_s / args.round_s)

    def tag() -> pb.RequestTag:
        return pb.RequestTag(request_id=f"{rng.getrandbits(128):032x}", sent_at_ms=int(clock() * 1000))

    sessions = {}
    manifest = manifest_to_pb(fed.manifest)
    for name in names:
        resp = servicer.Join(pb.JoinRequest(node_id=name, model_id=f"model-{name}", tokenizer_id="tok",
                                            manifest=manifest, privacy=pb.PRIVACY_SHARE_ALL,
                                            resume_round=0, tag=tag()), ctx)
        sessions[name] = resp.session_id
    # each node publishes one of VARIANTS rounds of summaries drawn once (drawing 65,536 a round
    # would take longer than the broker's work), with the round's policy version
    pids = [p.id for p in prompts]
    pool = {}
    for i, name in enumerate(names):
        pool[name] = []
        for _ in range(VARIANTS):
            summaries = make_summaries(rng, pids, 0, GROUP_N)
            pool[name].append((summaries if i < args.uploaders else None, columns_to_pb(summaries)))
    beat_at = {name: clock() + rng.uniform(0, cfg.heartbeat_interval_s) for name in names}

    if args.trace:
        tracemalloc.start(args.frames)
    rows: list[dict] = []
    snaps: dict[int, tracemalloc.Snapshot] = {}
    pool_exec = ThreadPoolExecutor(args.threads, thread_name_prefix="broker") if args.threads else None

    def each(fn, items) -> None:
        """fn over items: in this thread, or (--threads) spread over a pool of worker threads
        as grpcio's are (each thread may allocate from its own malloc arena)."""
        if pool_exec is None:
            for item in items:
                fn(item)
        else:
            for f in [pool_exec.submit(fn, item) for item in items]:
                f.result()

    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        round_start = clock()
        versions = np.full(args.prompts, rnd, dtype="<u8").tobytes()

        def publish(i: int) -> None:
            name = names[i]
            columns = pool[name][(rnd + i) % VARIANTS][1]
            req = pb.PublishRequest(node_id=name, session_id=sessions[name], round=rnd, columns=columns, tag=tag())
            req.columns.policy_versions = versions
            servicer.PublishSummaries(_publish_parser(req.SerializeToString()), ctx)

        def upload(i: int) -> None:
            name = names[i]
            mine = [s for s in pool[name][(rnd + i) % VARIANTS][0] if 0 < s.k < GROUP_N][:args.bundles]
            for s in mine:
                data = encode_bundle(_record(rng, s, rnd, by_id[s.prompt_id], f"model-{name}"))
                chunk = pb.BundleChunk(digest=digest_of(data), total_size=len(data), offset=0, data=data,
                                       node_id=name, session_id=sessions[name], prompt_id=s.prompt_id, round=rnd,
                                       tag=tag())
                servicer.UploadBundle(iter([_chunk_parser(chunk.SerializeToString())]), ctx)

        def matches(i: int) -> None:
            name = names[i]
            wire = servicer.GetMatches(pb.MatchRequest(node_id=name, session_id=sessions[name], round=rnd,
                                                       wait_ms=0), ctx)
            if i < args.reporters:
                res = pb.MatchResponse.FromString(wire)
                entries = [pb.CompatibilityReport.Entry(source_node_id=o.source_node_id, prompt_id=o.prompt_id,
                                                        mean_s=rng.uniform(0, 2), admitted_fraction=1.0)
                           for o in res.offers[:8]]
                if entries:
                    servicer.ReportCompatibility(pb.CompatibilityReport(
                        node_id=name, session_id=sessions[name], round=rnd, entries=entries, tag=tag()), ctx)

        def heartbeat(name: str) -> None:
            while beat_at[name] <= clock():
                servicer.Heartbeat(pb.HeartbeatRequest(node_id=name, session_id=sessions[name], round=rnd + 1,
                                                       tag=tag()), ctx)
                beat_at[name] += cfg.heartbeat_interval_s

        # the simulated clock moves per phase: publishes in the first quarter of the round,
        # uploads, matches in the second half, heartbeats due by its end
        clock.t = round_start + args.round_s / 4
        each(publish, range(len(names)))
        each(upload, range(min(args.uploaders, len(names))))
        clock.t = round_start + args.round_s * 3 / 4
        each(matches, range(len(names)))
        clock.t = round_start + args.round_s
        each(heartbeat, names)
        fed.wake_ready_rounds()
        fed.replay.expire()
        fed.flush_liveness()
        if (rnd + 1) % args.every == 0 or rnd + 1 == args.rounds:
            gc.collect()
            row = {"round": rnd + 1, "sim_s": round((rnd + 1) * args.round_s, 1),
                   "wall_s": round(time.perf_counter() - t_start, 1), "rss MiB": round(_rss_mib(), 1)}
            row.update({f"malloc {k} MiB": round(v / 2**20, 1) for k, v in malloc_stats().items()})
            if args.trace:
                snap = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__)])
                row["traced MiB"] = round(sum(s.size for s in snap.statistics("filename")) / 2**20, 1)
                snaps[rnd + 1] = snap
                for old in [r for r in snaps if r not in (rnd + 1,) and r != _base(snaps, warmup)]:
                    del snaps[old]
            row.update(structure_sizes(fed, servicer))
            rows.append(row)
            print(json.dumps(row), flush=True)
    growth = []
    if args.trace and len(snaps) >= 2:
        base_round = _base(snaps, warmup)
        last = max(snaps)
        for stat in snaps[last].compare_to(snaps[base_round], "lineno")[:25]:
            frame = stat.traceback[0]
            growth.append({"site": f"{_short(frame.filename)}:{frame.lineno}", "size_mib": round(stat.size / 2**20, 2),
                           "diff_kib": round(stat.size_diff / 1024, 1), "count_diff": stat.count_diff})
    if pool_exec is not None:
        pool_exec.shutdown()
    state.close()
    payload = {"machine": info, "args": vars(args), "broker": cfg_map, "warmup_round": warmup, "rows": rows,
               "growth_after_warmup": growth}
    (RESULTS / f"{args.name}.json").parent.mkdir(parents=True, exist_ok=True)
    write_results(args.name, payload, render(payload))
    return 0


def _base(snaps: dict, warmup: int) -> int:
    """The snapshot the growth table starts from: the first at or after the warm-up round
    (the earliest kept when none is)."""
    later = [r for r in snaps if r >= warmup]
    return min(later) if later else min(snaps)


def _short(path: str) -> str:
    for marker in ("graft_fed/", "site-packages/", "lib/python3"):
        if marker in path:
            return path[path.index(marker):]
    return path


def render(p: dict) -> str:
    a = p["args"]
    rows = p["rows"]
    out = [f"# Broker memory in-process: {a['nodes']} nodes x {a['prompts']} prompts, {a['rounds']} rounds "
           f"of {a['round_s']} s simulated", "",
           f"git {p['machine']['git']}, {p['machine']['date']}; uploaders {a['uploaders']} x {a['bundles']} bundles, "
           f"reporters {a['reporters']}; tracemalloc {'on' if a['trace'] else 'off'}; warm-up (replay window) "
           f"{p['warmup_round']} rounds", ""]
    if rows:
        cols = list(rows[0])
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    if p["growth_after_warmup"]:
        out += ["", f"Allocation sites that grew most from the snapshot at or after round {p['warmup_round']} "
                    "to the last (tracemalloc):", "", "| site | size MiB | growth KiB | blocks |", "|---|---:|---:|---:|"]
        out += [f"| {g['site']} | {g['size_mib']} | {g['diff_kib']} | {g['count_diff']} |"
                for g in p["growth_after_warmup"]]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
