"""Diagnostic (issue 15, setting E): rerun one of an experiment's group arms (e.g. graft_all)
for one seed with some members offering nothing (`members[i].shares: false`, as a federation
node with privacy summaries_only): the same config, seeds and prompt schedule otherwise, so
the run shows what those members' groups did to the others. With gpt2 silent, graft_all on
setting E reproduces the llama + qwen3 pair run exactly (docs/results/miniature.md).

    python bench/group_arm_without.py --config bench/paper_miniature_carry.yaml --arm graft_all \
        --seed 0 --silent gpt2 --out runs/diag/graft_all-gpt2-noshare

Resumable (the run resumes from its members' checkpoints). Validation scores land in
OUT/<member>/eval/ as in any run.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from graft_fed.experiment import GROUP_ARMS, Experiment, load_experiment_config
from graft_fed.graft.cotrain import CoTrainer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--arm", default="graft_all", help="a group arm: " + ", ".join(sorted(GROUP_ARMS)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--silent", nargs="+", required=True, help="members that offer nothing")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ex = Experiment(load_experiment_config(args.config))
    if args.arm not in GROUP_ARMS:
        ap.error(f"--arm {args.arm}: not a group arm; use one of {sorted(GROUP_ARMS)}")
    names = tuple(sorted(ex.cfg.models))  # as the experiment runs its group arms
    unknown = set(args.silent) - set(names)
    if unknown:
        ap.error(f"--silent {sorted(unknown)}: not models of this experiment ({list(names)})")
    cfg = ex.group_config(args.arm, names, "all", args.seed, Path(args.out), silent=tuple(args.silent))
    with CoTrainer(cfg, resume="auto", quiet=True) as co:
        co.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
