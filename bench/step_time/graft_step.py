"""Seconds per graft-fed GRPO step (rollout / verify / train) on the fixed benchmark batch.

Times `GRPOTrainer.train_step()` as it is: `step` is its wall time, `rollout` and `verify`
its own `time/rollout` and `time/verify` metrics, `train` = step - rollout - verify (its
`time/train`, the optimise() phase, is kept beside it). run.sh interleaves these steps with
TRL's (interleave.py); alone:

    .venv/bin/python bench/step_time/graft_step.py --out /tmp/graft.json --warmup 1 --steps 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# this checkout's graft_fed, whatever the interpreter has installed
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from common import BATCH, pin_threads, prompt_batches, resolve_model, write_result  # noqa: E402

NOTES = {
    "rollout": "HFRollout: own KV-cached sampling loop, all 128 sequences in one batch",
    "train": "step - rollout - verify: group metrics, advantages, old log-probs, 4 minibatches x "
             "(forward, backward, clip, AdamW step)",
}


def build_trainer(model_dir: str, out_dir: str, total_steps: int) -> Any:
    """graft-fed's GRPOTrainer on the benchmark batch (fp32 CPU, no checkpoints, no KL)."""
    from graft_fed.trainer.config import load_train_config
    from graft_fed.trainer.grpo import GRPOTrainer

    b = BATCH
    cfg = load_train_config(None, {
        "run": {"output_dir": out_dir, "steps": total_steps, "seed": b["seed"], "device": "cpu",
                "precision": "fp32", "threads": b["threads"], "checkpoint_every": 0},
        "model": {"path": model_dir, "template": b["template"]},
        "data": {"source": b["data"], "split": b["split"], "families": b["families"]},
        "rollout": {"n": b["n"], "temperature": b["temperature"], "max_new_tokens": b["max_new_tokens"],
                    "batch_size": b["prompts_per_step"] * b["n"]},
        "verifier": {"name": "math_verify", "workers": b["verifier_workers"]},
        "algorithm": {"prompts_per_step": b["prompts_per_step"], "num_minibatches": b["num_minibatches"],
                      "micro_batch_size": b["prompts_per_step"] * b["n"] // b["num_minibatches"],
                      "eps_low": b["eps_low"], "eps_high": b["eps_high"], "aggregation": "token-mean",
                      "kl_coef": 0.0},
        "optim": {"lr": b["lr"], "weight_decay": b["weight_decay"], "grad_clip": b["grad_clip"],
                  "schedule": "constant"},
    })
    return GRPOTrainer(cfg, quiet=True)


def timed_step(trainer: Any, expected: list[Any]) -> dict[str, float]:
    """One train_step(), checked to draw the `expected` prompt batch; its timing row."""
    b = BATCH
    drawn: list[list[Any]] = []
    schedule = trainer.schedule
    draw = schedule.next_batch
    schedule.next_batch = lambda: drawn.append(draw()) or drawn[-1]  # record what collect() draws
    try:
        t0 = time.perf_counter()
        m = trainer.train_step()
        wall = time.perf_counter() - t0
    finally:
        del schedule.next_batch
    if [[p.id for p in bt] for bt in drawn] != [[p.id for p in expected]]:
        raise SystemExit("graft-fed's step did not draw common.prompt_batches' batch")
    return {
        "rollout": m["time/rollout"], "verify": m["time/verify"],
        "train": wall - m["time/rollout"] - m["time/verify"], "step": wall,
        "trainer/time_train": m["time/train"],
        "other": wall - m["time/rollout"] - m["time/verify"] - m["time/train"],
        "completion_tokens": m["completions/mean_length"] * b["prompts_per_step"] * b["n"],
        "mean_completion_length": m["completions/mean_length"],
        "reward": m["reward"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps")
    ap.add_argument("--steps", type=int, default=3, help="timed warm steps")
    ap.add_argument("--model", default=BATCH["model"], help="zoo:<name> or a local model directory")
    ap.add_argument("--scratch", type=Path, default=Path(__file__).resolve().parent / "work")
    args = ap.parse_args()
    pin_threads(BATCH["threads"])

    total = args.warmup + args.steps
    model_dir, model_desc = resolve_model(args.model, args.scratch)
    batches = prompt_batches(total)
    with tempfile.TemporaryDirectory(prefix="graft-step-") as tmp, build_trainer(model_dir, tmp, total) as trainer:
        rows = [timed_step(trainer, batches[i]) for i in range(total)]
    write_result(args.out, "graft-fed", model_desc, rows[:args.warmup], rows[args.warmup:], NOTES)


if __name__ == "__main__":
    main()
