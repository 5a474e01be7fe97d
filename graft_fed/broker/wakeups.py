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

A waiter need not be a thread: `Wake.when_set` runs a callback at the wake-up instead, which
is how a long-poll handed over by the front (`front_process`) waits without holding one of
the broker's threads (`Parked` below, broker/front.py).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable


class Wake:
    """One wake-up of a key: waited on by a thread (`wait`), or by a callback (`when_set`)."""

    __slots__ = ("_event", "_lock", "_callbacks")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []  # None once set

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def set(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
            self._event.set()
        for callback in callbacks or ():
            callback()

    def when_set(self, callback: Callable[[], None]) -> None:
        """Run `callback` (without arguments, on the thread that sets this) at the wake-up;
        at once, on this thread, if it has come already."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(callback)
                return
        callback()

    def forget(self, callback: Callable[[], None]) -> None:
        """Drop a callback that is no longer wanted (its waiter gave up first)."""
        with self._lock:
            if self._callbacks is not None and callback in self._callbacks:
                self._callbacks.remove(callback)


class Parked(Exception):
    """Raised instead of waiting, by a long-poll whose caller can wait without a thread
    (`park=True`): call `resume` once `wake` is set or `timeout_s` has passed; it answers,
    or raises Parked again to wait once more. `release` gives up the call's hold on the
    broker (its long-poll slot) when it ends without a resume (cancelled at the client)."""

    def __init__(self, wake: Wake, timeout_s: float) -> None:
        super().__init__("a long-poll parked")
        self.wake, self.timeout_s = wake, timeout_s
        self.resume: Callable[[], Any] = _unset
        self.release: Callable[[], None] = _nothing


def _unset() -> Any:
    raise RuntimeError("a Parked long-poll without its resume")


def _nothing() -> None:
    pass


class Wakeups:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the dict only
        self._events: dict[Hashable, Wake] = {}

    def event(self, key: Hashable) -> Wake:
        """The event the next `wake(key)` sets: take it before checking the condition."""
        with self._lock:
            ev = self._events.get(key)
            if ev is None:
                ev = self._events[key] = Wake()
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
