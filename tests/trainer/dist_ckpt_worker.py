"""Run under torchrun by tests/trainer/test_distributed.py (never collected by pytest):

    torchrun --nproc-per-node 2 -m tests.trainer.dist_ckpt_worker OUT_PREFIX CONFIG.yaml FAULT

Saves one good checkpoint, then a second one during which FAULT makes one process's write
fail with ENOSPC: "rng@1" (process 1's RNG file), "model@0" (the main process's consolidated
model). Each process writes what happened to OUT_PREFIX.<rank>.json.
"""

from __future__ import annotations

import errno
import json
import sys


def main(prefix: str, config: str, fault: str) -> None:
    import torch

    from graft_fed.errors import CheckpointError
    from graft_fed.trainer.config import load_train_config
    from graft_fed.trainer.distributed import DistributedGRPOTrainer, end_process, shutdown

    what, rank_s = fault.split("@")
    with DistributedGRPOTrainer(load_train_config(config), quiet=True) as tr:
        rank = tr.ctx.rank
        first = tr.save_checkpoint()
        tr.step += 1
        if rank == int(rank_s):
            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device", "injected")
            if what == "rng":
                real_save = torch.save

                def save(obj, path, *a, **kw):
                    if "rng" in str(path):
                        full_disk()
                    return real_save(obj, path, *a, **kw)
                torch.save = save
            elif what == "model":
                tr.model.save_pretrained = full_disk  # type: ignore[method-assign]
            else:
                raise SystemExit(f"unknown fault {fault}")
        try:
            tr.save_checkpoint()
            outcome = {"raised": None}
        except CheckpointError as exc:
            outcome = {"raised": str(exc)}
        outcome["first"] = str(first)
    with open(f"{prefix}.{rank}.json", "w") as fh:
        json.dump(outcome, fh)
    shutdown()
    end_process(0)  # as the CLI ends a torchrun process


if __name__ == "__main__":
    main(*sys.argv[1:])
