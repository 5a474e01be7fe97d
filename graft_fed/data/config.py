# TEMPORARY placeholder written by the integrator so the trainer can be tested; the data-layer
# engineer's version replaces this file entirely.
from __future__ import annotations

import json
from dataclasses import dataclass

from graft_fed.data.prompts import Prompt


@dataclass(frozen=True)
class DataConfig:
    source: str = "embedded:arith-v1"
    split: str = "train"
    families: tuple[str, ...] = ()
    per_family: int | None = None
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    max_prompts: int | None = None


def load_prompts(cfg: DataConfig, benchmarks_root=None) -> list[Prompt]:
    if cfg.source.startswith("embedded:"):
        from graft_fed.data.task import embedded_split
        out = embedded_split(cfg.split, families=cfg.families or None, per_family=cfg.per_family)
    else:
        out = [Prompt.make(cfg.source, r[cfg.problem_field], r[cfg.answer_field])
               for r in map(json.loads, open(cfg.source))]
    return out[:cfg.max_prompts] if cfg.max_prompts else out
