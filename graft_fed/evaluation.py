"""pass@1 evaluation: the mean over k samples per prompt, with a standard error.

The paper evaluates with temperature 0.6, top_p 0.95 and 8 samples per prompt; those are
the defaults. The standard error is over prompts (the spread of per-prompt means / sqrt P),
which is the uncertainty that matters when comparing two models on the same benchmark.

Prompts are fitted to the model's context (its position limit): a prompt that leaves no
room for the new tokens asked (or for half the context, whichever is less) is skipped and
counted rather than crashing the position embedding, and new tokens are capped so that the
longest kept prompt plus its response fits.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from graft_fed.data.prompts import Prompt
from graft_fed.errors import DataError
from graft_fed.data.templates import render_prompt
from graft_fed.rollout.base import SamplingParams
from graft_fed.rollout.hf import HFRollout, stream_seed


@dataclass
class EvalResult:
    pass_at_1: float
    stderr: float
    n_prompts: int
    k: int
    by_group: dict[str, float] = field(default_factory=dict)  # e.g. per task family
    rows: list[dict[str, Any]] = field(default_factory=list)
    timeouts: int = 0
    errors: int = 0
    #: prompts left out because they do not fit the model's context (see fit_to_context)
    skipped: int = 0
    #: new tokens per response actually used (the request capped at the context), 0 if unknown
    max_new_tokens: int = 0
    #: per meta key the benchmark carries (family, level, subject): value -> {pass@1, stderr, n}
    breakdown: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"pass@1": self.pass_at_1, "stderr": self.stderr, "n_prompts": self.n_prompts, "k": self.k,
                "by_group": self.by_group, "breakdown": self.breakdown, "skipped_prompts": self.skipped,
                "max_new_tokens": self.max_new_tokens, "verifier_timeouts": self.timeouts,
                "verifier_errors": self.errors}

    def table(self) -> str:
        """A readable summary: overall pass@1 with its standard error, then each breakdown."""
        lines = [f"pass@1 {100 * self.pass_at_1:.1f} +- {100 * self.stderr:.1f} (percent; {self.n_prompts} prompts "
                 f"x {self.k} samples" + (f", {self.skipped} skipped: longer than the model's context allows"
                                          if self.skipped else "") + ")"]
        for key, rows in self.breakdown.items():
            lines.append("")
            lines.append(f"{key:<24} {'n':>5} {'pass@1':>7} {'+-':>5}")
            for value, r in rows.items():
                se = "" if math.isnan(r["stderr"]) else f"{100 * r['stderr']:.1f}"
                lines.append(f"{value[:24]:<24} {int(r['n']):>5} {100 * r['pass@1']:>7.1f} {se:>5}")
        return "\n".join(lines)


#: meta keys reported as a breakdown when a benchmark's prompts carry them
BREAKDOWN_KEYS = ("family", "level", "subject")


def model_context(model: Any) -> int | None:
    """The model's position limit (tokens of prompt plus response), None when it has none."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def fit_to_context(lengths: Sequence[int], max_new_tokens: int, context: int | None) -> tuple[list[int], int]:
    """(indices of the prompts kept, new tokens to sample). A prompt is kept when it leaves
    room for the new tokens asked or for half the context, whichever is less; new tokens are
    then capped so that the longest kept prompt and its response fit."""
    if context is None:
        return list(range(len(lengths))), max_new_tokens
    room = min(max_new_tokens, context // 2)
    keep = [i for i, n in enumerate(lengths) if n + room <= context]
    if not keep:
        return [], 0
    return keep, max(1, min(max_new_tokens, context - max(lengths[i] for i in keep)))


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The sampling key of one evaluation prompt: its id and the evaluation seed, nothing else."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).digest()
    return stream_seed(seed, int.from_bytes(digest[:8], "little"))


def evaluate(model: Any, tokenizer: Any, prompts: Sequence[Prompt], verifier: Any, *, template: str,
             add_special_tokens: bool, k: int = 8, temperature: float = 0.6, top_p: float = 0.95,
             max_new_tokens: int = 256, seed: int = 1234, batch_size: int = 128,
             group_key: str = "family", seeding: str = "stream", progress: bool = False) -> EvalResult:
    """Sample k responses per prompt and score them; never touches the caller's RNG streams.

    seeding "prompt" keys each prompt's samples by (seed, prompt id) (see EvalSection.seeding);
    "stream" draws every token from one generator seeded with `seed`. progress: a line with
    the prompts done and the time left on stderr (sampling goes in chunks whose boundaries
    are the engine's own batches, so the samples are the same either way)."""
    if seeding not in ("stream", "prompt"):
        raise ValueError(f"seeding must be stream or prompt, got {seeding!r}")
    engine = HFRollout(model, tokenizer, batch_size=batch_size, seed=seed, add_special_tokens=add_special_tokens)
    all_texts = [render_prompt(p.problem, template, tokenizer) for p in prompts]
    keep, max_new_tokens = fit_to_context([len(engine.encode(t)) for t in all_texts], max_new_tokens,
                                          model_context(model))
    skipped = len(prompts) - len(keep)
    if not keep:
        raise DataError(f"none of the {len(prompts)} prompts fits the model's context of {model_context(model)} "
                        "tokens with room for an answer")
    prompts = [prompts[i] for i in keep]
    texts = [all_texts[i] for i in keep]
    sampling = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    seeds = [prompt_seed(seed, p.id) for p in prompts] if seeding == "prompt" else None
    # a chunk of `step` prompts is a whole number of the engine's batches of completions
    step = batch_size // math.gcd(batch_size, k) if progress else len(texts)
    step *= max(1, -(-len(texts) // step) // 20) if progress else 1  # about 20 progress lines at most
    groups: list = []
    t0 = time.monotonic()
    for start in range(0, len(texts), step):
        groups += engine.generate(texts[start:start + step], sampling,
                                  seeds=seeds[start:start + step] if seeds is not None else None)
        if progress:
            done, elapsed = len(groups), time.monotonic() - t0
            eta = elapsed / done * (len(texts) - done)
            print(f"eval: {done}/{len(texts)} prompts, {elapsed:.0f} s, about {eta:.0f} s left", file=sys.stderr,
                  flush=True)
    responses = [c.text for g in groups for c in g]
    answers = [p.answer for p, g in zip(prompts, groups) for _ in g]
    scored = verifier.score(responses, answers)
    rows, per_prompt = [], []
    by_group: dict[str, list[float]] = defaultdict(list)
    by_key: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, (p, g) in enumerate(zip(prompts, groups)):
        rewards = scored.rewards[i * k:(i + 1) * k]
        mean = sum(rewards) / k
        per_prompt.append(mean)
        if group_key in p.meta:
            by_group[str(p.meta[group_key])].append(mean)
        for key in dict.fromkeys((group_key, *BREAKDOWN_KEYS)):
            if key in p.meta:
                by_key[key][str(p.meta[key])].append(mean)
        rows.append({"id": p.id, "problem": p.problem, "answer": p.answer, "pass@1": mean,
                     "rewards": rewards, "responses": [c.text for c in g],
                     "finish_reasons": [c.finish_reason for c in g], **({group_key: p.meta[group_key]}
                                                                        if group_key in p.meta else {})})
    pass1, stderr = mean_and_stderr(per_prompt)
    return EvalResult(pass_at_1=pass1, stderr=stderr, n_prompts=len(prompts), k=k,
                      by_group={key: sum(v) / len(v) for key, v in sorted(by_group.items())},
                      rows=rows, timeouts=scored.timeouts, errors=scored.errors, skipped=skipped,
                      max_new_tokens=max_new_tokens,
                      breakdown={key: {value: dict(zip(("pass@1", "stderr"), mean_and_stderr(v)), n=len(v))
                                       for value, v in sorted(values.items())}
                                 for key, values in by_key.items()})


def eval_record(result: EvalResult, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary file's content: which model on which benchmark (`settings["model"]`,
    `settings["benchmark"]`), the result, and every setting that shapes the number."""
    if not settings:
        return result.summary()
    return {"model": settings.get("model"), "benchmark": settings.get("benchmark"), **result.summary(),
            "settings": settings}


def write_eval(result: EvalResult, out_dir: str | Path, name: str, settings: dict[str, Any] | None = None) -> Path:
    """Write `name`.jsonl (per-prompt results) and `name`.summary.json (eval_record) under
    `out_dir`; returns the summary's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
        for row in result.rows:
            fh.write(json.dumps(row) + "\n")
    path = out_dir / f"{name}.summary.json"
    path.write_text(json.dumps(eval_record(result, settings), indent=2), encoding="utf-8")
    return path


#: recorded settings that do not make another evaluation (the version; the template the default
#: resolved to, known only once the model is loaded: the same for the same model)
_NOT_IDENTITY = ("graft_fed_version", "template_used")


def eval_conflict(path: str | Path, settings: dict[str, Any]) -> str:
    """Why writing an evaluation with `settings` to the summary `path` would replace another
    evaluation ("" when there is none there, or it is the same evaluation: same model,
    benchmark and settings, whose re-run may replace it)."""
    path = Path(path)
    if not path.exists():
        return ""
    try:
        theirs = json.loads(path.read_text(encoding="utf-8")).get("settings")
    except (OSError, ValueError, AttributeError):
        theirs = None
    if not isinstance(theirs, dict):
        return f"{path} holds an evaluation that records no model or settings (an earlier graft-fed wrote it)"
    # a local model or benchmark is the folder or file it resolves to, however it was written
    # (runs/x/model and ../main/runs/x/model are one model)
    as_written = {name for name in ("model", "benchmark")
                  if theirs.get(f"{name}_path") and settings.get(f"{name}_path")}
    keys = [k for k in dict.fromkeys([*theirs, *settings]) if k not in _NOT_IDENTITY and k not in as_written]
    diff = [f"{k}: {json.dumps(theirs.get(k))} -> {json.dumps(settings.get(k))}" for k in keys
            if theirs.get(k) != settings.get(k)]
    if not diff:
        return ""
    return (f"{path} holds the evaluation of {theirs.get('model')} on {theirs.get('benchmark')} "
            f"(that one -> this one: {'; '.join(diff)})")
