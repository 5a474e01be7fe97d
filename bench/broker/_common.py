"""Shared pieces of the broker benchmarks: servers in a child process (their own GIL, as a
real broker has), a raw-bytes gRPC baseline server, percentiles, machine facts."""

from __future__ import annotations

import json
import math
import random
import shutil
import threading
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

# Raw baseline service: bytes in, bytes out, no protobuf, no handler work.
RAW_SERVICE = "graftbench.Raw"


# Share of groups that are all-fail, informative and all-pass in a round. Real rounds are
# not uniform in k (which makes only 2 of n + 1 outcomes uninformative): issue 13's external
# load client and the miniature runs see about 30% all-fail, 50% informative, 20% all-pass.
# The number of all-fail x informative pairs is what drives matching's cost, so the benches
# publish this mix unless told otherwise (`uniform` reproduces the older tables).
K_MIX = {"realistic": (0.3, 0.5, 0.2), "uniform": None}


def draw_k(rng: random.Random, n: int, mix: tuple[float, float, float] | None = K_MIX["realistic"]) -> int:
    """One group's successes: uniform in 0..n (mix None), or all-fail / informative
    (uniform in 1..n-1) / all-pass with the mix's probabilities."""
    if mix is None:
        return rng.randint(0, n)
    u = rng.random()
    if u < mix[0]:
        return 0
    if u < mix[0] + mix[1] and n > 1:
        return rng.randint(1, n - 1)
    return n


def make_summaries(rng: random.Random, prompt_ids: list[str], round: int, n: int,
                   mix: tuple[float, float, float] | None = K_MIX["realistic"]) -> list:
    """Random but well-formed group summaries (k of n correct, drawn with `mix`, per-response
    lengths and mean log-probs) for one round: the load the broker benches publish."""
    from graft_fed.proto import broker_pb2 as pb

    out = []
    for pid in prompt_ids:
        k = draw_k(rng, n, mix)
        p = k / n
        out.append(pb.GroupSummary(prompt_id=pid, round=round, policy_version=round, n=n, k=k, reward_mean=p,
                                   reward_std=math.sqrt(p * (1 - p)),
                                   lengths=[rng.randint(1, 1024) for _ in range(n)],
                                   mean_logprobs=[-rng.uniform(0.0, 3.0) for _ in range(n)]))
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout
        rev = ""
    import grpc

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu": cpu, "python": platform.python_version(), "grpc": grpc.__version__, "git": rev,
            "load_avg_at_start": os.getloadavg(), "speed": machine_speed()}


def machine_speed(reps: int = 5) -> dict[str, float]:
    """How fast this machine runs the kinds of work a broker does, timed as the bench starts
    (medians of `reps`; about a second in all): an interpreter loop of 1,000,000 additions
    (ms); a point read by primary key from an SQLite file in WAL mode, as the broker's state
    reads (us; each takes the file's locks); SHA-256 over 16 MiB (ms); and a wake-up round trip
    between two threads (us; the GIL's and every queue's hand-offs). The ratios a bench
    reports compare with a baseline of the same run; the broker's own latencies (match p99,
    say) do not, and the same "AMD EPYC" ran the same code at half the speed on another day
    (issue 13, fifty-seventh pass): these tell such days apart."""
    import hashlib
    import sqlite3
    import tempfile

    def loop() -> None:
        total = 0
        for i in range(1_000_000):
            total += i

    folder = tempfile.mkdtemp(prefix="graft-bench-speed-")
    conn = sqlite3.connect(os.path.join(folder, "s.db"))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
    conn.executemany("INSERT INTO t VALUES (?, ?)", ((i, "x" * 32) for i in range(10_000)))
    conn.commit()

    def reads() -> None:
        for i in range(2_000):
            conn.execute("SELECT v FROM t WHERE k = ?", (i * 2,)).fetchone()

    blob = bytes(16 * 2**20)

    def handoffs(count: int = 2_000) -> None:
        ping, pong = threading.Event(), threading.Event()

        def other() -> None:
            for _ in range(count):
                ping.wait()
                ping.clear()
                pong.set()

        t = threading.Thread(target=other, daemon=True)
        t.start()
        for _ in range(count):
            ping.set()
            pong.wait()
            pong.clear()
        t.join()

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    try:
        return {"python_loop_ms": round(timed(loop) * 1e3, 2), "sqlite_read_us": round(timed(reads) / 2_000 * 1e6, 2),
                "sha256_16mib_ms": round(timed(lambda: hashlib.sha256(blob).digest()) * 1e3, 2),
                "thread_handoff_us": round(timed(handoffs) / 2_000 * 1e6, 2)}
    finally:
        conn.close()
        shutil.rmtree(folder, ignore_errors=True)


