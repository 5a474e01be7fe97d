"""Where a process's resident memory is, from the /proc/self/smaps snapshots that
bench/broker/memprobe takes (MEMPROBE_SMAPS), grouped by kind of mapping:

    .venv/bin/python bench/broker/smaps_report.py /tmp/probe.<pid>.smaps.json   # or a .json.gz

- `glibc main heap`: the [heap] mapping (brk), malloc's main arena;
- `glibc arenas`: anonymous read-write mappings that start on a 64 MiB boundary and are at
  most that large (malloc's other arenas; their unused reserve is `reserved`);
- `thread stacks`: anonymous 8 MiB read-write mappings (one per thread; guard pages apart);
- `other anonymous`: the rest: Python's object arenas (256 KiB-1 MiB mmaps, merged by the
  kernel when adjacent), blocks malloc maps whole, gRPC's and OpenSSL's own maps;
- `files`: mapped files (libraries), and `reserved`: mappings without access.

Prints resident MiB (and mapping count) per kind at each snapshot, the thread stacks'
resident sizes, and the mappings that grew most between the last two snapshots.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

ARENA = 64 * 2**20
STACK = 8 * 2**20


def kind(m: dict) -> str:
    if m["name"].startswith("["):
        return {"[heap]": "glibc main heap"}.get(m["name"], m["name"])
    if m["name"]:
        return "files"
    if m["perms"].startswith("---"):
        return "reserved"
    if m["size"] == STACK:
        return "thread stacks"
    if m["size"] <= ARENA and int(m["range"].split("-")[0], 16) % ARENA == 0:
        return "glibc arenas"
    return "other anonymous"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    opener = gzip.open if argv[0].endswith(".gz") else open
    with opener(argv[0], "rt") as f:
        snaps = json.load(f)
    kinds = ["glibc main heap", "glibc arenas", "thread stacks", "other anonymous", "files"]
    print("| age s | " + " | ".join(kinds) + " | total |")
    print("|---:|" + "---:|" * (len(kinds) + 1))
    for s in snaps:
        agg: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for m in s["maps"]:
            a = agg[kind(m)]
            a[0] += m["rss_kib"]
            a[1] += 1
        cells = [f"{agg[k][0] / 1024:.1f} ({agg[k][1]})" for k in kinds]
        print(f"| {s['age_s']:.0f} | " + " | ".join(cells) + f" | {sum(v[0] for v in agg.values()) / 1024:.1f} |")
    for s in (snaps[0], snaps[-1]):
        st = sorted(m["rss_kib"] for m in s["maps"] if kind(m) == "thread stacks")
        if st:
            print(f"\nthread stacks at {s['age_s']:.0f} s: {len(st)}, resident KiB p50 {st[len(st) // 2]}, "
                  f"max {st[-1]}, in all {sum(st) / 1024:.1f} MiB")
    if len(snaps) >= 2:
        def start(m: dict) -> str:  # a heap or an arena keeps its start as it grows
            return m["range"].split("-")[0]

        a, b = {start(m): m for m in snaps[-2]["maps"]}, {start(m): m for m in snaps[-1]["maps"]}
        grown = sorted(((b[r]["rss_kib"] - a.get(r, {"rss_kib": 0})["rss_kib"], r, kind(b[r])) for r in b),
                       reverse=True)[:8]
        print(f"\nmappings that grew most between {snaps[-2]['age_s']:.0f} and {snaps[-1]['age_s']:.0f} s:")
        for kib, r, k in grown:
            print(f"  {kib:+d} KiB  {b[r]['range']}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
