"""A memory probe for a broker process the load bench starts, loaded by Python's `site` when
this directory is on the broker's PYTHONPATH (nothing happens without the variables below):

    .venv/bin/python bench/broker/load.py ... --broker-env PYTHONPATH=bench/broker/memprobe \
        MEMPROBE_SMAPS=120,300,590 MEMPROBE_OUT=/tmp/probe

- MEMPROBE_SMAPS=T1,T2,...: at each age (s) of the process, every mapping of
  /proc/self/smaps (range, size, permissions, name, Rss, Anonymous) to
  `<MEMPROBE_OUT>.<pid>.smaps.json`; `bench/broker/smaps_report.py` groups it (glibc's main
  heap and arenas, thread stacks, other anonymous memory, files).
- MEMPROBE_TRACE=T1,T2,T3: tracemalloc from T1, snapshots at T2 and T3, and what grew
  between them by traceback and by line, with the gc-tracked objects by type, to
  `<MEMPROBE_OUT>.<pid>.trace.txt`. Tracing slows the broker: a diagnosis, not a benchmark.
- MEMPROBE_PYMALLOC=T1,T2,...: at each age, Python's object allocator's own account
  (`sys._debugmallocstats`: arenas mapped, their bytes, the bytes in used blocks and the
  free and fragmented rest) to `<MEMPROBE_OUT>.<pid>.pymalloc.txt`. It writes to the C
  stderr, so that is pointed at the file for the call: broker log lines written in that
  instant land there too.

The probe caps glibc's arenas at MEMPROBE_ARENA_MAX (default 1, as the broker does) before
its threads start, so that the probed broker's heap is laid out as an unprobed one's.

Issue 13, docs/performance.md "thirteenth pass".
"""

import json
import os
import threading
import time


def _smaps() -> list[dict]:
    maps: list[dict] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":") and len(parts) >= 5:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append({"range": parts[0], "size": hi - lo, "perms": parts[1],
                             "name": parts[5] if len(parts) > 5 else "", "rss_kib": 0, "anon_kib": 0})
            elif parts[0] == "Rss:" and maps:
                maps[-1]["rss_kib"] = int(parts[1])
            elif parts[0] == "Anonymous:" and maps:
                maps[-1]["anon_kib"] = int(parts[1])
    return maps


def _at(t0: float, ages: list[float]):
    for age in ages:
        time.sleep(max(0.0, t0 + age - time.monotonic()))
        yield age


def _smaps_probe(t0: float, ages: list[float], out: str) -> None:
    snaps = []
    for age in _at(t0, ages):
        snaps.append({"age_s": age, "maps": _smaps()})
        with open(f"{out}.{os.getpid()}.smaps.json", "w") as f:
            json.dump(snaps, f)


def _trace_probe(t0: float, ages: list[float], out: str) -> None:
    import collections
    import gc
    import tracemalloc

    start, first, second = ages
    list(_at(t0, [start]))
    tracemalloc.start(10)
    list(_at(t0, [first]))
    a, ta = tracemalloc.take_snapshot(), collections.Counter(type(o).__name__ for o in gc.get_objects())
    list(_at(t0, [second]))
    b, tb = tracemalloc.take_snapshot(), collections.Counter(type(o).__name__ for o in gc.get_objects())
    with open(f"{out}.{os.getpid()}.trace.txt", "w") as f:
        f.write(f"traced (current, peak) bytes at {second:.0f} s: {tracemalloc.get_traced_memory()}\n")
        f.write(f"\n=== grown between {first:.0f} and {second:.0f} s, by traceback\n")
        for stat in b.compare_to(a, "traceback")[:25]:
            f.write(f"\n--- {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks (now {stat.size / 1024:.1f} KiB)\n")
            f.write("\n".join(stat.traceback.format()) + "\n")
        f.write("\n=== by line\n")
        for stat in b.compare_to(a, "lineno")[:30]:
            f.write(f"{stat}\n")
        f.write("\n=== gc-tracked objects by type: change (now)\n")
        for name, n in sorted(((k, tb[k] - ta.get(k, 0)) for k in tb), key=lambda kv: -kv[1])[:30]:
            f.write(f"{name} {n:+d} ({tb[name]})\n")


def _pymalloc_probe(t0: float, ages: list[float], out: str) -> None:
    import sys
    import tempfile

    for age in _at(t0, ages):
        with tempfile.TemporaryFile("w+") as tmp:
            sys.stderr.flush()
            saved = os.dup(2)
            try:
                os.dup2(tmp.fileno(), 2)
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            tmp.seek(0)
            keep = [line for line in tmp.read().splitlines() if line.startswith(("#", "Total ", "arena map counts"))]
        with open(f"{out}.{os.getpid()}.pymalloc.txt", "a") as f:
            f.write(f"=== age {age:.0f} s\n" + "\n".join(keep) + "\n")


def _ages(name: str) -> list[float]:
    return [float(x) for x in os.environ.get(name, "").split(",") if x.strip()]


def _cap_arenas() -> None:
    """glibc's arena cap, set before the probe's threads start. The broker sets its own
    (`broker.malloc_arena_max`, 1 by default) only once its command runs; threads started
    before that may each open an arena of their own, and the threads after them share those:
    a probed broker with three arenas ended 40 MiB above the same run without the probe
    (docs/performance.md, issue 13, forty-sixth pass). MEMPROBE_ARENA_MAX (default 1, the
    broker's default; 0 leaves glibc's own) should match the broker's setting."""
    try:
        from graft_fed.broker.heap import limit_malloc_arenas  # the broker's own cap
    except ImportError:  # graft_fed not on the path: the broker cannot run either
        return
    limit_malloc_arenas(int(os.environ.get("MEMPROBE_ARENA_MAX", "1")))


_out = os.environ.get("MEMPROBE_OUT", "/tmp/memprobe")
_t0 = time.monotonic()
_smaps_at, _trace_at, _pymalloc_at = _ages("MEMPROBE_SMAPS"), _ages("MEMPROBE_TRACE"), _ages("MEMPROBE_PYMALLOC")
_trace_at = _trace_at if len(_trace_at) == 3 else []  # tracing needs its three ages
if _smaps_at or _trace_at or _pymalloc_at:
    _cap_arenas()
if _smaps_at:
    threading.Thread(target=_smaps_probe, args=(_t0, _smaps_at, _out), daemon=True).start()
if _trace_at:
    threading.Thread(target=_trace_probe, args=(_t0, _trace_at, _out), daemon=True).start()
if _pymalloc_at:
    threading.Thread(target=_pymalloc_probe, args=(_t0, _pymalloc_at, _out), daemon=True).start()