def machine_line(info: dict[str, Any]) -> str:
    """The results' line on the machine: what it is, what ran, and how fast it ran today."""
    speed = info.get("speed") or {}
    line = (f"Machine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, grpcio {info['grpc']}, "
            f"git {info['git']}")
    if speed:
        line += (f"; its speed at the start: a 1M-step Python loop {speed['python_loop_ms']:.1f} ms, an SQLite point "
                 f"read {speed['sqlite_read_us']:.2f} us, SHA-256 of 16 MiB {speed['sha256_16mib_ms']:.1f} ms, a "
                 f"wake-up round trip between two threads {speed.get('thread_handoff_us', float('nan')):.1f} us")
    return line + "."


# ----- child-process servers -----------------------------------------------------------------

def _raw_server(conn, max_message_mib: int, chunk: int) -> None:
    import grpc

    from graft_fed.federation.transport import grpc_options

    store: dict[bytes, bytes] = {}
    ack = b"\x08\x01"  # the size of a PublishResponse(accepted=...) on the wire, roughly

    def unary(request: bytes, context) -> bytes:  # no-op: the broker's baseline for PublishSummaries
        return ack

    def put(request_iterator, context) -> bytes:  # stream in, like UploadBundle
        parts = [c for c in request_iterator]
        data = b"".join(parts)
        store[b"last"] = data
        return len(data).to_bytes(8, "big")

    def get(request: bytes, context):  # stream out, like FetchBundle
        data = store.get(b"last", b"")
        for off in range(0, max(1, len(data)), chunk):
            yield data[off:off + chunk]

    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Put": grpc.stream_unary_rpc_method_handler(put),
        "Get": grpc.unary_stream_rpc_method_handler(get),
    })
    # The same thread pool size and options as BrokerServer.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=grpc_options(max_message_mib))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()  # wait for stop
    server.stop(0.5).wait()
    conn.send("stopped")


def _broker_server(conn, cfg_map: dict) -> None:
    import faulthandler
    import logging
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack (a stuck cell)
    logging.basicConfig(level=logging.WARNING)
    from graft_fed.broker.config import BrokerConfig
    from graft_fed.broker.server import start_broker
    from graft_fed.configbase import from_mapping

    server = start_broker(from_mapping(BrokerConfig, cfg_map))  # as `graft-fed broker` starts it
    every = float(os.environ.get("GRAFT_BENCH_PROGRESS_S", "0"))
    if every > 0:  # a line every `every` seconds on stderr: where a long cell stands
        threading.Thread(target=_progress, args=(server, every), daemon=True).start()
    conn.send(server.port)
    msg = conn.recv()
    out = {}
    if msg == "stats":
        st = server.servicer.stats
        out = {m: {"count": st.hist[m][-1], "sum_s": st.sum[m]} for m in st.hist}
        conn.send(out)
        conn.recv()
    server.stop(0.5)
    conn.send("stopped")


