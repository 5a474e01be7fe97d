"""Which receivers may fetch which bundles: what GetMatches offered them.

A bundle digest maps to the receivers it was offered to, most recently granted last. One
informative group is offered to every receiver that failed its prompt (at 256 nodes about
60 of them), so what grows is the (digest, receiver) entries, not the digests: bounded by
digests alone (200,000) they would reach some 12 million entries, hundreds of MiB, over a
long run with uploads (`bench/broker/memory.py`: 254,000 entries after 300 rounds of 256 x
256, every one kept, glibc's bytes in use rising with them; issue 13, docs/performance.md,
"forty-fifth pass"). So the oldest digests go once there are more than `max_entries`
entries or `limit` digests; a receiver needs its grant only until it fetches, in the round
it was offered (a receiver whose old grant was evicted gets it back by asking for its
matches again). One lock, held for dict operations only."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

MAX_GRANTS = 200_000  # bundle digests whose fetch permissions are remembered
#: (digest, receiver) entries remembered: a few dozen rounds of grants at 1,000 nodes x 128
#: prompts or 64 x 4,096, about 41 MiB (43 bytes an entry, `s55_grants_micro.txt`)
MAX_GRANT_ENTRIES = 1_000_000


class Grants:
    def __init__(self, limit: int = MAX_GRANTS, max_entries: int = MAX_GRANT_ENTRIES) -> None:
        self.limit = limit
        self.max_entries = max_entries
        self._granted: OrderedDict[str, set[str]] = OrderedDict()
        self._entries = 0
        self._lock = threading.Lock()

    def grant(self, receiver: str, digests: Iterable[str]) -> None:
        with self._lock:
            for digest in digests:
                held = self._granted.get(digest)
                if held is None:
                    held = self._granted[digest] = set()
                else:
                    self._granted.move_to_end(digest)
                if receiver not in held:
                    held.add(receiver)
                    self._entries += 1
            # the digest granted last stays whatever the bounds: it holds at most one
            # entry per node
            while len(self._granted) > 1 and (len(self._granted) > self.limit or self._entries > self.max_entries):
                _, gone = self._granted.popitem(last=False)
                self._entries -= len(gone)

    def allowed(self, receiver: str, digest: str) -> bool:
        with self._lock:
            return receiver in self._granted.get(digest, ())

    def entries(self) -> int:
        """(digest, receiver) entries held."""
        with self._lock:
            return self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._granted)
