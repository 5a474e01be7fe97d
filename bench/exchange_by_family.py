"""Which of a receiver's all-fail prompts each peer filled, per task family, in a finished
co-training run whose metrics predate the per-family counts (issue 15, setting E).

Runs since 72e74ed log `graft/from/<peer>/family/<family>/replaced` themselves. For older
runs this recomputes the exchange from what every member recorded: each step's k per
prompt (the members' trajectories.sqlite), `core.exchange.select_sources` with the run's
own rule (balance, source choice from the receiver's config.json), and, for compatibility,
each source's mean s over the whole run as the receiver logged it (graft/from/<peer>/s_mean).
The live run's estimates moved during the run (and an untried source is preferred until
its first report), so this is an approximation: it prints the totals beside the logged
ones (graft/from/<peer>/replaced) to show how close it came.

    python bench/exchange_by_family.py runs/miniature-carry/graft_all/seed0/all --receiver qwen3 --until 28
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import sys
from pathlib import Path

from graft_fed.configbase import from_mapping
from graft_fed.core.exchange import select_sources
from graft_fed.data.config import DataConfig, load_prompts


def recorded(run: Path) -> dict[int, dict[str, tuple[int, int]]]:
    """step -> prompt id -> (k, n) of one member's own groups."""
    out: dict[int, dict[str, tuple[int, int]]] = collections.defaultdict(dict)
    with sqlite3.connect(f"file:{run / 'trajectories.sqlite'}?mode=ro", uri=True) as db:
        for step, pid, k, n in db.execute("SELECT step, prompt_id, k, n FROM groups"):
            out[step][pid] = (k, n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("group_dir", type=Path, help="a co-training run's folder (one sub-folder per member)")
    ap.add_argument("--receiver", required=True)
    ap.add_argument("--until", type=int, default=None, help="also count steps <= UNTIL separately")
    args = ap.parse_args(argv)
    members = sorted(p.name for p in args.group_dir.iterdir() if (p / "trajectories.sqlite").exists())
    if args.receiver not in members:
        ap.error(f"{args.receiver} is not one of the run's members {members}")
    cfg = json.loads((args.group_dir / args.receiver / "config.json").read_text())
    family = {p.id: p.meta.get("family", "?") for p in load_prompts(from_mapping(DataConfig, cfg["data"]))}
    rows = [json.loads(x) for x in (args.group_dir / args.receiver / "metrics.jsonl").read_text().splitlines()]
    r = members.index(args.receiver)
    compat, logged = {}, {}
    for s, name in enumerate(members):
        vals = [row[f"graft/from/{name}/s_mean"] for row in rows if f"graft/from/{name}/s_mean" in row]
        if vals:
            compat[(s, r)] = statistics.fmean(vals)
        logged[name] = sum(row.get(f"graft/from/{name}/replaced", 0) for row in rows)
    kn_by_member = [recorded(args.group_dir / m) for m in members]
    steps = sorted(set.intersection(*(set(k) for k in kn_by_member)))
    g = cfg["graft"]
    counts: collections.Counter = collections.Counter()
    ks: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for step in steps:
        kn = [m[step] for m in kn_by_member]
        chosen = select_sources(kn, g["balance"] == "pairwise", compat, choice=g["source_choice"],
                                key=f"{cfg['run'].get('schedule_seed')}|{step}")[r]
        for pid, s in chosen.items():
            src, fam = members[s], family.get(pid, "?")
            counts[src, fam, "all"] += 1
            ks[src, fam].append(kn[s][pid][0])
            if args.until is not None and step <= args.until:
                counts[src, fam, f"<={args.until}"] += 1
    print(f"receiver {args.receiver} in {args.group_dir} ({len(steps)} steps; members {members}; "
          f"compatibility used: { {members[s]: round(v, 3) for (s, _), v in compat.items()} })")
    for src in members:
        if src == args.receiver:
            continue
        total = sum(v for (s, _, w), v in counts.items() if s == src and w == "all")
        print(f"  from {src}: recomputed {total} groups, logged {logged[src]:.0f}")
        for fam in sorted({f for (s, f, _) in counts if s == src}):
            early = f", {counts[src, fam, f'<={args.until}']} by step {args.until}" if args.until is not None else ""
            k = ks[src, fam]
            print(f"    {fam:>13}: {counts[src, fam, 'all']}{early}; the source's k: mean {statistics.fmean(k):.2f}, "
                  f"histogram {dict(sorted(collections.Counter(k).items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
