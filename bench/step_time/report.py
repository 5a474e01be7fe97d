"""Pool the interleaved runs of run.sh into one table: per framework the median seconds per
step (over every timed warm step of every round) split into rollout / verify / train, and
the ratio TRL / graft-fed. Writes <out>.json and <out>.md and prints the Markdown.

    python bench/step_time/report.py --runs bench/step_time/work/runs --out bench/step_time/results/step_time
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

FRAMEWORKS = ("graft-fed", "trl")
COLUMNS = ("rollout", "verify", "train", "step")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def nproc() -> int:
    try:
        return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
    except (OSError, ValueError, subprocess.CalledProcessError):
        return os.cpu_count() or 0


def git_describe() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix")
    ap.add_argument("--command", default="bash bench/step_time/run.sh")
    ap.add_argument("--load", default="", help="load averages seen during the runs (run.sh passes them)")
    args = ap.parse_args()

    runs = []
    for p in sorted(args.runs.glob("*.json")):
        run = json.loads(p.read_text())
        run["round"] = p.stem.split("-", 1)[0]  # r<k>-<framework>.json
        runs.append(run)
    by_fw = {fw: [r for r in runs if r["framework"] == fw] for fw in FRAMEWORKS}
    for fw, rs in by_fw.items():
        if not rs:
            raise SystemExit(f"no {fw} runs under {args.runs}")
    summary: dict[str, dict] = {}
    for fw, rs in by_fw.items():
        rows = [row for r in rs for row in r["timed"]]
        summary[fw] = {
            "runs": len(rs), "timed_steps": len(rows), "warmup_steps_per_run": len(rs[0]["warmup"]),
            "median": {c: statistics.median(row[c] for row in rows) for c in COLUMNS},
            "min": {c: min(row[c] for row in rows) for c in COLUMNS},
            "max": {c: max(row[c] for row in rows) for c in COLUMNS},
            "median_completion_tokens": statistics.median(row["completion_tokens"] for row in rows),
            "per_round_step_median": [statistics.median(row["step"] for row in r["timed"]) for r in rs],
            "versions": rs[0]["versions"], "model": rs[0]["model"], "threads": rs[0]["threads"],
            "notes": rs[0]["notes"],
        }
    g, t = summary["graft-fed"]["median"], summary["trl"]["median"]
    ratio = {c: (t[c] / g[c] if g[c] > 0 else float("nan")) for c in COLUMNS}
    paired = [tr / gr for gr, tr in zip(summary["graft-fed"]["per_round_step_median"],
                                        summary["trl"]["per_round_step_median"])]
    # Step i of graft-fed and step i of TRL ran next to each other in the same process: the
    # ratio of each such pair sees the least machine noise.
    rounds = {}
    for r in runs:
        rounds.setdefault(r["round"], {})[r["framework"]] = r
    pair_ratios = [t_row["step"] / g_row["step"] for pair in rounds.values() if len(pair) == 2
                   for g_row, t_row in zip(pair["graft-fed"]["timed"], pair["trl"]["timed"])]
    result = {
        "command": args.command,
        "machine": {"nproc": nproc(), "cpu": cpu_model(), "load_average": args.load,
                    "python": platform.python_version()},
        "batch": runs[0]["batch"],
        "frameworks": summary,
        "ratio_trl_over_graft_fed": ratio,
        "per_round_step_ratio": paired,
        "adjacent_step_pair_ratio_median": statistics.median(pair_ratios) if pair_ratios else None,
        "git": git_describe(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2), encoding="utf-8")

    b = runs[0]["batch"]
    v = summary["trl"]["versions"]
    lines = [
        f"Seconds per GRPO step, median over {summary['graft-fed']['timed_steps']} (graft-fed) and "
        f"{summary['trl']['timed_steps']} (TRL) warm steps from {summary['graft-fed']['runs']} interleaved "
        f"rounds, each run after {summary['graft-fed']['warmup_steps_per_run']} untimed warm-up step.",
        "",
        f"Step: {b['prompts_per_step']} prompts x n={b['n']}, max {b['max_new_tokens']} new tokens, "
        f"T={b['temperature']}, {b['num_minibatches']} optimiser steps; model {summary['graft-fed']['model']}; "
        f"torch threads {summary['graft-fed']['threads']}, {b['verifier_workers']} verifier workers.",
        f"Machine: {result['machine']['nproc']} x {result['machine']['cpu']}"
        + (f" (load average {args.load})" if args.load else "") + ".",
        f"Versions: torch {v.get('torch')}, transformers {v.get('transformers')}, trl {v.get('trl')}, "
        f"accelerate {v.get('accelerate')}, graft-fed {v.get('graft-fed')} (git {result['git']}).",
        "",
        "| framework | rollout s | verify s | train s | step s | completion tokens/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fw in FRAMEWORKS:
        m = summary[fw]["median"]
        lines.append(f"| {fw} | {m['rollout']:.2f} | {m['verify']:.3f} | {m['train']:.2f} | {m['step']:.2f} | "
                     f"{summary[fw]['median_completion_tokens']:.0f} |")
    lines.append(f"| **TRL / graft-fed** | {ratio['rollout']:.2f}x | {ratio['verify']:.2f}x | "
                 f"{ratio['train']:.2f}x | **{ratio['step']:.2f}x** | |")
    lines += [
        "",
        "Per-round step medians (s): graft-fed "
        + ", ".join(f"{x:.2f}" for x in summary["graft-fed"]["per_round_step_median"])
        + "; TRL " + ", ".join(f"{x:.2f}" for x in summary["trl"]["per_round_step_median"])
        + "; per-round ratio " + ", ".join(f"{x:.2f}" for x in paired)
        + (f"; median ratio of adjacent step pairs {result['adjacent_step_pair_ratio_median']:.2f}."
           if pair_ratios else "."),
        "train = step - rollout - verify (everything else in the step: old log-probs, advantages, "
        "4 x forward/backward/clip/AdamW, bookkeeping).",
    ]
    md = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)


if __name__ == "__main__":
    main()
