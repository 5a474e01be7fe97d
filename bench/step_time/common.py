"""What the two step-time benchmarks share: the fixed batch, the model, the prompts, the output.

Both sides import this file (graft_step.py from the project's .venv, trl_step.py from
bench/step_time/.venv-trl), so the model, the prompt batches and their rendering are the
same by construction, not by two copies agreeing.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: The fixed step: 16 prompts x n=8 completions of at most 128 tokens at temperature 1.0,
#: then 4 optimiser steps (minibatches of 4 prompts = 32 completions, one forward/backward each).
BATCH: dict[str, Any] = {
    "model": "zoo:tiny-llama-char",
    "data": "embedded:arith-v1",
    "split": "train",
    "families": ["add", "sub", "mul"],
    "template": "chat",
    "prompts_per_step": 16,
    "n": 8,
    "max_new_tokens": 128,
    "temperature": 1.0,
    "num_minibatches": 4,
    "lr": 5.0e-4,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "eps_low": 0.2,
    "eps_high": 0.28,
    "seed": 0,
    # torch intra-op threads of both frameworks (run.sh --threads sets STEP_TIME_THREADS). 1 by
    # default: on a shared 2-core machine two OpenMP threads per process stall at every barrier
    # whenever another process holds a core, which made steps 2-10x slower and erratic.
    "threads": int(os.environ.get("STEP_TIME_THREADS", "1")),
    "verifier_workers": 2,
}

#: The phases every row reports; "other" = step - rollout - verify - train (bookkeeping).
PHASES = ("rollout", "verify", "train", "step")


def pin_threads(threads: int) -> None:
    """Fix the thread count of every pool a step can use, before torch is imported."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny_llama_char(out_dir: Path, seed: int = 0) -> Path:
    """Stand-in for zoo:tiny-llama-char while the zoo is not built: a randomly initialised
    2-layer Llama (hidden 32) with a character tokenizer and a chat template, the shape of
    tests/conftest.py's tiny model."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in "0123456789+-*/=()[]{}\\., :?xXQAabcdefghijklmnopqrstuvwxyzT\n":
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}A: {% endif %}")
    fast.save_pretrained(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    (out_dir / "built_by_bench.json").write_text(json.dumps({"stand_in_for": BATCH["model"], "seed": seed}))
    return out_dir


def resolve_model(spec: str, scratch: Path) -> tuple[str, str]:
    """(local directory, description). The shipped zoo model when it is built, else a
    stand-in of the same shape built once under `scratch`."""
    from graft_fed.errors import ConfigError
    from graft_fed.zoo import resolve_model_path

    try:
        return resolve_model_path(spec), spec
    except ConfigError:
        if spec != BATCH["model"]:
            raise
        path = scratch / "stand-in-tiny-llama-char"
        if not (path / "config.json").is_file():
            build_tiny_llama_char(path)
        return str(path), f"stand-in for {spec} (zoo not built): random 2-layer Llama, hidden 32, char tokenizer"


def prompt_batches(steps: int) -> list[list[Any]]:
    """The prompt batches graft-fed's trainer draws in its first `steps` steps (its own
    PromptSchedule with the benchmark's seed), so TRL can be fed the very same ones."""
    from graft_fed.data.config import DataConfig, load_prompts
    from graft_fed.trainer.schedule import PromptSchedule

    data = DataConfig(source=BATCH["data"], split=BATCH["split"], families=tuple(BATCH["families"]))
    schedule = PromptSchedule(load_prompts(data), BATCH["prompts_per_step"], BATCH["seed"])
    return [schedule.next_batch() for _ in range(steps)]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "graft-fed"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def write_result(path: Path, framework: str, model_desc: str, warmup: list[dict[str, float]],
                 timed: list[dict[str, float]], notes: dict[str, Any]) -> None:
    """One run's rows: the warm-up step(s) (not counted) and the timed warm steps."""
    import torch

    result = {
        "framework": framework,
        "model": model_desc,
        "batch": BATCH,
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "warmup": warmup,
        "timed": timed,
        "median": {k: statistics.median(r[k] for r in timed) for k in timed[0]} if timed else {},
        "notes": notes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2), encoding="utf-8")
    med = result["median"]
    print(f"[{framework}] median of {len(timed)} warm steps: " +
          ", ".join(f"{k} {med[k]:.3f}" for k in PHASES if k in med), file=sys.stderr)
