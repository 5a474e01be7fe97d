"""Measure the zoo: sampled accuracy per model x family, all-fail groups, and how often a
peer solves what a model fails on (the complementarity GRAFT needs).

    graft-fed zoo measure [--models-dir DIR] [--per-family 64] [--n 8] [--write-doc docs/zoo.md]

For ordered pair (A, B): among the test prompts where all n of A's samples fail, the share
where B has at least one correct sample (the paper reports 47.9% and 18.7% for its two
directions). Scoring is an exact match of the last \\boxed{...} against the integer answer,
which for this task is what a math verifier decides.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that train or sample: `graft-fed <command>` builds its
# parser from this module, and the broker must not load torch (issue 13, fourth pass)

from graft_fed.data.task import embedded_split
from graft_fed.data.templates import render_prompt
from graft_fed.zoo import ZOO_NAMES, zoo_dir

DEFAULT_FAMILIES = ("add", "sub", "mul")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(text: str) -> str | None:
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def score(text: str, answer: str) -> int:
    return int(boxed_answer(text) == answer.strip())


def sample_model(path: Path, prompts: Sequence[Any], n: int, seed: int, batch_size: int,
                 max_new_tokens: int | None = None) -> list[list[int]]:
    """Per prompt, the n binary rewards of the model at `path` (temperature 1, top_p 1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft_fed.rollout.base import SamplingParams
    from graft_fed.rollout.hf import HFRollout

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    if max_new_tokens is None:
        card = json.loads((path / "zoo_card.json").read_text()) if (path / "zoo_card.json").exists() else {}
        max_new_tokens = int(card.get("max_new_tokens", 128)) + 8
    engine = HFRollout(model, tok, batch_size=batch_size, seed=seed)
    texts = [render_prompt(p.problem, "chat", tok) for p in prompts]
    groups = engine.generate(texts, SamplingParams(n=n, temperature=1.0, top_p=1.0,
                                                   max_new_tokens=max_new_tokens))
    return [[score(c.text, p.answer) for c in g] for p, g in zip(prompts, groups)]


def measure(models_dir: Path | None = None, names: Sequence[str] | None = None,
            families: Sequence[str] = DEFAULT_FAMILIES, per_family: int = 64, n: int = 8,
            seed: int = 0, batch_size: int = 256, log=print) -> dict[str, Any]:
    root = Path(models_dir) if models_dir else zoo_dir()
    names = list(names or ZOO_NAMES)
    prompts = embedded_split("test", families, per_family=per_family, seed=seed)
    rewards: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for name in names:
        t0 = time.time()
        rewards[name] = sample_model(root / name, prompts, n, seed, batch_size)
        seconds[name] = round(time.time() - t0, 1)
        log(f"[{name}] sampled {len(prompts)} x {n} in {seconds[name]}s")
    fam_of = [p.meta["family"] for p in prompts]
    acc: dict[str, dict[str, float]] = {}
    allfail: dict[str, dict[str, float]] = {}
    for name in names:
        acc[name], allfail[name] = {}, {}
        for fam in list(families) + ["all"]:
            idx = [i for i, f in enumerate(fam_of) if fam in (f, "all")]
            acc[name][fam] = sum(sum(rewards[name][i]) for i in idx) / (n * len(idx))
            allfail[name][fam] = sum(1 for i in idx if sum(rewards[name][i]) == 0) / len(idx)
    pairs: dict[str, dict[str, Any]] = {}
    for a in names:
        for b in names:
            if a == b:
                continue
            row: dict[str, Any] = {}
            for fam in list(families) + ["all"]:
                fails = [i for i, f in enumerate(fam_of)
                         if fam in (f, "all") and sum(rewards[a][i]) == 0]
                solved = sum(1 for i in fails if sum(rewards[b][i]) > 0)
                row[fam] = {"a_all_fail": len(fails), "b_solves": solved,
                            "share": solved / len(fails) if fails else None}
            pairs[f"{a}->{b}"] = row
    return {"families": list(families), "per_family": per_family, "n": n, "seed": seed,
            "temperature": 1.0, "top_p": 1.0, "accuracy": acc, "all_fail": allfail,
            "pairs": pairs, "sampling_seconds": seconds}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cell(text: str) -> str:
    """Inline code safe inside a markdown table cell (a bare | would split the cell)."""
    return "`" + text.replace("|", "\\|") + "`"


RECIPE_NOTE = [
    'Another SFT recipe, `learnable`, builds the same three models with other family mixes into',
    'a folder of its own (`graft-fed zoo build --recipe learnable --out runs/zoo-learnable`): each',
    "model's weak family is left at about 15-25% sampled accuracy instead of 2-9%, so that RL",
    "can still move it within tens of steps. The miniature experiment's second table uses it;",
    'its measurement is in [results/miniature.md](results/miniature.md).',
    '',
    'A third recipe, `complementary` (issue 15; `--recipe complementary --out runs/zoo-complementary`),',
    'withholds whole sub-skills: llama learns `mod` but not `lin`, gpt2 `lin` but not `mod`, qwen3',
    'neither (add/sub/mul for all), and gpt2 writes its scratchpads in the `words` style. Its',
    'measurements and every variant tried are in [results/miniature.md](results/miniature.md), setting D.',
    '',
]


def render_doc(result: dict[str, Any], cards: dict[str, dict[str, Any]], command: str) -> str:
    fams = result["families"]
    names = list(result["accuracy"])
    lines = [
        "# The embedded zoo",
        "",
        "Three tiny causal LMs shipped in `graft_fed/zoo/models/<name>/` (Hugging Face format,",
        "safetensors, fp32). They differ the way real models differ -- architecture, tokenizer,",
        "size, special tokens, chat template -- and were warm-started by supervised fine-tuning",
        "on the embedded task (`embedded:arith-v1`, graft_fed/data/task.py) with a family mix",
        "that leaves each model weak on a different family, so that one model's all-fail",
        "prompts are often solved by a peer: the situation GRAFT exploits.",
        "",
        "Load with `zoo:<name>` anywhere a model path is accepted, or",
        "`AutoModelForCausalLM.from_pretrained(graft_fed.zoo.resolve_model_path('zoo:<name>'))`.",
        "Prompt with the template `chat` (each tokenizer ships its own one-turn chat template).",
        "",
        "Tokenizers: `tiny-llama-char` is character-level (WordLevel over single characters,",
        "`Fuse` decoder); `tiny-gpt2-bpe` is a BPE without byte-level mapping (Metaspace `\u2581`",
        "for spaces), trained on the task corpus; `tiny-qwen3-unigram` is a Unigram model trained",
        "on the same corpus. Digits are one token each everywhere, so numbers tokenise alike but",
        "everything around them does not: a peer response must be re-tokenised (docs/algorithm.md step 8).",
        "`tokenizer.decode(ids, skip_special_tokens=True)` gives back the exact text.",
        "",
        "Why Qwen3 and not Qwen2: transformers 5 forces `AutoTokenizer` to rebuild a byte-level",
        "BPE `Qwen2Tokenizer` for any `model_type: qwen2` checkpoint (it is in",
        "`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`), which silently drops the spaces of a",
        "Unigram tokenizer. Qwen3 (Qwen2 plus QK-norm) loads the shipped `tokenizer.json` as is.",
        "",
        "## Models",
        "",
        "| model | architecture | params | tokenizer | vocab | eos / pad | prompt (chat template) | SFT mix (add/sub/mul) | SFT steps x batch | max_new_tokens | weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = 0
    for name in names:
        c = cards.get(name, {})
        if not c:
            continue
        mix = c["sft"]["mix"]
        total += c["weights_bytes"]
        lines.append(
            f"| `{name}` | {c['architecture']} | {c['params']:,} | {c['tokenizer']['kind']} "
            f"| {c['tokenizer']['vocab_size']} | {_cell(c['tokenizer']['eos_token'])} / {_cell(c['tokenizer']['pad_token'])} "
            f"| `{json.dumps(c['example_prompt'])[1:-1]}` "
            f"| {'/'.join(str(int(100 * mix.get(f, 0))) for f in ('add', 'sub', 'mul'))} "
            f"| {c['sft']['steps']} x {c['sft']['batch_size']} | {c['max_new_tokens']} "
            f"| {c['weights_bytes'] / 1e6:.2f} MB |")
    lines += ["", f"All weights together: {total / 1e6:.2f} MB. Digits are always one token each.",
              "`max_new_tokens` is the longest test-split solution of any family, in that model's",
              "tokens, plus EOS; sample with at least that (the measurement used it + 8).", ""]
    build = [f"- `{n}`: seed {c['build_seed']}, {c['sft']['train_seconds']:.0f} s of SFT"
             for n, c in cards.items()]
    lines += ["## Build", "", "```", "graft-fed zoo build --seed 0", "```", "",
              "(`python -m graft_fed.zoo.build` is the same; `--only NAME` rebuilds one model,",
              "`--threads 1` and one process per model is the fastest way on 2 cores.) SFT wall time,",
              "the three models trained in parallel with one thread each on a shared 2-core machine:",
              ""] + build + [
              "", "Bit-for-bit identical weights need the same torch build and thread count; the",
              "measured behaviour does not depend on it.", ""] + RECIPE_NOTE
    lines += [
        "## Measurements",
        "",
        f"Test split, {result['per_family']} prompts per family, n = {result['n']} samples per prompt,",
        f"temperature {result['temperature']}, top_p {result['top_p']}, sampling seed {result['seed']}. Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        "### Sampled accuracy (pass@1) per model x family",
        "",
        "| model | " + " | ".join(fams) + " | all |",
        "|---|" + "---|" * (len(fams) + 1),
    ]
    for name in names:
        lines.append(f"| `{name}` | " + " | ".join(_pct(result["accuracy"][name][f]) for f in fams + ["all"]) + " |")
    lines += ["", "### Share of all-fail groups (k = 0 of n)", "",
              "| model | " + " | ".join(fams) + " | all |", "|---|" + "---|" * (len(fams) + 1)]
    for name in names:
        lines.append(f"| `{name}` | " + " | ".join(_pct(result["all_fail"][name][f]) for f in fams + ["all"]) + " |")
    lines += ["", "### Complementarity: share of A's all-fail prompts that B solves (>= 1 of n correct)", "",
              "Cells read `share (B solves / A all-fail)`. The paper reports 47.9% and 18.7% for its pair.", "",
              "| A (fails all) | B (solves) | " + " | ".join(fams) + " | all |",
              "|---|---|" + "---|" * (len(fams) + 1)]
    for key, row in result["pairs"].items():
        a, b = key.split("->")
        cells = [f"{_pct(row[f]['share'])} ({row[f]['b_solves']}/{row[f]['a_all_fail']})" for f in fams + ["all"]]
        lines.append(f"| `{a}` | `{b}` | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models-dir", default=None, help="folder holding the models (default: the shipped zoo)")
    p.add_argument("--only", action="append", choices=ZOO_NAMES, metavar="NAME", help="measure only this model")
    p.add_argument("--families", default=",".join(DEFAULT_FAMILIES), help="comma-separated task families")
    p.add_argument("--per-family", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the raw result here")
    p.add_argument("--write-doc", default=None, metavar="PATH",
                   help="render the zoo page (e.g. docs/zoo.md) and store the measurement in each zoo_card.json")


def run_measure(args: argparse.Namespace, command: str | None = None) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    root = Path(args.models_dir) if args.models_dir else zoo_dir()
    fams = [f.strip() for f in args.families.split(",") if f.strip()]
    result = measure(root, args.only, fams, args.per_family, args.n, args.seed, args.batch_size)
    for name in result["accuracy"]:
        print(f"{name:22s} " + "  ".join(f"{f} {_pct(result['accuracy'][name][f]):>6} (all-fail {_pct(result['all_fail'][name][f])})"
                                         for f in fams))
    for key, row in result["pairs"].items():
        print(f"{key:45s} " + "  ".join(f"{f} {_pct(row[f]['share'])}" for f in fams + ["all"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.write_doc:
        cards = {}
        for name in result["accuracy"]:
            card_path = root / name / "zoo_card.json"
            card = json.loads(card_path.read_text())
            card["measured"] = {
                "split": "test", "per_family": result["per_family"], "n": result["n"],
                "temperature": 1.0, "top_p": 1.0, "seed": result["seed"],
                "accuracy": {f: round(v, 4) for f, v in result["accuracy"][name].items()},
                "all_fail": {f: round(v, 4) for f, v in result["all_fail"][name].items()},
            }
            card_path.write_text(json.dumps(card, indent=2) + "\n")
            cards[name] = card
        cmd = command or "graft-fed zoo measure " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        Path(args.write_doc).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write_doc).write_text(render_doc(result, cards, cmd), encoding="utf-8")
        print(f"wrote {args.write_doc}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="graft-fed zoo measure", description=__doc__.split("\n\n")[0])
    add_measure_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_measure(p.parse_args(argv), "graft-fed zoo measure " + " ".join(shlex.quote(a) for a in argv))


if __name__ == "__main__":
    raise SystemExit(main())