def stack_summary(tag: str) -> None:
    """Every thread's stack (innermost 6 frames), identical stacks counted once, on stderr."""
    import traceback
    from collections import Counter

    names = {t.ident: t.name for t in threading.enumerate()}
    seen: Counter = Counter()
    for ident, frame in sys._current_frames().items():
        stack = traceback.extract_stack(frame)[-6:]
        seen[(names.get(ident, "?").rstrip("0123456789_-"),
              tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack))] += 1
    lines = [f"[{tag}] {count} x {name}: " + " <- ".join(reversed(stack)) for (name, stack), count in seen.most_common()]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _progress(server, every: float) -> None:
    fed, t0 = server.fed, time.monotonic()
    while True:
        time.sleep(every)
        r = fed.current_round()
        calls = {f"{m} {code}": n for (m, code), n in sorted(server.servicer.stats.calls.items())}
        print(f"[broker +{time.monotonic() - t0:.0f}s] threads {threading.active_count()} round {r} published "
              f"{[fed.index.published_count(x) for x in range(max(0, r - 1), r + 1)]} online "
              f"{fed.registry.online_count()} polls waiting {sum(fed.answers._polls.values())} calls {calls}",
              file=sys.stderr, flush=True)
        if os.environ.get("GRAFT_BENCH_STACKS_AT_S") and time.monotonic() - t0 >= float(
                os.environ["GRAFT_BENCH_STACKS_AT_S"]):
            stack_summary("broker stacks")
            os.environ.pop("GRAFT_BENCH_STACKS_AT_S")


class ChildServer:
    """A server in a spawned child process on 127.0.0.1:<ephemeral>."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        target = _broker_server if kind == "broker" else _raw_server
        args = (child, kwargs["cfg"]) if kind == "broker" else (child, kwargs.get("max_message_mib", 16),
                                                                kwargs.get("chunk", 1 << 20))
        self.kind = kind
        self.proc = ctx.Process(target=target, args=args, daemon=True)
        # a broker runs as `graft-fed broker` runs it: with glibc's per-thread caches off unless
        # its config keeps them, which glibc reads from the environment the child starts with
        from graft_fed.broker.heap import without_tcache

        env = (without_tcache(os.environ) if kind == "broker" and not kwargs["cfg"].get("malloc_tcache", False)
               else None)
        before = os.environ.get("GLIBC_TUNABLES")
        if env is not None:
            os.environ["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"]
        try:
            self.proc.start()
        finally:
            if env is not None:
                if before is None:
                    os.environ.pop("GLIBC_TUNABLES")
                else:
                    os.environ["GLIBC_TUNABLES"] = before
        if not self.conn.poll(120):
            self.proc.kill()
            raise RuntimeError(f"{kind} server did not start")
        self.port = self.conn.recv()
        self.address = f"127.0.0.1:{self.port}"

    def rpc_stats(self) -> dict:
        """Broker only: the servicer's per-method counts and summed handler seconds."""
        self.conn.send("stats")
        return self.conn.recv() if self.conn.poll(60) else {}

    def stop(self) -> None:
        try:
            self.conn.send("stop")
            self.conn.poll(30)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def add_broker_set(ap) -> None:
    """`--set KEY=VALUE` (repeatable): a broker setting over the bench's."""
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="broker config override (VALUE parsed as JSON when it parses), e.g. --set work_slots=64 "
                         "or --set front_process=true")


def broker_sets(items: list[str]) -> dict:
    """The --set items as broker config overrides."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def write_prompts(path: Path, count: int, problem_chars: int = 0) -> Path:
    with path.open("w", encoding="utf-8") as fh:
        for i in range(count):
            problem = f"What is {i} + {i + 1}?" + (" " + "x" * problem_chars if problem_chars else "")
            fh.write(json.dumps({"problem": problem, "answer": str(2 * i + 1)}) + "\n")
    return path


def write_results(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """Write RESULTS/<name>.json and .md, and print the table and where it went."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    j = RESULTS / f"{name}.json"
    m = RESULTS / f"{name}.md"
    j.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    m.write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"wrote {j} and {m}")
    return j, m


def run_threads(target, count: int, timeout_s: float, barrier) -> None:
    """Run target(i) for i in range(count) on threads; a failure aborts the shared barrier
    (so the others do not wait forever) and is re-raised here."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            if not errors:  # the first one now: the others (a broken barrier) follow from it
                print(f"run_threads: thread {i} failed: {exc!r}"[:1000], file=sys.stderr, flush=True)
            errors.append(exc)
            barrier.b.abort()

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    if errors:
        raise errors[0]
