"""The prompt record every component exchanges, and its stable id.

A prompt id must be the same at every site that holds the same problem of the same
dataset, whatever order the rows were read in, so that a federation can match groups
by id. It is a hash of the dataset id and the canonical problem text.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Mapping


def canonical_problem(text: str) -> str:
    """Unicode NFC, unified newlines, runs of blanks collapsed, ends stripped."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    lines = [" ".join(line.split()) for line in text.split("\n")]
    return "\n".join(lines).strip()


def stable_prompt_id(dataset_id: str, problem: str) -> str:
    """sha256(dataset_id, NUL, canonical problem), first 16 hex digits (64 bits)."""
    digest = hashlib.sha256()
    digest.update(dataset_id.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(canonical_problem(problem).encode("utf-8"))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Prompt:
    """One verifiable problem.

    `problem` is the bare question (no model-specific template); `answer` is the gold
    final answer as it would appear inside \\boxed{}; `meta` carries extras such as the
    task family of the embedded task.
    """

    id: str
    problem: str
    answer: str
    dataset: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, dataset: str, problem: str, answer: str, **meta: Any) -> "Prompt":
        return cls(id=stable_prompt_id(dataset, problem), problem=problem, answer=str(answer),
                   dataset=dataset, meta=dict(meta))
