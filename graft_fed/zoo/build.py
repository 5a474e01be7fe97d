"""Build the embedded zoo from a seed: tokenizers, tiny models, supervised warm start.

Each model is warm-started by supervised fine-tuning on the embedded task's scratchpad
solutions: prompt = the model's own chat template around the problem, target = the
scratchpad + EOS, loss on the response tokens only.  The family mix differs per model
(a small share of one "weak" family, a different one per model), which gives the zoo the
complementary strengths GRAFT feeds on: a prompt one model fails on all n samples is
often solved by a peer.

    graft-fed zoo build [--out DIR] [--seed S] [--only NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import string
import time
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that train or sample: `graft-fed <command>` builds its
# parser from this module, and the broker must not load torch (issue 13, fourth pass)

from graft_fed.data.task import FAMILIES, embedded_split, solution
from graft_fed.data.templates import render_prompt
from graft_fed.errors import ConfigError
from graft_fed.zoo import ZOO_NAMES, zoo_dir

#: Every character the character-level vocabulary and the subword alphabets hold: printable
#: ASCII (space included) and the newline, so any English math problem encodes without <unk>.
ALPHABET = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
METASPACE = "\u2581"


@dataclass(frozen=True)
class ZooSpec:
    name: str
    arch: str  # "llama" | "gpt2" | "qwen3"
    tokenizer: str  # "char" | "bpe" | "unigram"
    chat_template: str
    special: dict[str, str]  # eos / pad / unk token strings
    model: dict[str, Any]  # config kwargs
    mix: dict[str, float]  # SFT family mix
    vocab_size: int = 0  # subword vocab target (0 for char-level)
    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    #: Scratchpad styles of the SFT targets (graft_fed.data.task.STYLES) -> share of examples;
    #: each training problem gets one style, by a hash of its id.
    styles: Mapping[str, float] = field(default_factory=lambda: {"plain": 1.0})


def _one_turn_template(user_prefix: str, assistant_prefix: str) -> str:
    return ("{% for message in messages %}{% if message['role'] == 'user' %}"
            + user_prefix + "{{ message['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}" + assistant_prefix + "{% endif %}")


SPECS: dict[str, ZooSpec] = {s.name: s for s in (
    ZooSpec(
        name="tiny-llama-char", arch="llama", tokenizer="char",
        chat_template=_one_turn_template("Q: ", "A: "),
        special={"eos": "</s>", "pad": "<pad>", "unk": "<unk>"},
        model=dict(hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                   tie_word_embeddings=True),
        mix={"add": 0.45, "sub": 0.10, "mul": 0.45},
    ),
    ZooSpec(
        name="tiny-gpt2-bpe", arch="gpt2", tokenizer="bpe",
        chat_template=_one_turn_template("Question: ", "Answer:\n"),
        special={"eos": "<|endoftext|>", "pad": "<|pad|>", "unk": "<|unk|>"},
        model=dict(n_embd=128, n_layer=4, n_head=4, n_positions=192, tie_word_embeddings=True,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        mix={"add": 0.40, "sub": 0.40, "mul": 0.20}, vocab_size=320, steps=1200,
    ),
    ZooSpec(
        name="tiny-qwen3-unigram", arch="qwen3", tokenizer="unigram",
        chat_template=_one_turn_template("User: ", "Assistant: "),
        special={"eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": "<unk>"},
        model=dict(hidden_size=96, intermediate_size=320, num_hidden_layers=4, head_dim=24,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   tie_word_embeddings=True, use_sliding_window=False),
        mix={"add": 0.03, "sub": 0.50, "mul": 0.47}, vocab_size=260, steps=800,
    ),
)}
assert tuple(SPECS) == ZOO_NAMES

# Alternative SFT recipes, built into a folder of their own (`--recipe NAME --out DIR`); the
# shipped zoo is `default`. `learnable` leaves each model's weak family at about 15-25% sampled
# accuracy instead of 2-9%, so GRPO can still move it within tens of steps (see
# docs/results/miniature.md: with the default zoo the weak families barely move in 20-30 RL
# steps, with or without peers).
RECIPES: dict[str, dict[str, ZooSpec]] = {
    "default": SPECS,
    "learnable": {
        "tiny-llama-char": dataclasses.replace(SPECS["tiny-llama-char"],
                                               mix={"add": 0.40, "sub": 0.16, "mul": 0.44}),
        "tiny-gpt2-bpe": dataclasses.replace(SPECS["tiny-gpt2-bpe"],
                                             mix={"add": 0.35, "sub": 0.35, "mul": 0.30}),
        "tiny-qwen3-unigram": dataclasses.replace(SPECS["tiny-qwen3-unigram"],
                                                  mix={"add": 0.05, "sub": 0.25, "mul": 0.70}),
    },
    # Complementary skills (issue 15): every model knows add/sub/mul; `mod` and `lin` are the
    # withheld sub-skills. llama learns mod but not lin, gpt2 lin but not mod, qwen3 neither, so
    # each withheld slice of a receiver has exactly one peer that solves it. A withheld family
    # is absent from the model's SFT data. gpt2 writes every scratchpad in the `words` style,
    # which the other two never saw: the gate has something to reject. Recipe 1 (a 1% share of
    # each withheld family, llama 800 steps at 25% mod) left qwen3 at 16% on mod and llama at
    # 25% on mod; recipe 2 (gpt2 half plain, half words) left gpt2 at 2-6% on add/sub/mul and
    # 14% on lin, and recipe 3 (words only) at 2-6% and 16%: at 20% a family gpt2 does not
    # learn in 1200 steps (the shipped zoo's gpt2 has 6.6% on its 20% mul), so recipe 4 (this
    # one) trains it 2400 steps. Every recipe tried: docs/results/miniature.md (setting D).
    "complementary": {
        "tiny-llama-char": dataclasses.replace(
            SPECS["tiny-llama-char"], mix={"add": 0.2, "sub": 0.2, "mul": 0.2, "mod": 0.4}, steps=1600),
        "tiny-gpt2-bpe": dataclasses.replace(
            SPECS["tiny-gpt2-bpe"], mix={"add": 0.2, "sub": 0.2, "mul": 0.2, "lin": 0.4},
            styles={"words": 1.0}, steps=2400),
        "tiny-qwen3-unigram": dataclasses.replace(
            SPECS["tiny-qwen3-unigram"], mix={"add": 0.33, "sub": 0.33, "mul": 0.34}),
    },
    # A missing sub-skill inside a known family (issue 15, setting E): the `complementary` recipe
    # showed that a model never taught a whole family finds a peer's solutions of it implausible
    # (s = 0.00 on every withheld slice), so the gate admits none. Here each receiver misses a
    # few steps of a family it otherwise knows: qwen3 never sees an addition with a carry-out
    # (add_carry), llama never a subtraction that borrows (sub_borrow). Each slice has one
    # plausible solver (the other plain-style model) and one implausible one (gpt2, in words,
    # the same model as in `complementary`).
    "carry": {
        "tiny-llama-char": dataclasses.replace(
            SPECS["tiny-llama-char"], mix={"add": 0.33, "sub_noborrow": 0.33, "mul": 0.34}, steps=1200),
        "tiny-gpt2-bpe": dataclasses.replace(
            SPECS["tiny-gpt2-bpe"], mix={"add": 0.2, "sub": 0.2, "mul": 0.2, "lin": 0.4},
            styles={"words": 1.0}, steps=2400),
        "tiny-qwen3-unigram": dataclasses.replace(
            SPECS["tiny-qwen3-unigram"], mix={"add_nocarry": 0.33, "sub": 0.33, "mul": 0.34}),
    },
}


def style_of(prompt_id: str, styles: Mapping[str, float], seed: int) -> str:
    """The scratchpad style of one SFT example: a deterministic draw from `styles` by a hash of
    the prompt's id and the build seed."""
    names = [n for n, w in styles.items() if w > 0]
    if len(names) == 1:
        return names[0]
    u = int.from_bytes(hashlib.sha256(f"style|{seed}|{prompt_id}".encode()).digest()[:8], "big") / 2 ** 64
    total, acc = sum(styles[n] for n in names), 0.0
    for n in names:
        acc += styles[n] / total
        if u < acc:
            return n
    return names[-1]


