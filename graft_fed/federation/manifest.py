"""The federation manifest: what every node must hold in common with the broker."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Sequence

from graft_fed.core.advantages import SCALES, STDS
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


def advantage_id(scale_rewards: str, std: str) -> str:
    """The manifest's `advantage` field: how a node normalises its group advantages (its
    `algorithm.scale_rewards` and `algorithm.std`), as "<scale_rewards>/<std>", e.g.
    "group/sample". A receiver trains on the SOURCE's advantages (docs/algorithm.md step 7),
    so every node of a federation must compute them alike."""
    return f"{scale_rewards}/{std}"


ADVANTAGES = tuple(advantage_id(scale, std) for scale in SCALES for std in STDS)
# The paper's (and the trainer's default); what a Join without the field (a client written
# before it existed) is taken to mean.
PAPER_ADVANTAGE = advantage_id("group", "sample")


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
    advantage: str  # advantage_id(...): how every node normalises its group advantages

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
            out.append(f"{name}: broker has {a!r}, node has {clip(b)}")
    return out
