"""Seconds per TRL GRPO step on the same model, prompts and batch as graft_step.py.

One "step" is one TRL generation batch: 16 prompts x 8 completions, generated once and
then used for 4 optimiser steps of 32 completions each (steps_per_generation=4,
gradient_accumulation_steps=1, num_iterations=1), the same work as one
`graft_fed.trainer.grpo.GRPOTrainer.train_step()`. Runs only in bench/step_time/.venv-trl
(TRL is never a dependency of graft-fed). Run by run.sh; alone:

    bench/step_time/.venv-trl/bin/python bench/step_time/trl_step.py --out /tmp/trl.json --warmup 1 --steps 3

Timing: `step` is the wall time between the Trainer's step-end callbacks that bound the 4
optimiser steps of a generation batch (so it holds everything TRL does in that window);
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from common import BATCH, pin_threads, prompt_batches, resolve_model, write_result  # noqa: E402

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (generation batches)")
    ap.add_argument("--steps", type=int, default=3, help="timed warm steps (generation batches)")
    ap.add_argument("--model", default=BATCH["model"], help="zoo:<name> or a local model directory")
    ap.add_argument("--scratch", type=Path, default=Path(__file__).resolve().parent / "work")
    args = ap.parse_args()
    b = BATCH
    pin_threads(b["threads"])

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from graft_fed.data.templates import render_prompt
    from graft_fed.modeling import load_model_and_tokenizer
    from graft_fed.rewards import VerifierConfig, build_verifier

    torch.set_num_threads(b["threads"])
    total = args.warmup + args.steps
    per_gen = b["prompts_per_step"] * b["n"]
    micro = per_gen // b["num_minibatches"]

    model_dir, model_desc = resolve_model(args.model, args.scratch)
    # The same loader graft-fed uses (fp32, pad = eos where the tokenizer has no pad).
    model, tokenizer = load_model_and_tokenizer(model_dir, "cpu")

    # The very prompt batches graft-fed's schedule draws, in order; TRL renders each with the
    # tokenizer's chat template (conversational prompts), checked below to give the same ids.
    batches = prompt_batches(total)
    rows = [{"prompt": [{"role": "user", "content": p.problem}], "answer": p.answer} for bt in batches for p in bt]
    ours = {p.problem: tokenizer(render_prompt(p.problem, b["template"], tokenizer),
                                 add_special_tokens=False)["input_ids"] for bt in batches for p in bt}

    verifier = build_verifier(VerifierConfig(name="math_verify", workers=b["verifier_workers"]))

    def graft_fed_verifier(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return verifier.score(texts, list(answer)).rewards

    # TRL's own profiling times (normally only sent to wandb/mlflow/trackio): keep them all.
    prof: list[tuple[str, float, float]] = []  # (name, end time, duration)
    orig_log = profiling.ProfilingContext._log_metrics

    def keep(self, duration):
        prof.append((self.name, time.perf_counter(), duration))
        orig_log(self, duration)

    profiling.ProfilingContext._log_metrics = keep

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, *_, **__):
            self.marks = [time.perf_counter()]

        def on_step_end(self, *_, **__):
            self.marks.append(time.perf_counter())

    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-step-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            seed=b["seed"], data_seed=b["seed"], report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, dataloader_num_workers=0,
            max_steps=total * b["num_minibatches"],
            # one generation batch = 16 prompts x 8; 4 optimiser steps of 32 completions on it
            num_generations=b["n"], per_device_train_batch_size=micro, gradient_accumulation_steps=1,
            steps_per_generation=b["num_minibatches"], num_iterations=1, shuffle_dataset=False,
            max_completion_length=b["max_new_tokens"], temperature=b["temperature"], top_p=1.0, top_k=0,
            # token-mean over the minibatch's active tokens, DAPO clip-higher, no KL, group-std advantages
            loss_type="dapo", epsilon=b["eps_low"], epsilon_high=b["eps_high"], beta=0.0,
            scale_rewards="group", mask_truncated_completions=False, disable_dropout=True,
            learning_rate=b["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=b["weight_decay"],
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=b["grad_clip"],
            optim="adamw_torch", log_completions=False,
        )
        trainer = GRPOTrainer(model=model, args=config, processing_class=tokenizer,
                              reward_funcs=[graft_fed_verifier], train_dataset=Dataset.from_list(rows),
                              callbacks=[clock])

        gens: list[dict[str, float]] = []
        orig_generate = trainer._generate

        def timed_generate(prompts):
            t0 = time.perf_counter()
            out = orig_generate(prompts)
            t1 = time.perf_counter()
            prompt_ids, completion_ids = out[0], out[1]
            for msgs, ids in zip(prompts, prompt_ids):
                if list(ids) != ours[msgs[-1]["content"]]:
                    raise SystemExit("TRL tokenised a prompt differently from graft-fed's chat rendering")
            gens.append({"start": t0, "end": t1, "tokens": float(sum(len(c) for c in completion_ids)),
                         "problems": [m[-1]["content"] for m in prompts[::b["n"]]]})
            return out

        trainer._generate = timed_generate
        try:
            trainer.train()
        finally:
            verifier.close()

    if len(gens) != total or len(clock.marks) != total * b["num_minibatches"] + 1:
        raise SystemExit(f"expected {total} generation batches of {b['num_minibatches']} optimiser steps, got "
                         f"{len(gens)} generations and {len(clock.marks) - 1} steps")
    out_rows = []
    for k in range(total):
        lo, hi = clock.marks[k * b["num_minibatches"]], clock.marks[(k + 1) * b["num_minibatches"]]
        if [p.problem for p in batches[k]] != gens[k]["problems"]:
            raise SystemExit(f"generation batch {k} did not get graft-fed's prompt batch {k}")

        def spent(name: str) -> float:
            return sum(d for n, end, d in prof if n == f"GRPOTrainer.{name}" and lo < end <= hi)

        rollout = gens[k]["end"] - gens[k]["start"]
        verify = spent("_calculate_rewards")
        step = hi - lo
        out_rows.append({
            "rollout": rollout, "verify": verify, "train": step - rollout - verify, "step": step,
            "other": 0.0,
            "trl/transformers.generate": spent("transformers.generate"),
            "trl/reward_func": spent("graft_fed_verifier"),
            "trl/compute_loss": spent("compute_loss"),
            "completion_tokens": gens[k]["tokens"],
            "mean_completion_length": gens[k]["tokens"] / per_gen,
        })
    write_result(args.out, "trl", model_desc, out_rows[:args.warmup], out_rows[args.warmup:], {
        "rollout": "TRL _generate: tokenise + transformers model.generate (KV cache, 128 sequences in one batch)"
                   " + decode",
        "train": "everything else in the 4 optimiser steps: old log-probs, advantages, 4 x (forward, backward, "
                 "clip, AdamW step), TRL's metrics and logging",
        "config": {k: v for k, v in config.to_dict().items() if k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_iterations", "num_generations", "max_completion_length", "loss_type",
            "epsilon", "epsilon_high", "beta", "scale_rewards", "top_k", "top_p", "temperature",
            "gradient_checkpointing", "bf16", "use_cpu", "learning_rate", "max_grad_norm")},
    })


if __name__ == "__main__":
    main()
