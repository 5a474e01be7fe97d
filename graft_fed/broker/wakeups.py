"""Where long-polls wait: an event per thing awaited, not the broker's lock.

GetMatches long-polls used to wait on the broker's one condition variable and wake at
least once a second (and at every housekeeping tick) to look again. With a thousand nodes
that is some two thousand times a second that a waiting thread re-takes the lock every
publish, join and upload also takes, and re-checks its round, competing for the one
interpreter with the calls that do the work (issue 13, third pass).

Here a waiter takes the current event of its key *before* it looks at the state, then
waits on that event alone; whoever changes what the key stands for calls `wake(key)`,
which sets the event and retires it (the next waiters get a fresh one). Taking the event
before looking means a change made between the look and the wait is never missed; a
retired event means a woken waiter that finds nothing to do waits again instead of
spinning on an event left set. No lock is shared with the work the waiters wait for.
"""

from __future__ import annotations

import threading
from typing import Hashable


class Wakeups:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the dict only
        self._events: dict[Hashable, threading.Event] = {}

    def event(self, key: Hashable) -> threading.Event:
        """The event the next `wake(key)` sets: take it before checking the condition."""
        with self._lock:
            ev = self._events.get(key)
            if ev is None:
                ev = self._events[key] = threading.Event()
            return ev

    def wake(self, key: Hashable) -> None:
        """Wake everyone waiting on `key` (nothing when nobody is)."""
        with self._lock:
            ev = self._events.pop(key, None)
        if ev is not None:
            ev.set()

    def keys(self) -> list[Hashable]:
        """The keys someone has waited on since their last wake-up."""
        with self._lock:
            return list(self._events)


def bundles_key(mode: str, round: int) -> tuple[str, int | None]:
    """The wake-up key of a wait for bundles of `round` (uploads wake it): the round's own
    in synchronous mode; one for every round in asynchronous mode, where a receiver's
    offers span several rounds."""
    return ("bundles", round if mode == "sync" else None)
