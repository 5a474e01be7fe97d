"""Measure the premise of a GRAFT experiment before training (issue 15).

For the models of an experiment config, each as the experiment's runs start it (the same
TrainConfig, template, verifier and keyed rollouts), one big batch of training prompts is
sampled n times per prompt at the rollout temperature. Then, with the project's own code:

- per model and task family: sampled accuracy and the share of all-fail groups;
- per receiver R and peer S: the share of R's all-fail groups S can fill (Eq. 4: S's group is
  informative, 0 < k_S < n) and the share S solves at least once, per family;
- per ordered pair (S -> R): the distribution of s = exp(lbar_R - lbar_S) (Eq. 6-7) of every
  response S sampled, scored by R's behaviour policy through R's own `score_responses` on R's
  own tokenisation (graft.receive.retokenise) and `core.exchange.compatibility`, split by
  success and failure (and by scratchpad style where the source writes several);
- per ordered pair, the groups GRAFT would actually move (R all-fail, S informative) passed
  through `graft.receive.receive` itself: the admitted share under the gate (delta).

    python bench/premise.py --config bench/paper_miniature_complementary.yaml \\
        --per-family 64 --out docs/results/complementary_premise.md --json runs/premise.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graft_fed.core.exchange import Quantiles, classify, compatibility  # noqa: E402
from graft_fed.experiment import Experiment, load_experiment_config  # noqa: E402
from graft_fed.graft.receive import receive, retokenise  # noqa: E402
from graft_fed.graft.step import receiver_of  # noqa: E402


def style_of_text(text: str) -> str:
    """Which scratchpad style a response is written in (graft_fed.data.task.STYLES)."""
    return "words" if any(w in text for w in ("So the result", " so far ", " mod ", " over ")) else "plain"


def _q(values: list[float]) -> dict[str, Any]:
    q = Quantiles.of(values)
    return {"n": len(values), "p10": q.p10, "p50": q.p50, "p90": q.p90,
            "mean": sum(values) / len(values) if values else float("nan"),
            "above_delta": None}


def measure(config: str, per_family: int, n: int, seed: int, families: list[str] | None = None,
            only: list[str] | None = None, models_dir: str | None = None, log=print) -> dict[str, Any]:
    from graft_fed.trainer.grpo import GRPOTrainer

    cfg = load_experiment_config(config)
    models = {m: spec for m, spec in cfg.models.items() if not only or m in only}
    if models_dir:  # the same models from another build folder (e.g. an earlier recipe)
        models = {m: str(Path(models_dir) / Path(str(spec)).name) for m, spec in models.items()}
    pairs = tuple(p for p in cfg.pairs if p[0] in models and p[1] in models)
    cfg = dataclasses.replace(cfg, models=models, pairs=pairs,
                              withheld={m: f for m, f in cfg.withheld.items() if m in models},
                              implausible=cfg.implausible if cfg.implausible in models else None)
    exp = Experiment(cfg)
    fams = list(families or cfg.base.get("data", {}).get("families") or [])
    names = sorted(cfg.models)
    tmp = Path(tempfile.mkdtemp(prefix="premise-"))
    learners: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    for m in names:
        tc = exp._train_cfg("premise", m, m, seed, data={"per_family": per_family, "families": fams},
                            rollout={"n": n}, algorithm={"prompts_per_step": per_family * len(fams)},
                            run={"output_dir": str(tmp / m), "record_groups": False, "eval_before": False})
        tc = dataclasses.replace(tc, run=dataclasses.replace(tc.run, name=m))
        t = GRPOTrainer(tc, quiet=True)
        learners[m] = t
        with torch.no_grad():
            data = t.collect()
        groups[m] = {g.prompt.id: g for g in data.groups}
        log(f"[{m}] sampled {len(data.groups)} x {n} ({time.time() - t0:.0f}s)")
    pids = sorted(groups[names[0]])
    assert all(sorted(groups[m]) == pids for m in names), "models sampled different prompts"
    fam_of = {pid: groups[names[0]][pid].prompt.meta.get("family", "?") for pid in pids}
    fam_list = fams + ["all"]

    def in_fam(pid: str, f: str) -> bool:
        return f == "all" or fam_of[pid] == f

    acc = {m: {f: sum(groups[m][p].k for p in pids if in_fam(p, f)) / (n * sum(1 for p in pids if in_fam(p, f)))
               for f in fam_list} for m in names}
    all_fail = {m: {f: sum(1 for p in pids if in_fam(p, f) and groups[m][p].k == 0)
                    / sum(1 for p in pids if in_fam(p, f)) for f in fam_list} for m in names}
    fill: dict[str, dict[str, dict[str, Any]]] = {}
    for r in names:
        for s in names:
            if s == r:
                continue
            row = {}
            for f in fam_list:
                fails = [p for p in pids if in_fam(p, f) and groups[r][p].k == 0]
                cand = sum(1 for p in fails if classify(groups[s][p].k, n) == "informative")
                solved = sum(1 for p in fails if groups[s][p].k > 0)
                row[f] = {"all_fail": len(fails), "fillable": cand, "solved": solved}
            fill[f"{s}->{r}"] = row
    delta = exp._train_cfg("premise", names[0], names[0], seed).graft.delta
    s_dist: dict[str, dict[str, Any]] = {}
    admitted: dict[str, dict[str, Any]] = {}
    for r in names:
        rt = learners[r]
        rx = receiver_of(rt)
        for s in names:
            if s == r:
                continue
            st = learners[s]
            p_ids, r_ids, meta = [], [], []
            for p in pids:
                rec = groups[s][p].to_record(0, s, st.tok_id, st.run_id)
                for j, text in enumerate(rec.texts):
                    p_ids.append(groups[r][p].prompt_ids)
                    r_ids.append(retokenise(rt.tokenizer, text, rec.finish_reasons[j], rx.eos_id))
                    meta.append((fam_of[p], rec.rewards[j] > 0.5, style_of_text(text), rec.mean_logprobs[j]))
            with torch.no_grad():
                lbar_r, _ = rt.score_responses(p_ids, r_ids)
            s_vals = compatibility(lbar_r, torch.tensor([x[3] for x in meta], dtype=torch.float32)).tolist()
            cells: dict[str, list[float]] = {}
            for (fam, ok, style, _), v in zip(meta, s_vals):
                for key in (f"all/{'success' if ok else 'failure'}", f"{fam}/{'success' if ok else 'failure'}",
                            f"style:{style}/{'success' if ok else 'failure'}", "all/all"):
                    cells.setdefault(key, []).append(v)
            out = {}
            for key, vals in cells.items():
                d = _q(vals)
                d["above_delta"] = sum(1 for v in vals if v > delta) / len(vals)
                out[key] = d
            s_dist[f"{s}->{r}"] = out
            # What GRAFT would move this step, through the receiver's real receive().
            offers = {p: groups[s][p].to_record(0, s, st.tok_id, st.run_id) for p in pids
                      if groups[r][p].k == 0 and classify(groups[s][p].k, n) == "informative"}
            with torch.no_grad():
                res = receive(rx, [groups[r][p] for p in pids], offers)
            admitted[f"{s}->{r}"] = {"groups": len(offers), "replaced": res.metrics.get("graft/replaced", 0.0),
                                     "peer_responses": res.metrics.get("graft/peer_responses", 0),
                                     "admitted_frac": res.metrics.get("graft/admitted_frac")}
            log(f"[{s}->{r}] s p50 {out['all/all']['p50']:.3f}, {len(offers)} groups would move "
                f"({time.time() - t0:.0f}s)")
    for t in learners.values():
        t.close()
    return {"config": config, "per_family": per_family, "n": n, "seed": seed, "families": fams,
            "delta": delta, "temperature": learners[names[0]].cfg.rollout.temperature,
            "accuracy": acc, "all_fail": all_fail, "fillable": fill, "s": s_dist, "receive": admitted,
            "seconds": round(time.time() - t0, 1)}


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


def render(res: dict[str, Any], command: str) -> str:
    fams = res["families"] + ["all"]
    names = sorted(res["accuracy"])
    lines = ["# Premise of the complementary setting, measured before training", "",
             f"Produced by `{command}` ({res['seconds']:.0f} s). One batch of {res['per_family']} training prompts "
             f"per family ({', '.join(res['families'])}), n = {res['n']} samples each at temperature "
             f"{res['temperature']}, keyed rollouts of seed {res['seed']}, every model as the experiment's runs "
             f"start it. delta = {res['delta']}.", "",
             "## Sampled accuracy (and all-fail share) per model and family", "",
             "| model | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
    for m in names:
        lines.append(f"| {m} | " + " | ".join(f"{_pct(res['accuracy'][m][f])} ({_pct(res['all_fail'][m][f])})"
                                             for f in fams) + " |")
    lines += ["", "## Share of each receiver's all-fail groups each peer can fill", "",
              "Cells: fillable share (the peer's group is informative, 0 < k < n: Eq. 4) and, in brackets, the "
              "share the peer solves at least once; `-` where the receiver has no all-fail group.", "",
              "| receiver | peer | " + " | ".join(fams) + " |", "|---|---|" + "---|" * len(fams)]
    for key, row in res["fillable"].items():
        s, r = key.split("->")
        cells = []
        for f in fams:
            c = row[f]
            cells.append("-" if not c["all_fail"] else
                         f"{_pct(c['fillable'] / c['all_fail'])} ({_pct(c['solved'] / c['all_fail'])}) of {c['all_fail']}")
        lines.append(f"| {r} | {s} | " + " | ".join(cells) + " |")
    lines += ["", "## Compatibility s of each source's sampled responses under each receiver", "",
              "s = exp(lbar_R - lbar_S) (Eq. 6-7) with the receiver's own tokenisation and behaviour policy; "
              "p10 / p50 / p90, share above delta, and the number of responses.", "",
              "| source -> receiver | slice | success: p10 / p50 / p90 | > delta | n | failure: p10 / p50 / p90 "
              "| > delta | n |", "|---|---|---|---|---|---|---|---|"]
    for key, cells in res["s"].items():
        slices = ["all"] + res["families"] + sorted({k.split("/")[0] for k in cells if k.startswith("style:")})
        for sl in slices:
            row = []
            for outcome in ("success", "failure"):
                d = cells.get(f"{sl}/{outcome}")
                row += (["-", "-", "0"] if d is None else
                        [f"{d['p10']:.2f} / {d['p50']:.2f} / {d['p90']:.2f}", _pct(d["above_delta"]), str(d["n"])])
            lines.append(f"| {key} | {sl} | " + " | ".join(row) + " |")
    lines += ["", "## What GRAFT would move in this batch, through `graft.receive.receive`", "",
              "Per ordered pair alone (no balancing, no choice among sources): the receiver's all-fail prompts "
              "with an informative group of the source, and the share of their responses the gate admits.", "",
              "| source -> receiver | groups | peer responses | admitted |", "|---|---|---|---|"]
    for key, d in res["receive"].items():
        lines.append(f"| {key} | {d['groups']} | {d['peer_responses']} | {_pct(d['admitted_frac'])} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="experiment YAML (its models and base run config)")
    p.add_argument("--per-family", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", action="append", metavar="NAME", help="measure only these models of the config")
    p.add_argument("--families", default=None, help="comma-separated families (default: the config's)")
    p.add_argument("--models-dir", default=None, help="take the models from this build folder instead")
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument("--json", default=None, help="write the raw numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fams = [f for f in args.families.split(",") if f] if args.families else None
    res = measure(args.config, args.per_family, args.n, args.seed, fams, args.only, args.models_dir)
    command = "python bench/premise.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = render(res, command)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
