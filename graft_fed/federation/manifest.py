"""The federation manifest: what every node must hold in common with the broker."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Sequence

from graft_fed.data.prompts import Prompt
from graft_fed.rewards.config import MATH_VERIFY, VerifierConfig


def clip(value: object, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n + 2 else f"{text[:n]}... ({len(str(value))} chars)"

PROTOCOL_VERSION = 1

# Fields a joining node must match exactly; the others (mode, staleness, federation id)
# are the broker's to decide and the node adopts them.
CHECKED_FIELDS = ("protocol_version", "dataset_id", "dataset_hash", "seed", "n", "prompts_per_round",
                  "verifier_name", "verifier_version", "advantage")


@dataclass(frozen=True)
class Manifest:
    federation_id: str
    protocol_version: int
    dataset_id: str
    dataset_hash: str
    seed: int
    n: int
    prompts_per_round: int
    mode: str  # sync | async
    verifier_name: str
    verifier_version: str
    staleness_rounds: int
    advantage: str  # core.advantages.advantage_id: how every node normalises its group advantages

    def to_dict(self) -> dict:
        return asdict(self)


def dataset_hash(prompts: Sequence[Prompt]) -> str:
    """sha256 over the sorted stable prompt ids: equal iff both sides hold the same problems."""
    h = hashlib.sha256()
    for pid in sorted(p.id for p in prompts):
        h.update(pid.encode())
        h.update(b"\n")
    return h.hexdigest()


def verifier_version(cfg: VerifierConfig) -> str:
    if cfg.name == MATH_VERIFY:
        return f"math-verify {metadata.version('math-verify')}"
    return f"plugin {cfg.name}"


def differences(expected: Manifest, got: Manifest) -> list[str]:
    """Human-readable list of checked fields that differ: 'field: broker X, node Y'."""
    out = []
    for name in CHECKED_FIELDS:
        a, b = getattr(expected, name), getattr(got, name)
        if a != b:  # the node's value quoted by a prefix only: it may be anything a client sent
            out.append(f"{name}: broker has {a!r}, node has {clip(b)}" + _HINTS.get(name, ""))
    return out


#: what a difference in a field that is only a digest means, and where to look
_HINTS = {"dataset_hash": " (the digest of the sorted prompt ids: the two sides loaded different problems. Give "
                          "the node the broker's data settings: data.source, split, families, per_family, "
                          "max_prompts, problem_field and answer_field, and the same file)"}
