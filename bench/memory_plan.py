"""Memory planning for the paper's models on one GPU: computed, not measured.

    python bench/memory_plan.py            # prints the tables of docs/scaling.md#memory-planning

Parameter counts come from the released models' architectures (instantiated on the meta
device: no weights, no download); everything else is arithmetic with the assumptions
below, which docs/scaling.md states next to the tables. Bytes are decimal GB (1e9).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

# Values of the released config.json files. OctoThinker-3B-Hybrid-Base is a Llama-3.2-3B.
MODELS: dict[str, dict[str, Any]] = {
    "Qwen3-1.7B-Base": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                            tie_word_embeddings=True),
    "SmolLM3-3B-Base": dict(model_type="smollm3", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=128256,
                            tie_word_embeddings=True),
    "OctoThinker-3B-Hybrid-Base": dict(model_type="llama", hidden_size=3072, intermediate_size=8192,
                                       num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                       head_dim=128, vocab_size=128256, tie_word_embeddings=True),
}
GPUS = {"80 GB (A100/H100)": 80e9, "141 GB (H200)": 141e9}
PAIRS = [("SmolLM3-3B-Base", "Qwen3-1.7B-Base"), ("OctoThinker-3B-Hybrid-Base", "Qwen3-1.7B-Base"),
         ("SmolLM3-3B-Base", "OctoThinker-3B-Hybrid-Base")]

# Assumptions (see docs/scaling.md).
STATE_BYTES = 16        # per parameter: fp32 weights 4 + fp32 grads 4 + AdamW m, v 8
AUTOCAST_BYTES = 2      # per parameter: bf16 weight copies autocast keeps during forward/backward
ENGINE_WEIGHT_BYTES = 2  # per parameter: vLLM's bf16 weights
LAYER_ACT = 34          # bytes per token per layer per hidden unit without checkpointing (Korthikanti et al.)
CKPT_ACT = 4            # with activation checkpointing: the fp32 block input per layer
LOSS_ACT = 16           # bytes per response token per vocabulary entry: fp32 logits, log-softmax, entropy
TRAINER_RESERVE = 3e9   # CUDA context, cuBLAS workspace, allocator fragmentation of the trainer
ENGINE_ASLEEP = 2e9     # a sleeping vLLM engine's process: CUDA context and CUDA graphs
ENGINE_OVERHEAD = 2e9   # vLLM's own activation peak and buffers out of its share
MAX_LEN = 6144          # prompt (<= 2048) + response (<= 4096): rollout.vllm.max_model_len


@dataclass
class Model:
    name: str
    params: int
    hidden: int
    layers: int
    vocab: int
    kv_bytes_per_token: int  # K and V, bf16, all layers

    @property
    def state(self) -> float:
        return STATE_BYTES * self.params

    def act_per_token(self, checkpointing: bool) -> float:
        layers = (CKPT_ACT * self.layers + LAYER_ACT) if checkpointing else LAYER_ACT * self.layers
        return layers * self.hidden + LOSS_ACT * self.vocab


def load_models() -> dict[str, Model]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for name, spec in MODELS.items():
        spec = dict(spec)
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        out[name] = Model(name, sum(p.numel() for p in model.parameters()), spec["hidden_size"],
                          spec["num_hidden_layers"], spec["vocab_size"],
                          2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec["head_dim"] * 2)
    return out


def gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def single_model_tables(models: dict[str, Model]) -> str:
    lines = ["Per model:", "",
             "| model | params | trainer states (16 B/param) | autocast copies | vLLM weights (bf16) | "
             "KV cache per token | activations per response token (no ckpt / ckpt) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m in models.values():
        lines.append(f"| {m.name} | {m.params / 1e9:.2f} B | {gb(m.state)} GB | {gb(AUTOCAST_BYTES * m.params)} GB | "
                     f"{gb(ENGINE_WEIGHT_BYTES * m.params)} GB | {m.kv_bytes_per_token / 1024:.0f} KiB | "
                     f"{m.act_per_token(False) / 1e6:.2f} / {m.act_per_token(True) / 1e6:.2f} MB |")
    lines += ["", "One model per GPU, engine colocated and sleeping while the trainer trains:", "",
              "| GPU | model | free for training activations | micro_batch_tokens (no ckpt / ckpt) | "
              "largest engine share | its KV cache | sequences of 6,144 tokens at once |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for gpu, total in GPUS.items():
        for m in models.values():
            train_free = total - m.state - AUTOCAST_BYTES * m.params - TRAINER_RESERVE - ENGINE_ASLEEP
            share = int(100 * (total - m.state - TRAINER_RESERVE - ENGINE_ASLEEP) / total) / 100  # floor, 2 digits
            kv = share * total - ENGINE_WEIGHT_BYTES * m.params - ENGINE_OVERHEAD
            tok_plain = int(train_free / m.act_per_token(False) / 1024) * 1024
            tok_ckpt = int(train_free / m.act_per_token(True) / 1024) * 1024
            lines.append(f"| {gpu} | {m.name} | {gb(train_free)} GB | {tok_plain:,} / {tok_ckpt:,} | {share:.2f} | "
                         f"{gb(kv)} GB | {int(kv / (m.kv_bytes_per_token * MAX_LEN))} |")
    return "\n".join(lines)


def pair_table(models: dict[str, Model]) -> str:
    lines = ["Two models co-trained on one GPU (`graft-fed cotrain`), both engines asleep during training:", "",
             "| GPU | pair | both trainers' states | left for activations and one awake engine |",
             "|---|---|---:|---:|"]
    for gpu, total in GPUS.items():
        for a, b in PAIRS:
            states = models[a].state + models[b].state
            left = total - states - 2 * TRAINER_RESERVE - 2 * ENGINE_ASLEEP
            lines.append(f"| {gpu} | {a} + {b} | {gb(states)} GB | {gb(left)} GB{' (does not fit)' if left < 10e9 else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    models = load_models()
    print(single_model_tables(models))
    print()
    print(pair_table(models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
