"""Run under torchrun by tests/trainer/test_distributed.py (never collected by pytest):

    torchrun --nproc-per-node 2 -m tests.trainer.dist_worker OUT.pt CONFIG.yaml [CONFIG.yaml ...]

For each config: one DistributedGRPOTrainer step with the optimiser step replaced by a
capture of the full (all-gathered) gradient of every minibatch, then the step's metrics.
The main process saves {"grads": [...], "rows": [...]} to OUT.pt.
"""

from __future__ import annotations

import sys

import torch


def main(out: str, configs: list[str]) -> None:
    from graft_fed.trainer.config import load_train_config
    from graft_fed.trainer.distributed import DistributedGRPOTrainer, end_process, shutdown

    grads, rows = [], []
    rank = 0
    for path in configs:
        with DistributedGRPOTrainer(load_train_config(path), quiet=True) as tr:
            rank = tr.ctx.rank
            seen: list[torch.Tensor] = []
            # full_tensor() all-gathers each gradient shard: every process calls it in the same order
            tr.optimizer.step = lambda: seen.append(  # type: ignore[method-assign]
                torch.cat([p.grad.full_tensor().flatten() for p in tr.model.parameters()]))
            rows.append(tr.train_step())
            grads.append(torch.stack(seen))
    if rank == 0:
        torch.save({"grads": grads, "rows": rows}, out)
    shutdown()
    end_process(0)  # as the CLI ends a torchrun process


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