# --- tokenizers -----------------------------------------------------------------------

def tokenizer_corpus(seed: int = 0, styles: Sequence[str] = ("plain",)) -> list[str]:
    """Problems and scratchpads of every family (train split), the text tokenizers learn from;
    scratchpads in every style of `styles` (the default: the plain one only)."""
    rows = embedded_split("train", FAMILIES, per_family=1000, seed=seed)
    return [r.problem for r in rows] + [solution(r, st) for st in styles for r in rows]


def build_tokenizer(spec: ZooSpec, corpus: Sequence[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [spec.special["pad"], spec.special["eos"], spec.special["unk"]]
    if spec.tokenizer == "char":
        vocab = {tok: i for i, tok in enumerate(specials + ALPHABET)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=spec.special["unk"]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        # Metaspace keeps spaces as a visible piece so decoding gives back the exact text;
        # digits are split one by one, as in Llama/Qwen tokenizers, so numbers never merge.
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="never", split=True),
            pre_tokenizers.Digits(individual_digits=True),
        ])
        alphabet = [c if c != " " else METASPACE for c in ALPHABET]
        if spec.tokenizer == "bpe":
            tok = Tokenizer(models.BPE(unk_token=spec.special["unk"]))
            trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=specials,
                                          initial_alphabet=alphabet, min_frequency=2,
                                          show_progress=False)
        elif spec.tokenizer == "unigram":
            tok = Tokenizer(models.Unigram())
            trainer = trainers.UnigramTrainer(vocab_size=spec.vocab_size, special_tokens=specials,
                                              unk_token=spec.special["unk"], initial_alphabet=alphabet,
                                              show_progress=False)
        else:
            raise ConfigError(f"unknown tokenizer kind {spec.tokenizer!r}")
        tok.pre_tokenizer = pre
        tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="never", split=True)
        tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec.special["eos"],
                                   pad_token=spec.special["pad"], unk_token=spec.special["unk"],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = spec.chat_template
    return fast


