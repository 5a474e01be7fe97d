"""GRAFT's per-step overhead over GRPO, from the miniature experiment's own runs.

GRAFT adds one thing to a step: the receiver's no-grad likelihood pass over the peer
responses it is offered, with their re-tokenisation (`time/graft` in the metrics). This
reads the runs `graft-fed experiment` wrote and reports, per receiver:

- `time/graft` as a share of the GRAFT arm's own step time (the direct measure), and
- GRAFT step time / GRPO n=8 step time of the same receiver and seeds (the end-to-end
  ratio; it also moves with response lengths, which training changes),

both measured in the same experiment run on the same machine.

    python bench/graft_overhead.py runs/miniature
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if "time/step" in r]


def main(root: str) -> int:
    base = Path(root)
    lines = ["| receiver | GRAFT steps | time/graft / step | GRAFT step s | GRPO n=8 step s | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    receivers = sorted({p.name for p in base.glob("graft/seed*/*/*") if p.is_dir()})
    if not receivers:
        print(f"no GRAFT runs under {base}/graft; run graft-fed experiment first", file=sys.stderr)
        return 1
    for recv in receivers:
        graft = [r for p in base.glob(f"graft/seed*/*/{recv}/metrics.jsonl") for r in rows(p)]
        grpo = [r for p in base.glob(f"grpo_n8/seed*/{recv}/metrics.jsonl") for r in rows(p)]
        share = statistics.fmean(r.get("time/graft", 0.0) / r["time/step"] for r in graft)
        g_step = statistics.fmean(r["time/step"] for r in graft)
        b_step = statistics.fmean(r["time/step"] for r in grpo) if grpo else float("nan")
        lines.append(f"| {recv} | {len(graft)} | {100 * share:.1f}% | {g_step:.2f} | {b_step:.2f} | "
                     f"{g_step / b_step:.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/miniature"))
