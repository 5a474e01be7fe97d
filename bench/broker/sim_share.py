"""The federation's share of a node's step time in the 3-node simulation.

Runs `graft-fed sim --nodes 3` (a broker and three node processes over loopback gRPC) on a
small config with the zoo models (graft_fed/zoo/models; any missing is replaced by the test
suite's tiny model, tests/conftest.py::build_tiny_model, and then every node uses the
plugin verifier tests.plugins:odd_char_sum), and reports per node, from its metrics.jsonl:

    share = mean(time/federation) / mean(time/step)

with mean(time/graft) / mean(time/step) beside it. time/federation covers publish, uploads,
the GetMatches long-poll (which includes waiting for the slowest peer to publish: the
synchronous barrier), fetches, re-verification, re-tokenisation and scoring of received
groups, and the report; time/graft is the receive/score part inside it. The first step
(warm-up) is reported apart.

    .venv/bin/python bench/broker/sim_share.py [--quick] [--steps S]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

from _common import ROOT, machine, machine_line, write_results  # noqa: E402

ZOO = ROOT / "graft_fed" / "zoo" / "models"
FAMILIES = ["add", "sub", "mul"]


def zoo_models() -> list[str]:
    if not ZOO.is_dir():
        return []
    return sorted(d.name for d in ZOO.iterdir() if (d / "config.json").is_file() and (d / "model.safetensors").is_file()
                  and (d / "tokenizer.json").is_file())


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 steps, 4 prompts per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (= broker prompts_per_round)")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=540.0)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prompts = 3, 4
    name = args.name or ("sim_share_quick" if args.quick else "sim_share")
    info = machine()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="graft-bench-sim-") as tmpd:
        tmp = Path(tmpd)
        found = zoo_models()[:3]
        models = [{"path": f"zoo:{m}"} for m in found]
        built = []
        if len(models) < 3:
            from tests.conftest import build_tiny_model

            for i, arch in enumerate(["llama", "gpt2", "llama"][: 3 - len(models)]):
                path = build_tiny_model(tmp / f"tiny-{arch}-{i}", arch, seed=i)
                models.append({"path": str(path)})
                built.append(f"tiny-{arch} (seed {i})")
        verifier = {"name": "tests.plugins:odd_char_sum"} if built else {"name": "math_verify", "workers": 1}
        data = {"source": "embedded:arith-v1", "split": "train", "families": FAMILIES}
        cfg = {
            "output_dir": str(tmp / "sim"),
            "timeout_s": args.timeout_s,
            "broker": {"federation_id": "bench", "data": data, "verifier": verifier, "seed": 0, "n": args.n,
                       "prompts_per_round": args.prompts, "mode": "sync", "balance": "pairwise",
                       "round_deadline_s": 300},
            "base": {"run": {"steps": args.steps, "seed": 0, "checkpoint_every": 0},
                     "data": data, "rollout": {"n": args.n, "max_new_tokens": args.max_new_tokens},
                     "verifier": verifier,
                     "algorithm": {"prompts_per_step": args.prompts, "num_minibatches": 2},
                     "optim": {"lr": 3.0e-4},
                     "eval": {"data": {"source": "embedded:arith-v1", "split": "test", "families": FAMILIES,
                                       "per_family": 2}, "k": 1},
                     "federation": {"privacy": "share_all", "round_timeout_s": 300}},
            "nodes": [{"name": f"node{i}", "model": m} for i, m in enumerate(models)],
        }
        cfg_path = tmp / "sim.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "graft_fed.cli", "sim", "--config", str(cfg_path), "--nodes", "3", "--quiet"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s + 60)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            logs = tmp / "sim" / "logs"
            tail = "".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("*.log"))) \
                if logs.is_dir() else ""
            print(proc.stdout[-3000:], proc.stderr[-3000:], tail, sep="\n")
            return 1
        nodes = []
        for i, m in enumerate(models):
            rows = [json.loads(line) for line in (tmp / "sim" / f"node{i}" / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "time/step" in r]
            keys = sorted({k for r in rows for k in r if k.startswith("time/")})

            def col(key: str, rs: list[dict]) -> list[float]:
                return [float(r.get(key) or 0.0) for r in rs]

            later = rows[1:]
            entry = {"node": f"node{i}", "model": m["path"], "steps": len(rows), "time_keys": keys,
                     "mean_step_s": mean(col("time/step", later)),
                     "mean_federation_s": mean(col("time/federation", later)),
                     "mean_graft_s": mean(col("time/graft", later)),
                     "first_step_s": rows[0]["time/step"] if rows else float("nan"),
                     "first_federation_s": rows[0].get("time/federation", float("nan")) if rows else float("nan"),
                     "per_step": [{k: r.get(k) for k in keys + ["step", "federation/offers", "graft/replaced", "reward"]}
                                  for r in rows]}
            entry["share_federation"] = entry["mean_federation_s"] / entry["mean_step_s"]
            entry["share_graft"] = entry["mean_graft_s"] / entry["mean_step_s"]
            entry["share_federation_excl_graft"] = (entry["mean_federation_s"] - entry["mean_graft_s"]) / entry[
                "mean_step_s"]
            entry["share_federation_all_steps"] = mean(col("time/federation", rows)) / mean(col("time/step", rows))
            nodes.append(entry)
        result_table = (tmp / "sim" / "result.md").read_text() if (tmp / "sim" / "result.md").is_file() else ""
    payload = {"machine": info, "command": " ".join(["bench/broker/sim_share.py", *sys.argv[1:]]),
               "sim_command": "graft-fed sim --config <generated> --nodes 3 --quiet", "config": cfg,
               "built_tiny_models": built, "sim_wall_s": wall, "nodes": nodes, "sim_result": result_table,
               "total_s": time.monotonic() - t_start}
    md = [f"### Federation share of step time, 3-node sim ({info['date']})", "",
          machine_line(info) + f" Command: `{payload['command']}` "
          f"(runs `graft-fed sim --nodes 3` on a generated config: {args.steps} steps, {args.prompts} prompts x "
          f"n = {args.n}, max_new_tokens {args.max_new_tokens}, sync, pairwise, share_all, verifier "
          f"{verifier['name']}; sim wall {wall:.0f} s). Means over steps 2..{args.steps} (step 1 apart).", "",
          "| node | model | mean step (s) | mean federation (s) | federation share | graft share | "
          "federation minus graft | step 1 federation share |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in nodes:
        md.append(f"| {e['node']} | {e['model']} | {e['mean_step_s']:.2f} | {e['mean_federation_s']:.3f} | "
                  f"{100 * e['share_federation']:.1f}% | {100 * e['share_graft']:.1f}% | "
                  f"{100 * e['share_federation_excl_graft']:.1f}% | "
                  f"{100 * e['first_federation_s'] / e['first_step_s']:.1f}% |")
    if built:
        md += ["", "Zoo models missing; built with tests/conftest.py::build_tiny_model: " + ", ".join(built) + "."]
    md += ["", "share = mean(time/federation) / mean(time/step) from each node's metrics.jsonl. time/federation "
           "includes the GetMatches wait for the slowest peer (sync barrier); graft share = mean(time/graft) / "
           "mean(time/step), the receive/score part; federation minus graft = the wire and the wait.", ""]
    write_results(name, payload, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
