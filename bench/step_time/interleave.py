"""graft-fed and TRL GRPO steps alternated one by one in one process, so that whatever the
machine does in the meantime falls on both alike.

Both trainers are built on the same model (two copies), the same prompt batches and the
same fixed batch (common.BATCH). TRL's `Trainer.train()` drives the loop; between two of
its generation batches (each = 4 optimiser steps) a callback runs one graft-fed
`train_step()`, outside TRL's timing window. `--first graft-fed` puts graft-fed's step k
before TRL's batch k, `--first trl` after it; run.sh alternates the two over rounds.
Writes one result file per framework (the format of graft_step.py / trl_step.py).

    bench/step_time/.venv-trl/bin/python bench/step_time/interleave.py --out-dir /tmp/r1 --warmup 1 --steps 5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from common import BATCH, pin_threads, prompt_batches, resolve_model, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--tag", default="r1", help="prefix of the result files")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per framework")
    ap.add_argument("--steps", type=int, default=5, help="timed warm steps per framework")
    ap.add_argument("--first", choices=("graft-fed", "trl"), default="graft-fed")
    ap.add_argument("--model", default=BATCH["model"], help="zoo:<name> or a local model directory")
    ap.add_argument("--scratch", type=Path, default=Path(__file__).resolve().parent / "work")
    args = ap.parse_args()
    pin_threads(BATCH["threads"])

    import graft_step
    import trl_step

    total = args.warmup + args.steps
    model_dir, model_desc = resolve_model(args.model, args.scratch)
    batches = prompt_batches(total)
    graft_rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="step-time-") as tmp:
        with graft_step.build_trainer(model_dir, f"{tmp}/graft", total) as graft:

            def gap(k: int) -> None:
                i = k if args.first == "graft-fed" else k - 1  # the graft-fed step that goes here
                if 0 <= i < total:
                    graft_rows.append(graft_step.timed_step(graft, batches[i]))

            trl = trl_step.TRLBench(model_dir, batches, f"{tmp}/trl", gap=gap)
            trl_rows = trl.run()
    if len(graft_rows) != total:
        raise SystemExit(f"ran {len(graft_rows)} graft-fed steps, expected {total}")
    notes = {"interleaved": f"one process, steps alternated, {args.first} first"}
    write_result(args.out_dir / f"{args.tag}-graft-fed.json", "graft-fed", model_desc,
                 graft_rows[:args.warmup], graft_rows[args.warmup:], {**graft_step.NOTES, **notes})
    write_result(args.out_dir / f"{args.tag}-trl.json", "trl", model_desc,
                 trl_rows[:args.warmup], trl_rows[args.warmup:], {**trl.notes(), **notes})


if __name__ == "__main__":
    main()
