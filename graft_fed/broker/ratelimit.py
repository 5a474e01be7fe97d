"""Publishes per node per second: a token bucket per node (bursts of 4 x the rate); a
warning when a node nears one of its quotas."""

from __future__ import annotations

import logging
import threading
import time

from graft_fed.federation.errors import ResourceExhausted
from graft_fed.federation.limits import clip

log = logging.getLogger("graft_fed.broker")


class PublishRateLimit:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[str, tuple[float, float]] = {}  # node -> (tokens, last refill)
        self._lock = threading.Lock()

    def check(self, node_id: str) -> None:
        """Take a token for one publish; ResourceExhausted when the node has none left."""
        rate = self.rate
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            tokens, last = self._buckets.get(node_id, (4 * rate, now))
            tokens = min(4 * rate, tokens + (now - last) * rate)
            if tokens < 1:
                raise ResourceExhausted(f"node {clip(node_id)} publishes faster than {rate}/s; slow down and retry")
            self._buckets[node_id] = (tokens - 1, now)


class QuotaWarnings:
    """Logs once when a node's holdings pass `WARN_AT` of a per-node quota, so the operator
    learns before its publishes or uploads are refused; again only after they fell below
    `REARM_AT` (retention freed some) and passed it anew."""

    WARN_AT, REARM_AT = 0.8, 0.7

    def __init__(self, setting: str, refused: str, mib: bool = False) -> None:
        self.setting, self.refused, self.mib = setting, refused, mib
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _amount(self, value: int) -> str:
        return f"{value / 2**20:,.1f} MiB of bundles" if self.mib else f"{value:,} summaries"

    def note(self, node_id: str, held: int, quota: int) -> None:
        """`held`: what the node will hold once what was just admitted (within the quota) is
        stored; at most the quota."""
        if not quota:
            return
        held = min(held, quota)
        if held >= self.WARN_AT * quota:
            with self._lock:
                if node_id in self._warned:
                    return
                self._warned.add(node_id)
            log.warning("node %s reaches %s, %.0f%% of its quota of %s (broker.%s): past it, its %s are refused. "
                        "Retention (broker.keep_rounds) frees them as rounds go by, or raise the quota",
                        clip(node_id), self._amount(held), 100 * held / quota, self._amount(quota), self.setting,
                        self.refused)
        elif node_id in self._warned and held < self.REARM_AT * quota:
            with self._lock:
                self._warned.discard(node_id)
