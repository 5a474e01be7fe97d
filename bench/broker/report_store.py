"""What storing compatibility reports costs the SQLite state, tree against tree.

Each round, N receivers report on G groups each (sources drawn among the other nodes,
prompt ids of 16 hex digits, a realistic share undelivered and rejected), given to
`SqliteState.put_report_batches` as the broker gives them (`state.ReportRows`, columns), B
reports to a commit (the group commit of reports arriving together). Measured per tree: the
seconds a round's reports take to store (CPU and wall), the bytes the state file and its WAL
hold after a checkpoint, and one report sent again (all duplicates). Each tree runs in a
process of its own, the trees alternating round after round of repetitions, so that their
ratio comes from the same run on the same machine:

    .venv/bin/python bench/broker/report_store.py --trees /tmp/before /tmp/after [--nodes 64 --groups 1229]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, machine_line, median, write_results  # noqa: E402

_CHILD = r"""
import json, os, random, sys, time
from graft_fed.broker.state import ReportRows
from graft_fed.broker.state_sqlite import SqliteState

nodes, groups, rounds, batch, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rng = random.Random(7)
names = [f"node-{i:04d}" for i in range(nodes)]
prompts = [f"{rng.getrandbits(64):016x}" for _ in range(max(4096, groups))]
s = SqliteState(path)
wall, cpu = [], []
for rnd in range(rounds):
    reports = []
    for receiver in names:
        others = [n for n in names if n != receiver]
        pids = rng.sample(prompts, groups)
        kinds = [rng.random() for _ in pids]
        und = [k < 0.05 for k in kinds]
        rej = [0.05 <= k < 0.08 for k in kinds]
        reports.append(ReportRows(rnd, receiver, [rng.choice(others) for _ in pids], pids,
                                  [0.0 if u or r else rng.uniform(0, 2) for u, r in zip(und, rej)],
                                  [0.0 if u else rng.random() for u in und], rej, und))
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(reports), batch):
        s.put_report_batches(reports[i:i + batch])
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
t0 = time.perf_counter()
again = s.put_report_batches([reports[0]])[0]
resend = time.perf_counter() - t0
assert again == (0, groups), again
s.close()  # the last connection: SQLite checkpoints the WAL into the file and removes it
size = sum(os.path.getsize(path + x) for x in ("", "-wal") if os.path.exists(path + x))
import graft_fed
print(json.dumps({"wall": wall, "cpu": cpu, "bytes": size, "resend_s": resend, "imported": graft_fed.__file__}))
"""


def _one(tree: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="report_store_") as tmp:
        env = {**os.environ, "PYTHONPATH": tree}
        # in the temp dir: `python -c` puts the working directory first on sys.path, where a
        # checkout's graft_fed would win over the tree's
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(args.nodes), str(args.groups), str(args.rounds),
                               str(args.batch), os.path.join(tmp, "broker.sqlite")],
                              env=env, capture_output=True, text=True, timeout=1800, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: {proc.stderr[-3000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        if not out["imported"].startswith(os.path.realpath(tree) + os.sep):
            raise SystemExit(f"the run for {tree} imported {out['imported']}")
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs=2, required=True, metavar=("BASELINE", "CANDIDATE"),
                    help="two checkouts of graft-fed (their roots, put on PYTHONPATH)")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--groups", type=int, default=1229, help="groups per report (30%% all-fail of 4,096 prompts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="reports per commit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="report_store")
    args = ap.parse_args()
    m = machine()  # its speed before the runs
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for _ in range(args.reps):
        for tree in args.trees:
            runs[tree].append(_one(tree, args))
    rev = {t: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                             text=True).stdout.strip() for t in args.trees}
    rows, summary = [], {}
    for tree in args.trees:
        per_round = [w for r in runs[tree] for w in r["wall"]]
        cpu = [c for r in runs[tree] for c in r["cpu"]]
        summary[tree] = {"wall_round_s": median(per_round), "cpu_round_s": median(cpu),
                         "bytes_per_round": median([r["bytes"] for r in runs[tree]]) / args.rounds,
                         "resend_s": median([r["resend_s"] for r in runs[tree]])}
    base, cand = (summary[t] for t in args.trees)
    for tree in args.trees:
        s = summary[tree]
        rows.append(f"| `{rev[tree]}` ({tree}) | {s['wall_round_s'] * 1000:,.1f} | {s['cpu_round_s'] * 1000:,.1f} | "
                    f"{s['bytes_per_round'] / 2**20:,.2f} | {s['resend_s'] * 1000:,.1f} |")
    md = "\n".join([
        f"### Storing compatibility reports ({m['date']})", "",
        machine_line(m) + " Command: `bench/broker/report_store.py "
        f"{' '.join(sys.argv[1:])}`. {args.nodes} receivers x {args.groups} groups a round, {args.batch} reports "
        f"a commit, {args.rounds} rounds, {args.reps} repetitions per tree, the trees alternating; medians.", "",
        "| tree | store a round, wall ms | CPU ms | state bytes per round, MiB | one report sent again, ms |",
        "|---|---:|---:|---:|---:|", *rows, "",
        f"Candidate / baseline: wall {cand['wall_round_s'] / base['wall_round_s']:.3f}x, CPU "
        f"{cand['cpu_round_s'] / base['cpu_round_s']:.3f}x, bytes {cand['bytes_per_round'] / base['bytes_per_round']:.3f}x.",
        ""])
    write_results(args.name, {"machine": m, "args": vars(args), "revs": rev, "runs": runs, "summary": summary}, md)


if __name__ == "__main__":
    main()
