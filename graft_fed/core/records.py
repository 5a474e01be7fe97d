"""The group record: what a model publishes about one prompt's group, and what a
receiver needs to train on it. Plain data, shared by the trajectory store, the
co-trainer and (later) the wire format."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from graft_fed.core.exchange import classify


class RecordError(ValueError):
    """A group record is inconsistent; the message says which field and why."""


@dataclass(frozen=True)
class GroupRecord:
    prompt_id: str
    step: int  # the producer's training step (policy version) that sampled the group
    model_id: str  # who generated it
    tokenizer_id: str
    problem: str
    answer: str
    rewards: tuple[float, ...]  # (n,) binary, as the producer's verifier scored them
    advantages: tuple[float, ...]  # (n,) computed by the producer on its full group
    texts: tuple[str, ...]  # (n,) decoded responses
    finish_reasons: tuple[str, ...]  # (n,) "stop" | "length"
    lengths: tuple[int, ...]  # (n,) response length in the PRODUCER's tokens
    mean_logprobs: tuple[float, ...]  # (n,) lbar(pi_old^S, o^S): mean generation log-prob (Eq. 6)
    run_id: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.rewards)

    @property
    def k(self) -> int:
        return sum(1 for r in self.rewards if r > 0.5)

    @property
    def kind(self) -> str:
        return classify(self.k, self.n)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["meta"] = dict(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GroupRecord":
        try:
            rec = cls(prompt_id=str(d["prompt_id"]), step=int(d["step"]), model_id=str(d["model_id"]),
                      tokenizer_id=str(d.get("tokenizer_id", "")), problem=str(d["problem"]),
                      answer=str(d["answer"]), rewards=tuple(float(x) for x in d["rewards"]),
                      advantages=tuple(float(x) for x in d["advantages"]), texts=tuple(str(x) for x in d["texts"]),
                      finish_reasons=tuple(str(x) for x in d["finish_reasons"]),
                      lengths=tuple(int(x) for x in d["lengths"]),
                      mean_logprobs=tuple(float(x) for x in d["mean_logprobs"]), run_id=str(d.get("run_id", "")),
                      meta=dict(d.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"malformed group record: {exc!r}") from None
        rec.validate()
        return rec

    def validate(self) -> None:
        """Structural checks a receiver runs before anything else (it re-verifies rewards later)."""
        n = self.n
        if n < 1:
            raise RecordError(f"group {self.prompt_id}: no responses")
        for name in ("advantages", "texts", "finish_reasons", "lengths", "mean_logprobs"):
            if len(getattr(self, name)) != n:
                raise RecordError(f"group {self.prompt_id}: {name} has {len(getattr(self, name))} entries, "
                                  f"rewards has {n}")
        if any(r not in (0.0, 1.0) for r in self.rewards):
            raise RecordError(f"group {self.prompt_id}: rewards must be binary 0/1")
        for name in ("advantages", "mean_logprobs"):
            if not all(math.isfinite(x) for x in getattr(self, name)):
                raise RecordError(f"group {self.prompt_id}: {name} must be finite")
        if any(lp > 1e-6 for lp in self.mean_logprobs):
            raise RecordError(f"group {self.prompt_id}: a mean log-prob is positive (log-probs are <= 0)")
        if any(f not in ("stop", "length") for f in self.finish_reasons):
            raise RecordError(f"group {self.prompt_id}: finish_reasons must be 'stop' or 'length'")
        if any(length < 1 for length in self.lengths):
            raise RecordError(f"group {self.prompt_id}: every response has at least one token")
        # Advantages must agree in sign with the rewards they claim: successes above the
        # group mean, failures below (zero-variance groups: all zero).
        if 0 < self.k < n:
            for r, a in zip(self.rewards, self.advantages):
                if (r > 0.5 and a <= 0) or (r < 0.5 and a >= 0):
                    raise RecordError(f"group {self.prompt_id}: advantage {a:+.3f} contradicts reward {r:g}")
        elif any(a != 0.0 for a in self.advantages):
            raise RecordError(f"group {self.prompt_id}: a zero-variance group must have zero advantages")


def records_by_prompt(records: Sequence[GroupRecord]) -> dict[str, GroupRecord]:
    return {r.prompt_id: r for r in records}
