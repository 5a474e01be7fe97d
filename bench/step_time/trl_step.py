"""Seconds per TRL GRPO step on the same model, prompts and batch as graft_step.py.

One "step" is one TRL generation batch: 16 prompts x 8 completions, generated once and
then used for 4 optimiser steps of 32 completions each (steps_per_generation=4,
gradient_accumulation_steps=1, num_iterations=1), the same work as one
`graft_fed.trainer.grpo.GRPOTrainer.train_step()`. Runs only in bench/step_time/.venv-trl
(TRL is never a dependency of graft-fed). run.sh interleaves these steps with graft-fed's
(interleave.py); alone:

    bench/step_time/.venv-trl/bin/python bench/step_time/trl_step.py --out /tmp/trl.json --warmup 1 --steps 3

Timing: `step` is the wall time from the Trainer's callback before a generation batch (train
begin, or the step end of the previous batch's 4th optimiser step) to the step end of its
4th optimiser step (so it holds everything TRL does in that window);
`rollout` is TRL's `_generate` (tokenise, `model.generate`, decode) timed by a wrapper,
with TRL's own profiling time of `transformers.generate` kept beside it; `verify` is TRL's
own profiling time of `_calculate_rewards`, whose one reward function calls graft-fed's
verifier; `train` = step - rollout - verify.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from common import BATCH, pin_threads, prompt_batches, resolve_model, write_result  # noqa: E402

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")


NOTES = {
    "rollout": "TRL _generate: tokenise + transformers model.generate (KV cache, 128 sequences in one batch) + decode",
    "train": "step - rollout - verify: old log-probs, advantages, 4 x (forward, backward, clip, AdamW step), "
             "TRL's metrics and logging",
}


class TRLBench:
    """TRL's GRPOTrainer on the benchmark batch, timed per generation batch.

    `gap(k)` (optional) runs before generation batch k and once more after the last one
    (k = number of batches); its time is outside every TRL window, which is how
    interleave.py slots graft-fed's steps in between.
    """

    def __init__(self, model_dir: str, batches: list[list[Any]], out_dir: str,
                 gap: Callable[[int], None] | None = None) -> None:
        import torch
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
        from trl.extras import profiling

        from graft_fed.data.templates import render_prompt
        from graft_fed.modeling import load_model_and_tokenizer
        from graft_fed.rewards import VerifierConfig, build_verifier

        b = BATCH
        torch.set_num_threads(b["threads"])
        self.batches = batches
        self.total = len(batches)
        self.per_gen = b["prompts_per_step"] * b["n"]
        self.opt_steps = b["num_minibatches"]
        # The same loader graft-fed uses (fp32, pad = eos where the tokenizer has no pad).
        model, tokenizer = load_model_and_tokenizer(model_dir, "cpu")

        # graft-fed's prompt batches, in order; TRL renders each with the tokenizer's chat
        # template (conversational prompts), checked in timed_generate to give graft-fed's ids.
        rows = [{"prompt": [{"role": "user", "content": p.problem}], "answer": p.answer}
                for bt in batches for p in bt]
        ours = {p.problem: tokenizer(render_prompt(p.problem, b["template"], tokenizer),
                                     add_special_tokens=False)["input_ids"] for bt in batches for p in bt}

        self.verifier = build_verifier(VerifierConfig(name="math_verify", workers=b["verifier_workers"]))
        verifier = self.verifier

        def graft_fed_verifier(completions, answer, **_):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return verifier.score(texts, list(answer)).rewards

        # TRL's own profiling times (normally only sent to wandb/mlflow/trackio): keep them all.
        self.prof: list[tuple[str, float, float]] = []  # (name, end time, duration)
        prof = self.prof
        orig_log = profiling.ProfilingContext._log_metrics

        def keep(ctx, duration):
            prof.append((ctx.name, time.perf_counter(), duration))
            orig_log(ctx, duration)

        profiling.ProfilingContext._log_metrics = keep

        bench = self
        self.starts: list[float] = []
        self.ends: list[float] = []

        class Clock(TrainerCallback):
            def on_train_begin(self, *_, **__):
                if gap is not None:
                    gap(0)
                bench.starts.append(time.perf_counter())

            def on_step_end(self, args, state, control, **__):
                if state.global_step % bench.opt_steps == 0:
                    bench.ends.append(time.perf_counter())
                    k = state.global_step // bench.opt_steps
                    if gap is not None:
                        gap(k)
                    if k < bench.total:
                        bench.starts.append(time.perf_counter())

        self.config = GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            seed=b["seed"], data_seed=b["seed"], report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, dataloader_num_workers=0,
            max_steps=self.total * self.opt_steps,
            # one generation batch = 16 prompts x 8; 4 optimiser steps of 32 completions on it
            num_generations=b["n"], per_device_train_batch_size=self.per_gen // self.opt_steps,
            gradient_accumulation_steps=1, steps_per_generation=self.opt_steps, num_iterations=1,
            shuffle_dataset=False,
            max_completion_length=b["max_new_tokens"], temperature=b["temperature"], top_p=1.0, top_k=0,
            # token-mean over the minibatch's active tokens, DAPO clip-higher, no KL, group-std advantages
            loss_type="dapo", epsilon=b["eps_low"], epsilon_high=b["eps_high"], beta=0.0,
            scale_rewards="group", mask_truncated_completions=False, disable_dropout=True,
            learning_rate=b["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=b["weight_decay"],
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=b["grad_clip"],
            optim="adamw_torch", log_completions=False,
        )
        self.trainer = GRPOTrainer(model=model, args=self.config, processing_class=tokenizer,
                                   reward_funcs=[graft_fed_verifier], train_dataset=Dataset.from_list(rows),
                                   callbacks=[Clock()])

        self.gens: list[dict[str, Any]] = []
        orig_generate = self.trainer._generate

        def timed_generate(prompts):
            t0 = time.perf_counter()
            out = orig_generate(prompts)
            t1 = time.perf_counter()
            prompt_ids, completion_ids = out[0], out[1]
            for msgs, ids in zip(prompts, prompt_ids):
                if list(ids) != ours[msgs[-1]["content"]]:
                    raise SystemExit("TRL tokenised a prompt differently from graft-fed's chat rendering")
            bench.gens.append({"start": t0, "end": t1, "tokens": float(sum(len(c) for c in completion_ids)),
                               "problems": [m[-1]["content"] for m in prompts[::b["n"]]]})
            return out

        self.trainer._generate = timed_generate

    def run(self) -> list[dict[str, float]]:
        try:
            self.trainer.train()
        finally:
            self.verifier.close()
        if len(self.gens) != self.total or len(self.starts) != self.total or len(self.ends) != self.total:
            raise SystemExit(f"expected {self.total} generation batches of {self.opt_steps} optimiser steps, got "
                             f"{len(self.gens)} generations and {len(self.ends)} batch ends")
        rows = []
        for k in range(self.total):
            lo, hi = self.starts[k], self.ends[k]
            if [p.problem for p in self.batches[k]] != self.gens[k]["problems"]:
                raise SystemExit(f"TRL generation batch {k} did not get graft-fed's prompt batch {k}")

            def spent(name: str) -> float:
                return sum(d for n, end, d in self.prof if n == f"GRPOTrainer.{name}" and lo < end <= hi)

            rollout = self.gens[k]["end"] - self.gens[k]["start"]
            verify = spent("_calculate_rewards")
            step = hi - lo
            rows.append({
                "rollout": rollout, "verify": verify, "train": step - rollout - verify, "step": step,
                "trl/transformers.generate": spent("transformers.generate"),
                "trl/reward_func": spent("graft_fed_verifier"),
                "trl/compute_loss": spent("compute_loss"),
                "completion_tokens": self.gens[k]["tokens"],
                "mean_completion_length": self.gens[k]["tokens"] / self.per_gen,
            })
        return rows

    def notes(self) -> dict[str, Any]:
        keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "generation_batch_size", "num_iterations", "num_generations", "max_completion_length",
                "loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards", "top_k", "top_p", "temperature",
                "gradient_checkpointing", "bf16", "use_cpu", "learning_rate", "max_grad_norm")
        return {**NOTES, "config": {k: v for k, v in self.config.to_dict().items() if k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (generation batches)")
    ap.add_argument("--steps", type=int, default=3, help="timed warm steps (generation batches)")
    ap.add_argument("--model", default=BATCH["model"], help="zoo:<name> or a local model directory")
    ap.add_argument("--scratch", type=Path, default=Path(__file__).resolve().parent / "work")
    args = ap.parse_args()
    pin_threads(BATCH["threads"])

    model_dir, model_desc = resolve_model(args.model, args.scratch)
    with tempfile.TemporaryDirectory(prefix="trl-step-") as tmp:
        bench = TRLBench(model_dir, prompt_batches(args.warmup + args.steps), tmp)
        rows = bench.run()
    write_result(args.out, "trl", model_desc, rows[:args.warmup], rows[args.warmup:], bench.notes())


if __name__ == "__main__":
    main()