# --- models ---------------------------------------------------------------------------

def build_model(spec: ZooSpec, tokenizer: Any) -> Any:
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.eos_token_id)
    vocab = len(tokenizer)
    if spec.arch == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **ids, **spec.model))
    if spec.arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, **ids, **spec.model))
    if spec.arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, **ids, **spec.model))
    raise ConfigError(f"unknown architecture {spec.arch!r}")


def n_params(model: Any) -> int:
    # Tied embeddings are counted once.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --- supervised warm start ------------------------------------------------------------

@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]


def encode_examples(tokenizer: Any, families: Sequence[str], seed: int,
                    styles: Mapping[str, float] | None = None) -> dict[str, list[Example]]:
    styles = {"plain": 1.0} if styles is None else styles
    out: dict[str, list[Example]] = {}
    for fam in families:
        rows = embedded_split("train", [fam], seed=seed)
        prompts = [render_prompt(r.problem, "chat", tokenizer) for r in rows]
        p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer([solution(r, style_of(r.id, styles, seed)) for r in rows],
                          add_special_tokens=False)["input_ids"]
        out[fam] = [Example(list(p), list(r) + [tokenizer.eos_token_id]) for p, r in zip(p_ids, r_ids)]
    return out


def _collate(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    # Right padding: positions of real tokens start at 0, as in the project's packing
    # convention, so absolute-position models (GPT-2) train on the positions they sample at.
    seqs = [e.prompt_ids + e.response_ids for e in batch]
    length = max(len(s) for s in seqs)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for i, (e, s) in enumerate(zip(batch, seqs)):
        ids[i, :len(s)] = torch.as_tensor(s)
        mask[i, :len(s)] = 1
        labels[i, len(e.prompt_ids):len(s)] = torch.as_tensor(e.response_ids)
    return ids, mask, labels


def sft(model: Any, tokenizer: Any, spec: ZooSpec, seed: int, steps: int | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    steps = spec.steps if steps is None else steps
    families = [f for f, w in spec.mix.items() if w > 0]
    weights = [spec.mix[f] for f in families]
    data = encode_examples(tokenizer, families, seed, spec.styles)
    rng = random.Random(f"sft|{spec.name}|{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        frac = (step - spec.warmup) / max(1, steps - spec.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    start, running = time.time(), None
    for step in range(steps):
        fams = rng.choices(families, weights, k=spec.batch_size)
        batch = [rng.choice(data[f]) for f in fams]
        ids, mask, labels = _collate(batch, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"[{spec.name}] step {step + 1}/{steps} loss {running:.4f} ({time.time() - start:.0f}s)")
    model.eval()
    return {"steps": steps, "batch_size": spec.batch_size, "lr": spec.lr, "warmup": spec.warmup,
            "mix": dict(spec.mix), **({} if dict(spec.styles) == {"plain": 1.0} else {"styles": dict(spec.styles)}),
            "final_loss": round(float(running or 0.0), 4),
            "train_seconds": round(time.time() - start, 1)}


def max_solution_tokens(tokenizer: Any, families: Sequence[str] = FAMILIES, seed: int = 0,
                        styles: Sequence[str] = ("plain",)) -> int:
    rows = embedded_split("test", families, seed=seed)
    enc = tokenizer([solution(r, st) for st in styles for r in rows], add_special_tokens=False)["input_ids"]
    return max(len(x) for x in enc) + 1  # + EOS


def build_one(spec: ZooSpec, out_dir: Path, seed: int, steps: int | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    styles = [n for n, w in spec.styles.items() if w > 0]
    tokenizer = build_tokenizer(spec, tokenizer_corpus(seed, styles))
    torch.manual_seed(seed)
    model = build_model(spec, tokenizer)
    log(f"[{spec.name}] {spec.arch}, {spec.tokenizer} tokenizer, vocab {len(tokenizer)}, "
        f"{n_params(model):,} params")
    train = sft(model, tokenizer, spec, seed, steps, log)
    path = out_dir / spec.name
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    for f in path.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the files ship in the package
    card = {
        "name": spec.name,
        "architecture": type(model).__name__,
        "model_type": model.config.model_type,
        "params": n_params(model),
        "config": dict(spec.model),
        "tokenizer": {"kind": spec.tokenizer, "vocab_size": len(tokenizer),
                      "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
                      "digits": "one token per digit"},
        "chat_template": spec.chat_template,
        "example_prompt": render_prompt("What is 482 + 379?", "chat", tokenizer),
        "max_new_tokens": max_solution_tokens(tokenizer, styles=styles),
        "build_seed": seed,
        "sft": train,
        "weights_bytes": (path / "model.safetensors").stat().st_size,
        "measured": {},
    }
    (path / "zoo_card.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    log(f"[{spec.name}] saved to {path} ({card['weights_bytes'] / 1e6:.2f} MB)")
    return card


def build_zoo(out_dir: str | Path | None = None, seed: int = 0, names: Sequence[str] | None = None,
              steps: int | None = None, threads: int | None = None,
              log: Callable[[str], None] | None = None, recipe: str = "default") -> list[dict[str, Any]]:
    """Build (train and save) the zoo models `names` (default all) under `out_dir`."""
    if recipe not in RECIPES:
        raise ConfigError(f"unknown zoo recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")
    if recipe != "default" and out_dir is None:
        raise ConfigError(f"recipe {recipe!r} would overwrite the shipped zoo; give it a folder with --out DIR")
    specs = RECIPES[recipe]
    out = Path(out_dir) if out_dir is not None else zoo_dir()
    names = list(ZOO_NAMES if names is None else names)
    for n in names:
        if n not in SPECS:
            raise ConfigError(f"unknown zoo model {n!r}; the zoo has: {', '.join(ZOO_NAMES)}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    if log is None:
        def log(msg: str) -> None:
            print(msg, flush=True)
    return [build_one(specs[n], out, seed, steps, log) for n in names]


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="output folder (default: the package's zoo folder)")
    p.add_argument("--seed", type=int, default=0, help="build seed (default 0)")
    p.add_argument("--only", action="append", choices=ZOO_NAMES, metavar="NAME",
                   help=f"build only this model (repeatable): {', '.join(ZOO_NAMES)}")
    p.add_argument("--steps", type=int, default=None, help="override the SFT steps of every model")
    p.add_argument("--recipe", default="default", choices=sorted(RECIPES),
                   help="SFT family mixes: default (the shipped zoo), learnable (weak families at "
                        "15-25%%) or complementary (withheld mod/lin, one peer solves each; issue 15); "
                        "all but default need --out")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run_build(args: argparse.Namespace) -> int:
    t0 = time.time()
    build_zoo(args.out, seed=args.seed, names=args.only, steps=args.steps, threads=args.threads,
              recipe=args.recipe)
    print(f"zoo built in {time.time() - t0:.0f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="graft-fed zoo build", description=__doc__.split("\n\n")[0])
    add_build_arguments(p)
    return run_build(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
