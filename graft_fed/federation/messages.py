"""The vocabulary broker and node share: what travels between them, as plain data.

The proto codec (graft_fed/federation/codec.py) turns these into the wire messages and
back; the broker's handlers and the node's logic use only these types, so neither imports
the other's internals (nor grpc).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Protocol, Sequence, runtime_checkable


class Privacy(str, enum.Enum):
    """What may leave a node's site (docs/security.md)."""

    #: Every informative group's trajectories go to the broker, for peers now and later.
    SHARE_ALL = "share_all"
    #: Only the groups a receiver was matched to.
    MATCHED_ONLY = "matched_only"
    #: No trajectories ever; the node still receives.
    SUMMARIES_ONLY = "summaries_only"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(p.value for p in cls)


@dataclass
class SummaryRow:
    """What a node publishes about one prompt's group, whatever its privacy: no text."""

    node_id: str
    round: int
    prompt_id: str
    policy_version: int
    n: int
    k: int
    reward_mean: float
    reward_std: float
    lengths: list[int] = field(default_factory=list)  # (n,) response lengths in the producer's tokens
    mean_logprobs: list[float] = field(default_factory=list)  # (n,) mean generation log-prob (Eq. 6)
    bundle_digest: str = ""  # sha256 of the group's bundle once uploaded, "" before


def summarise(node_id: str, round: int, policy_version: int, prompt_id: str, rewards: Sequence[float],
              lengths: Sequence[int], mean_logprobs: Sequence[float]) -> SummaryRow:
    """The summary of a group from its rewards (sample std, as the advantages use)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(1, n - 1))
    return SummaryRow(node_id=node_id, round=round, prompt_id=prompt_id, policy_version=policy_version, n=n,
                      k=sum(1 for r in rewards if r > 0.5), reward_mean=mean, reward_std=std,
                      lengths=list(lengths), mean_logprobs=list(mean_logprobs))


@dataclass(frozen=True)
class Offer:
    """A peer group the broker matched to one of the receiver's all-fail prompts."""

    prompt_id: str
    source_node: str
    source_model: str
    source_round: int
    k: int
    n: int
    digest: str  # "" until the source has uploaded the bundle


@dataclass(frozen=True)
class MatchResult:
    """The broker's answer to "what did I get this round?"."""

    ready: bool
    offers: list[Offer]
    upload_requests: list[tuple[str, int]]  # (prompt id, round) of the caller's own groups
    candidates: int = 0  # the caller's all-fail prompts with an informative peer group
    solved_by_peers: int = 0  # the caller's all-fail prompts some peer solved at least once
    # The broker's answers as the servicer sends them: offers and upload requests already
    # encoded as MatchResponse fields (federation/codec.py), `offers` and
    # `upload_requests` then left empty. None: not encoded (what every other caller sees).
    offers_wire: bytes | None = None
    uploads_wire: bytes | None = None


@dataclass(frozen=True, slots=True)  # slots: a report makes thousands (no __dict__ each for the collector)
class ReportEntry:
    """A receiver's verdict on one group it was offered."""

    source: str
    prompt_id: str
    mean_s: float
    admitted_fraction: float
    rejected: bool
    #: the group never arrived: mean_s and admitted_fraction 0, not rejected
    undelivered: bool = False


class ReportColumns(NamedTuple):
    """A report's entries as columns, the i-th of each column the i-th entry: what the broker
    reads a report into (a thousand `ReportEntry` objects a report, 64 reports a round, were
    a third of the broker's report path: issue 13, docs/performance.md, fifty-fifth pass)."""

    sources: list[str]
    prompt_ids: list[str]
    mean_s: list[float]
    admitted_fraction: list[float]
    rejected: list[bool]
    undelivered: list[bool]

    @classmethod
    def empty(cls) -> "ReportColumns":
        """No entries: six lists of its own, to append to."""
        return cls([], [], [], [], [], [])

    @classmethod
    def of(cls, entries: Iterable[ReportEntry]) -> "ReportColumns":
        cols = cls.empty()
        for e in entries:
            for col, value in zip(cols, (e.source, e.prompt_id, e.mean_s, e.admitted_fraction, e.rejected,
                                         e.undelivered)):
                col.append(value)
        return cols


@runtime_checkable
class ReportReader(Protocol):
    """A report's entries read only when asked (the codec's, from the wire): `columns(limit)`
    gives the first `limit + 1` at most, as columns."""

    def columns(self, limit: int) -> ReportColumns: ...


def undelivered_but_scored(mean_s: float, admitted_fraction: float, rejected: bool, undelivered: bool) -> bool:
    """A verdict that is not one: a group reported undelivered has mean_s and
    admitted_fraction 0 and is not rejected (the broker refuses it, and so does a state)."""
    return bool(undelivered and (rejected or mean_s != 0 or admitted_fraction != 0))

