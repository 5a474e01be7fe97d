"""The timeline of a threadprobe file (sitecustomize.py): per sample, its age in seconds,
the threads counted and where the most of them were.

    python bench/broker/threadprobe/report.py /tmp/probe.<pid>.jsonl [--top 4] [--min-threads 50]
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--min-threads", type=int, default=0, help="only samples with at least this many threads")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.file)]
    if not rows:
        return
    t0 = rows[0]["t"]
    for r in rows:
        total = sum(r["c"].values())
        if total < args.min_threads:
            continue
        top = sorted(r["c"].items(), key=lambda kv: -kv[1])[:args.top]
        print(f"{r['t'] - t0:7.1f} s {total:5d} threads | " + " | ".join(f"{n} {k}" for k, n in top))


if __name__ == "__main__":
    main()
