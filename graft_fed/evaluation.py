"""pass@1 evaluation: the mean over k samples per prompt, with a standard error.

The paper evaluates with temperature 0.6, top_p 0.95 and 8 samples per prompt; those are
the defaults. The standard error is over prompts (the spread of per-prompt means / sqrt P),
which is the uncertainty that matters when comparing two models on the same benchmark.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from graft_fed.data.prompts import Prompt
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

    def summary(self) -> dict[str, Any]:
        return {"pass@1": self.pass_at_1, "stderr": self.stderr, "n_prompts": self.n_prompts, "k": self.k,
                "by_group": self.by_group, "verifier_timeouts": self.timeouts, "verifier_errors": self.errors}


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
             group_key: str = "family", seeding: str = "stream") -> EvalResult:
    """Sample k responses per prompt and score them; never touches the caller's RNG streams.

    seeding "prompt" keys each prompt's samples by (seed, prompt id) (see EvalSection.seeding);
    "stream" draws every token from one generator seeded with `seed`."""
    if seeding not in ("stream", "prompt"):
        raise ValueError(f"seeding must be stream or prompt, got {seeding!r}")
    engine = HFRollout(model, tokenizer, batch_size=batch_size, seed=seed, add_special_tokens=add_special_tokens)
    texts = [render_prompt(p.problem, template, tokenizer) for p in prompts]
    sampling = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    if seeding == "prompt":
        groups = engine.generate(texts, sampling, seeds=[prompt_seed(seed, p.id) for p in prompts])
    else:
        groups = engine.generate(texts, sampling)
    responses = [c.text for g in groups for c in g]
    answers = [p.answer for p, g in zip(prompts, groups) for _ in g]
    scored = verifier.score(responses, answers)
    rows, per_prompt = [], []
    by_group: dict[str, list[float]] = defaultdict(list)
    for i, (p, g) in enumerate(zip(prompts, groups)):
        rewards = scored.rewards[i * k:(i + 1) * k]
        mean = sum(rewards) / k
        per_prompt.append(mean)
        if group_key in p.meta:
            by_group[str(p.meta[group_key])].append(mean)
        rows.append({"id": p.id, "problem": p.problem, "answer": p.answer, "pass@1": mean,
                     "rewards": rewards, "responses": [c.text for c in g],
                     "finish_reasons": [c.finish_reason for c in g], **({group_key: p.meta[group_key]}
                                                                        if group_key in p.meta else {})})
    pass1, stderr = mean_and_stderr(per_prompt)
    return EvalResult(pass_at_1=pass1, stderr=stderr, n_prompts=len(prompts), k=k,
                      by_group={key: sum(v) / len(v) for key, v in sorted(by_group.items())},
                      rows=rows, timeouts=scored.timeouts, errors=scored.errors)


def write_eval(result: EvalResult, out_dir: str | Path, name: str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
        for row in result.rows:
            fh.write(json.dumps(row) + "\n")
    path = out_dir / f"{name}.summary.json"
    path.write_text(json.dumps(result.summary(), indent=2), encoding="utf-8")
    return path
