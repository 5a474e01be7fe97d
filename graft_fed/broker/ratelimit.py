"""Publishes per node per second: a token bucket per node (bursts of 4 x the rate)."""

from __future__ import annotations

import threading
import time

from graft_fed.federation.errors import ResourceExhausted
from graft_fed.federation.limits import clip


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
