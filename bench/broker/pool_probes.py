"""The probe heartbeats of several `load.py` runs, pooled, per tree: how sure a p99 is.

A 2-minute `load.py --probes 4` run times about 236 probe heartbeats, so its p99 (nearest
rank) is the third slowest of them: one slow heartbeat more or less moves it by tens of ms.
Comparing two trees by their runs' p99s then mostly compares noise. This pools each
group's runs and prints, per run and pooled, the p50 / p90 / p99 with a bootstrap 95%
interval for the p99, and how many heartbeats went over `--limit-ms`; with two groups, an
exact test of whether the share over the limit differs (Fisher's, two-sided).

    .venv/bin/python bench/broker/pool_probes.py \\
        --group tip bench/broker/results/s64_mtls_hb_T_*.json bench/broker/results/s64_mtls_hb_end.json \\
        --group before bench/broker/results/s64_mtls_hb_V_*.json

Only the probes' round trips are pooled (`probe_beats`: sent .. received, each probe alone
in its process); the restart windows are not removed (the heartbeat runs restart nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentile  # noqa: E402


def round_trips_ms(path: str) -> list[float]:
    """The probe heartbeats' round trips of one load.py result, in ms (ValueError: not one)."""
    data = json.loads(Path(path).read_text())
    beats = data.get("probe_beats") if isinstance(data, dict) else None
    if not isinstance(beats, dict):
        raise ValueError(f"{path}: no probe_beats (not a load.py result, or from before they were kept)")
    return [1e3 * (b[-1] - b[0]) for per_node in beats.values() for b in per_node if len(b) >= 2]


def p99_interval(xs: list[float], reps: int, rng: random.Random) -> tuple[float, float]:
    """A percentile-bootstrap 95% interval of the nearest-rank p99."""
    n = len(xs)
    stats = sorted(percentile([xs[rng.randrange(n)] for _ in range(n)], 99) for _ in range(reps))
    return stats[int(0.025 * reps)], stats[min(reps - 1, int(0.975 * reps))]


def fisher_two_sided(a: int, n_a: int, b: int, n_b: int) -> float:
    """Fisher's exact test of a/n_a against b/n_b (two-sided: every table of the same margins
    no likelier than the one observed)."""
    total, hits = n_a + n_b, a + b

    def prob(x: int) -> float:
        return math.comb(hits, x) * math.comb(total - hits, n_a - x) / math.comb(total, n_a)

    observed = prob(a)
    return min(1.0, sum(p for x in range(max(0, hits - n_b), min(hits, n_a) + 1)
                        if (p := prob(x)) <= observed * (1 + 1e-9)))


def describe(xs: list[float], limit_ms: float, reps: int, rng: random.Random) -> dict:
    lo, hi = p99_interval(xs, reps, rng)
    return {"count": len(xs), "p50_ms": percentile(xs, 50), "p90_ms": percentile(xs, 90),
            "p99_ms": percentile(xs, 99), "p99_ci95_ms": [lo, hi], "max_ms": max(xs),
            "over_limit": sum(x > limit_ms for x in xs)}


def line(name: str, d: dict) -> str:
    lo, hi = d["p99_ci95_ms"]
    return (f"{name:<28} {d['count']:6d} {d['p50_ms']:7.1f} {d['p90_ms']:7.1f} {d['p99_ms']:7.1f} "
            f"[{lo:6.1f}, {hi:6.1f}] {d['max_ms']:7.1f} {d['over_limit']:5d} ({100 * d['over_limit'] / d['count']:.2f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "RESULT"),
                    help="a name, then the load.py result files (.json) of its runs; give it once or twice")
    ap.add_argument("--limit-ms", type=float, default=100.0, help="the heartbeat target (issue 13: 100 ms)")
    ap.add_argument("--reps", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the figures there")
    args = ap.parse_args()
    if len(args.group) > 2 or any(len(g) < 2 for g in args.group):
        ap.error("give --group NAME FILE... once or twice")
    rng = random.Random(args.seed)
    out: dict = {"limit_ms": args.limit_ms, "groups": {}}
    print(f"{'run':<28} {'beats':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'p99 95% interval':>16} {'max':>7} "
          f"over {args.limit_ms:g} ms")
    pooled = {}
    for name, *files in args.group:
        runs = {}
        for f in files:
            xs = round_trips_ms(f)
            if not xs:
                sys.exit(f"{f}: no probe heartbeats")
            runs[f] = describe(xs, args.limit_ms, args.reps, rng)
            print(line("  " + Path(f).stem, runs[f]))
        pooled[name] = [x for f in files for x in round_trips_ms(f)]
        total = describe(pooled[name], args.limit_ms, args.reps, rng)
        print(line(f"{name} ({len(files)} runs pooled)", total))
        out["groups"][name] = {"runs": runs, "pooled": total}
    if len(pooled) == 2:
        (na, a), (nb, b) = ((k, out["groups"][k]["pooled"]) for k in pooled)
        p = fisher_two_sided(a["over_limit"], a["count"], b["over_limit"], b["count"])
        out["over_limit_fisher_p"] = p
        print(f"over {args.limit_ms:g} ms: {na} {a['over_limit']} of {a['count']}, {nb} {b['over_limit']} of "
              f"{b['count']}; Fisher's exact test, two-sided p = {p:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
