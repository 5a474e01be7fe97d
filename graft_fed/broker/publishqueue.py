"""The publish queue: one thread runs the waiting publishes' work back to back, in batches.

Publishes used to run in the gRPC worker threads that received them: at 64 nodes x 4,096
prompts, 64 threads decoding, checking and encoding at once took the interpreter from one
another at every NumPy operation, every SQLite call and every file write (about 128 context
switches per publish, against 11 for a raw gRPC call; the broker left 0.6 of its 2 cores
idle while ingest stalled: issue 13, twenty-fourth pass). Here the receiving thread queues
its publish and sleeps; one thread takes every publish waiting, runs each one's work (the
caller's `run` on the batch: for publishes, decode, check, then one group commit for the
whole batch) and wakes each caller with its own result or error. The batch grows with the
load: what arrives during one batch's commit forms the next.

A batch holds at most one item per key (a node: its published count is read and written
per publish); a node's second publish waits for the next batch, in order.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from typing import Any, Callable, Hashable, Sequence

from graft_fed.federation.errors import Unavailable

MAX_BATCH = 256


def _own_copy(exc: BaseException) -> BaseException:
    """A new exception of the same type and arguments, caused by `exc` (`exc` itself when
    its type cannot be rebuilt from its arguments)."""
    try:
        dup = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception type that does not copy: share it
        return exc
    if dup is exc or type(dup) is not type(exc):
        return exc
    dup.__cause__, dup.__traceback__ = exc, None
    return dup


class _Pending:
    __slots__ = ("key", "work", "done", "result", "error", "since")

    def __init__(self, key: Hashable, work: Any) -> None:
        self.key, self.work = key, work
        self.since = time.perf_counter()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class PublishQueue:
    """`submit(key, work)` waits until `run` has taken `work` in a batch and returns its
    result (or raises its error). `run(works)` returns one result or exception per work, in
    order; if it raises, every work of its batch fails with that error."""

    def __init__(self, run: Callable[[list[Any]], Sequence[Any]], name: str = "broker-publish",
                 max_batch: int = MAX_BATCH) -> None:
        self._run = run
        self.name = name
        self.max_batch = max(1, max_batch)
        self._items: collections.deque[_Pending] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.batches = 0  # batches run (for benches and tests)
        self.items = 0  # works run
        self.busy_s = 0.0  # seconds spent running batches (over the wall time: how busy its thread is)
        self.waited_s = 0.0  # seconds the works waited to be taken, summed (over `items`: the mean wait)

    def waiting(self) -> int:
        """Works submitted and not yet taken into a batch, for /metrics."""
        with self._cv:
            return len(self._items)

    def submit(self, key: Hashable, work: Any) -> Any:
        item = _Pending(key, work)
        with self._cv:
            if self._stopping:
                raise Unavailable("the broker is stopping; retry against its successor")
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()
        item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def stop(self, timeout: float | None = None) -> None:
        """Run what is queued, then end the thread; later submits are refused (UNAVAILABLE)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _take(self) -> list[_Pending] | None:
        with self._cv:
            while not self._items:
                if self._stopping:
                    return None
                self._cv.wait()
            batch: list[_Pending] = []
            keys: set[Hashable] = set()
            later: list[_Pending] = []
            while self._items and len(batch) < self.max_batch:
                item = self._items.popleft()
                if item.key in keys:
                    later.append(item)  # the key's earlier work first, in this batch
                else:
                    keys.add(item.key)
                    batch.append(item)
            self._items.extendleft(reversed(later))
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            began = time.perf_counter()
            try:
                results = list(self._run([item.work for item in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"the publish queue's run returned {len(results)} results for {len(batch)} "
                                       "works")
            except BaseException as exc:  # noqa: BLE001 - the thread must outlive a failed batch
                results = [exc] * len(batch)
            self.busy_s += time.perf_counter() - began
            self.waited_s += sum(began - item.since for item in batch)
            self.batches += 1
            self.items += len(batch)
            given: set[int] = set()
            for item, res in zip(batch, results):
                if isinstance(res, BaseException):
                    # one error for several callers (a failed run or commit): each raises its
                    # own copy, so that their threads' tracebacks do not pile up on one object
                    item.error = res if id(res) not in given else _own_copy(res)
                    given.add(id(res))
                else:
                    item.result = res
                item.done.set()
