"""What the broker's parts share (broker/handlers.py builds it once and hands it to each
part): the settings, the durable state, the clock and the in-memory structures every part
reads. The parts never reach back into the facade; what one part needs of another it is
given explicitly."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from graft_fed.broker.auth import Allowlist
from graft_fed.broker.compat import CompatTable
from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.grants import Grants
from graft_fed.broker.registry import Registry
from graft_fed.broker.roundindex import RoundIndex
from graft_fed.broker.rounds import Rounds
from graft_fed.broker.state import BrokerState
from graft_fed.broker.wakeups import Wakeups
from graft_fed.data.prompts import Prompt
from graft_fed.federation.manifest import Manifest
from graft_fed.federation.messages import SummaryRow


@dataclass(frozen=True)
class Context:
    cfg: BrokerConfig
    state: BrokerState
    clock: Callable[[], float]
    allowlist: Allowlist | None
    manifest: Manifest
    known_prompts: set[str]
    prompts_by_id: dict[str, Prompt]
    cond: threading.Condition  # the broker's lock
    wakeups: Wakeups  # what long-polls wait on (never the lock above)
    counters: Counter[str]
    grants: Grants  # bundle digest -> receivers allowed to fetch it
    index: RoundIndex  # k per node and prompt of the recent rounds, and who published
    registry: Registry  # node rows in memory (sessions, liveness), written through
    work: threading.BoundedSemaphore  # the slots heavy calls take
    rounds: Rounds  # round rows and readiness
    compat: CompatTable  # the compatibility counts per (source, receiver), as the state holds them

    def quarantined(self) -> set[str]:
        """Sources whose groups receivers rejected too often (re-verification disagreed with
        their claimed rewards). A source is quarantined when (1) at least
        `quarantine_min_reports` of its groups were reported on, (2) at least
        `quarantine_min_receivers` distinct receivers each rejected at least
        `quarantine_rejection_rate` of the groups they reported on, and (3) the mean of the
        receivers' rejection rates, each receiver weighing the same however many groups it
        reported, reaches `quarantine_rejection_rate`. So one receiver, however many of a
        source's groups it was given, cannot quarantine it alone. Derived from the durable
        compatibility counts, so it survives a restart; the operator's `trusted` list
        exempts a node."""
        return self.compat.quarantined(self.cfg.quarantine_rejection_rate, self.cfg.quarantine_min_reports,
                                       self.cfg.quarantine_min_receivers,
                                       trusted=self.allowlist.is_trusted if self.allowlist is not None
                                       else lambda _: False)

    def summary(self, node: str, round: int, prompt_id: str) -> SummaryRow | None:
        rows = self.state.summaries(round=round, node_id=node, prompt_ids=[prompt_id])
        return rows[0] if rows else None


class Part:
    """A part of the broker's logic: the shared context, and its fields bound by name."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.cfg, self.state, self.clock = ctx.cfg, ctx.state, ctx.clock
        self.manifest, self.known_prompts, self.prompts_by_id = ctx.manifest, ctx.known_prompts, ctx.prompts_by_id
        self.cond, self.wakeups, self.counters, self.work = ctx.cond, ctx.wakeups, ctx.counters, ctx.work
        self.grants, self.index, self.registry, self.rounds = ctx.grants, ctx.index, ctx.registry, ctx.rounds
