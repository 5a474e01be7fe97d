"""Which receivers may fetch which bundles: what GetMatches offered them.

A bundle digest maps to the receivers it was offered to, most recently granted last,
bounded to `limit` digests (a receiver whose old grant was evicted gets it back by asking
for its matches again). One lock, held for dict operations only."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

MAX_GRANTS = 200_000  # bundle digests whose fetch permissions are remembered


class Grants:
    def __init__(self, limit: int = MAX_GRANTS) -> None:
        self.limit = limit
        self._granted: OrderedDict[str, set[str]] = OrderedDict()
        self._lock = threading.Lock()

    def grant(self, receiver: str, digests: Iterable[str]) -> None:
        with self._lock:
            for digest in digests:
                self._granted.setdefault(digest, set()).add(receiver)
                self._granted.move_to_end(digest)
            while len(self._granted) > self.limit:
                self._granted.popitem(last=False)

    def allowed(self, receiver: str, digest: str) -> bool:
        with self._lock:
            return receiver in self._granted.get(digest, ())

    def __len__(self) -> int:
        with self._lock:
            return len(self._granted)
