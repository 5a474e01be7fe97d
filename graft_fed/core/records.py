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


#: responses per group a record may hold
MAX_GROUP_N = 4096
#: A mean per-token log-prob below this is not something sampling produces: the mean
#: log-prob of tokens sampled from a distribution over V tokens is -entropy >= -log V,
#: about -12.5 for V = 256k. A claim below it (e.g. -1e6, which would make the receiver's
#: compatibility score s = exp(lbar_R - lbar_S) admit anything) is refused.
MIN_MEAN_LOGPROB = -30.0


def max_abs_advantage(n: int) -> float:
    """The largest |advantage| Eq. 1 gives a binary-reward group of n, with sample or
    population std or without scaling: about sqrt(n), reached by the one success among n
    ((1 - 1/n) / sqrt(1/n) for the sample std). Anything larger is not an advantage of a
    binary-reward group (1e300, say, which is inf in float32)."""
    return math.sqrt(max(n, 1)) * (1 + 1e-3) + 1e-6


def _int(x: Any) -> int:
    """An integer field: a JSON integer (or an integral float), never a bool or a string of digits."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected an integer, got {type(x).__name__}")
    if isinstance(x, float) and not (math.isfinite(x) and x.is_integer()):
        raise ValueError(f"expected an integer, got {x!r}")
    out = int(x)
    if not -(2**63) <= out < 2**63:
        raise ValueError("integer out of the signed 64-bit range")
    return out


def _text(x: Any) -> str:
    """A string field: a str that is valid Unicode (a lone surrogate, which JSON's \\ud800 escape
    can carry, would make the receiver's tokenizer or verifier raise later)."""
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    x.encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
    return x


def _float(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {type(x).__name__}")
    return float(x)


def _list(x: Any, what: str) -> list:
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{what} must be a list, got {type(x).__name__}")
    if len(x) > MAX_GROUP_N:
        raise ValueError(f"{what} has {len(x)} entries; at most {MAX_GROUP_N}")
    return list(x)


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
            rec = cls(prompt_id=_text(d["prompt_id"]), step=_int(d["step"]), model_id=_text(d["model_id"]),
                      tokenizer_id=_text(d.get("tokenizer_id", "")), problem=_text(d["problem"]),
                      answer=_text(d["answer"]), rewards=tuple(_float(x) for x in _list(d["rewards"], "rewards")),
                      advantages=tuple(_float(x) for x in _list(d["advantages"], "advantages")),
                      texts=tuple(_text(x) for x in _list(d["texts"], "texts")),
                      finish_reasons=tuple(_text(x) for x in _list(d["finish_reasons"], "finish_reasons")),
                      lengths=tuple(_int(x) for x in _list(d["lengths"], "lengths")),
                      mean_logprobs=tuple(_float(x) for x in _list(d["mean_logprobs"], "mean_logprobs")),
                      run_id=_text(d.get("run_id", "")), meta=dict(d.get("meta") or {}))
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise RecordError(f"malformed group record: {type(exc).__name__}: {str(exc)[:200]}") from None
        rec.validate()
        return rec

    def validate(self) -> None:
        """Structural checks a receiver runs before anything else (it re-verifies rewards later)."""
        n = self.n
        if n < 1:
            raise RecordError(f"group {self.prompt_id[:64]}: no responses")
        for name in ("advantages", "texts", "finish_reasons", "lengths", "mean_logprobs"):
            if len(getattr(self, name)) != n:
                raise RecordError(f"group {self.prompt_id[:64]}: {name} has {len(getattr(self, name))} entries, "
                                  f"rewards has {n}")
        if any(r not in (0.0, 1.0) for r in self.rewards):
            raise RecordError(f"group {self.prompt_id[:64]}: rewards must be binary 0/1")
        if n > MAX_GROUP_N:
            raise RecordError(f"group {self.prompt_id[:40]}: {n} responses; at most {MAX_GROUP_N}")
        for name in ("advantages", "mean_logprobs"):
            if not all(math.isfinite(x) for x in getattr(self, name)):
                raise RecordError(f"group {self.prompt_id[:64]}: {name} must be finite")
        if any(lp > 1e-6 for lp in self.mean_logprobs):
            raise RecordError(f"group {self.prompt_id[:64]}: a mean log-prob is positive (log-probs are <= 0)")
        if any(lp < MIN_MEAN_LOGPROB for lp in self.mean_logprobs):
            raise RecordError(f"group {self.prompt_id[:64]}: a mean log-prob is below {MIN_MEAN_LOGPROB} (a mean "
                              "per-token log-prob that sampling does not produce)")
        bound = max_abs_advantage(n)
        if any(abs(a) > bound for a in self.advantages):
            raise RecordError(f"group {self.prompt_id[:64]}: an advantage exceeds {bound:.3f} in magnitude, more than "
                              f"Eq. 1 gives any binary-reward group of {n}")
        if any(f not in ("stop", "length") for f in self.finish_reasons):
            raise RecordError(f"group {self.prompt_id[:64]}: finish_reasons must be 'stop' or 'length'")
        if any(length < 1 for length in self.lengths):
            raise RecordError(f"group {self.prompt_id[:64]}: every response has at least one token")
        # Advantages must agree in sign with the rewards they claim: successes above the
        # group mean, failures below (zero-variance groups: all zero).
        if 0 < self.k < n:
            for r, a in zip(self.rewards, self.advantages):
                if (r > 0.5 and a <= 0) or (r < 0.5 and a >= 0):
                    raise RecordError(f"group {self.prompt_id[:64]}: advantage {a:+.3f} contradicts reward {r:g}")
        elif any(a != 0.0 for a in self.advantages):
            raise RecordError(f"group {self.prompt_id[:64]}: a zero-variance group must have zero advantages")


def records_by_prompt(records: Sequence[GroupRecord]) -> dict[str, GroupRecord]:
    return {r.prompt_id: r for r in records}
