"""The broker's worker threads: all started at once, and the most recently idle one serves next.

`concurrent.futures.ThreadPoolExecutor`, which the broker used before, starts a thread
whenever a call arrives and none is idle, so the thread count follows the highest concurrency
seen so far and keeps creeping up for minutes (277 -> 314 of 320 over one life of the 256 x
256 load). Its idle threads all wait on one queue, and the one that has waited longest takes
the next call, so every call lands on a different thread in turn. Each thread that frees
memory keeps some of it (glibc's per-thread cache, up to 7 blocks of each small size), and
its stack is as deep as its deepest call so far: with calls spread over 300 threads, the
memory those hold keeps rising long after the load is steady (docs/performance.md, issue 13,
twenty-sixth and thirty-second passes).

`Workers` starts its threads when it is made, so their number is flat from the start, and
hands each call to the thread that went idle last (a stack of idle threads): the threads a
steady load needs stay warm, and the others stay parked, touching nothing. Calls that find no
idle thread wait in order of arrival, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent import futures
from typing import Any, Callable

_Item = tuple[futures.Future, Callable[..., Any], tuple, dict]


class _Worker:
    __slots__ = ("wake", "item")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # released by whoever hands this worker an item (or None: exit)
        self.item: _Item | None = None


class Workers(futures.Executor):
    """A fixed pool of `threads` threads, started now; `submit` runs a call on the thread that
    went idle last, or queues it (first come, first served) when none is idle."""

    def __init__(self, threads: int, name: str = "worker") -> None:
        if threads < 1:
            raise ValueError("a worker pool needs at least one thread")
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # a stack: the last one to go idle is at the end
        self._backlog: deque[_Item] = deque()
        self._shutdown = False
        self._threads = [threading.Thread(target=self._run, args=(_Worker(),), name=f"{name}_{i}")
                         for i in range(threads)]
        # as ThreadPoolExecutor does: at interpreter exit the threads finish what they hold and
        # end, and the interpreter joins them
        threading._register_atexit(self._at_exit)  # type: ignore[attr-defined]
        for t in self._threads:
            t.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def load(self) -> tuple[int, int]:
        """(threads running a call, calls waiting for a thread), for /metrics."""
        with self._lock:
            return len(self._threads) - len(self._idle), len(self._backlog)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        future: futures.Future = futures.Future()
        item = (future, fn, args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            if not self._idle:
                self._backlog.append(item)
                return future
            worker = self._idle.pop()
        worker.item = item
        worker.wake.release()
        return future

    def _run(self, me: _Worker) -> None:
        while True:
            with self._lock:
                if self._backlog:
                    item: _Item | None = self._backlog.popleft()
                elif self._shutdown:
                    return
                else:
                    self._idle.append(me)
                    item = None
            if item is None:
                me.wake.acquire()
                item, me.item = me.item, None
                if item is None:  # shut down
                    return
            future, fn, args, kwargs = item
            del item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                future.set_exception(exc)
                del exc
            else:
                future.set_result(result)
            del future, fn, args, kwargs

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            cancelled = list(self._backlog) if cancel_futures else []
            if cancel_futures:
                self._backlog.clear()
            idle, self._idle = self._idle, []
        for future, *_ in cancelled:
            future.cancel()
        for worker in idle:
            worker.wake.release()  # item None: exit
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()

    def _at_exit(self) -> None:
        self.shutdown(wait=False)
