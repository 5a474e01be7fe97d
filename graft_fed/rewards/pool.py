"""A process pool whose workers can be killed: the parent enforces a wall-clock limit per item.

Why not concurrent.futures / multiprocessing.Pool: a worker stuck in sympy cannot be
interrupted from outside except by killing it, and those pools either cannot kill one
worker or break entirely when one dies. math-verify's own timeouts use signal.alarm,
which only works on a main thread and does not stop every hang.

Protocol (one duplex pipe per worker): the worker imports the item function and sends
("ready",) or ("fatal", message); the parent sends a chunk [(index, args), ...]; the
worker answers each item as soon as it is done with (index, value, status). So the parent
always knows which item a worker is on: the first unanswered one of its chunk, started
when the previous answer (or the chunk) arrived. Past the deadline that item scores 0 as
a timeout, the worker is killed and replaced, and the rest of its chunk is re-queued. A
worker that dies (os._exit, segfault, OOM kill) costs the same way: its current item is
an error.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import types
from collections import deque
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

OK, TIMEOUT, ERROR = "ok", "timeout", "error"
_STARTUP_TIMEOUT_S = 120.0
_MAX_STARTUP_FAILURES = 3
_MAIN_SWAP_LOCK = threading.Lock()


@contextmanager
def _without_parent_main() -> Any:
    """Start children without re-running the parent's __main__.

    spawn/forkserver children normally re-import the parent's main script: that imports
    torch (and whatever else the trainer script does) into every verifier worker, and
    fails outright for stdin or interactive sessions. Workers need nothing from it, so
    the child is started while __main__ is an empty module.
    """
    with _MAIN_SWAP_LOCK:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def resolve_function(spec: str) -> Callable[..., Any]:
    """Import "package.module:attr[.attr]" and return the object it names."""
    module_name, _, attr_path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


def check_reward(value: Any) -> float:
    """`value` as a float reward; ValueError unless it is a finite number in [0, 1]."""
    if isinstance(value, bool):
        return float(value)
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"reward must be a number, got {type(value).__name__}") from None
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        raise ValueError(f"reward must be a finite number in [0, 1], got {reward!r}")
    return reward


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when its parent dies, so a hung worker never outlives us."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _worker_main(conn: Connection, target: str) -> None:
    # Ctrl-C, and a SIGTERM sent to the group (`tini -g` in the node image), reach every
    # process; only the parent reacts (it stops the pool; a dead parent takes workers along).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    try:
        fn = resolve_function(target)
    except Exception as exc:  # reported to the parent, which owns the error policy
        conn.send(("fatal", f"cannot import {target!r} in a worker process: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, args in chunk:
            try:
                value, status = check_reward(fn(*args)), OK
            except Exception as exc:
                log.debug("item %d failed: %s: %s", index, type(exc).__name__, exc)
                value, status = 0.0, ERROR
            conn.send((index, value, status))


class _Worker:
    def __init__(self, ctx: Any, target: str) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child_conn, target), daemon=True,
                                name="graft-fed-verifier")
        with _without_parent_main():
            self.proc.start()
        child_conn.close()
        self.ready = False
        self.spawned_at = time.monotonic()
        self.inflight: deque[int] = deque()
        self.item_started = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=1)
        self.kill()


class KillablePool:
    """Runs `target(*args)` for many items in worker processes, each item under a wall-clock limit.

    `target` is "module:function" (imported in each worker) returning a reward in [0, 1].
    `run` never raises for a per-item problem: it returns (value, status) per item with
    status "ok", "timeout" or "error".
    """

    def __init__(self, target: str, workers: int, timeout_s: float, chunk_size: int,
                 start_method: str = "forkserver") -> None:
        self.target = target
        self.n_workers = workers
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if the forkserver is not running yet; then replacements
            # of killed workers fork from a process that has already imported the target.
            self._ctx.set_forkserver_preload([target.partition(":")[0]])
        self._workers: list[_Worker] = []
        self._fatal: str | None = None
        self._startup_failures = 0
        self.restarts = 0

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.target)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._spawn()
        self.restarts += 1

    def run(self, items: Sequence[tuple[Any, ...]]) -> list[tuple[float, str]]:
        results: list[tuple[float, str] | None] = [None] * len(items)
        if not items:
            return []
        if self._fatal is not None:
            return [(0.0, ERROR)] * len(items)
        while len(self._workers) < self.n_workers:
            self._workers.append(self._spawn())
        pending: deque[int] = deque(range(len(items)))
        remaining = len(items)

        def settle(index: int, value: float, status: str) -> None:
            nonlocal remaining
            if results[index] is None:
                remaining -= 1
            results[index] = (value, status)

        def requeue(worker: _Worker) -> None:
            pending.extendleft(reversed(worker.inflight))
            worker.inflight.clear()

        while remaining:
            now = time.monotonic()
            for worker in list(self._workers):
                # A dead worker is dealt with once, below, after its last answers are read:
                # checking here too would replace it before those answers and its chunk
                # were accounted for (that lost items, and the pool then waited forever).
                if worker.ready and not worker.inflight and pending and worker.proc.is_alive():
                    size = min(self.chunk_size, max(1, math.ceil(len(pending) / self.n_workers)))
                    chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                    worker.inflight.extend(chunk)
                    worker.item_started = now
                    try:
                        worker.conn.send([(i, items[i]) for i in chunk])
                    except (OSError, ValueError):
                        requeue(worker)  # died while idle: nothing of ours was on it
                        self._replace(worker)

            if not pending and not any(w.inflight for w in self._workers):
                # Every unsettled item is either queued or on a worker; anything else is a
                # bug. Say so and score what is left rather than wait for answers that
                # cannot come.
                log.error("verifier pool lost track of %d item(s); they score 0 as errors", remaining)
                for i, r in enumerate(results):
                    if r is None:
                        settle(i, 0.0, ERROR)
                break
            deadlines = [w.item_started + self.timeout_s if w.ready else w.spawned_at + _STARTUP_TIMEOUT_S
                         for w in self._workers if w.inflight or not w.ready]
            waitables: list[Any] = []
            for w in self._workers:
                waitables += [w.conn, w.proc.sentinel]
            # Never an unbounded wait: with nothing on a clock (a dead idle worker, whose
            # sentinel wakes us anyway) the loop looks again within a second.
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
            wait(waitables, timeout=timeout)

            for worker in list(self._workers):
                # Whether it was alive is asked before its answers are read: everything it
                # sent before dying is then read below, and an item it answered is never the
                # one scored as its crash. A worker that dies after this look is seen dead on
                # the next pass (its sentinel ends the wait at once).
                dead = not worker.proc.is_alive()
                try:
                    while worker.conn.poll():
                        msg = worker.conn.recv()
                        if msg[0] == "ready":
                            worker.ready = True
                            self._startup_failures = 0
                        elif msg[0] == "fatal":
                            self._fatal = msg[1]
                        else:
                            index, value, status = msg
                            if worker.inflight and worker.inflight[0] == index:
                                worker.inflight.popleft()
                                settle(index, value, status)
                            worker.item_started = time.monotonic()
                except (EOFError, OSError):
                    dead = True
                now = time.monotonic()
                start_timed_out = not worker.ready and now - worker.spawned_at > _STARTUP_TIMEOUT_S
                if (dead or start_timed_out) and not worker.ready and self._fatal is None:
                    self._startup_failures += 1
                    if self._startup_failures >= _MAX_STARTUP_FAILURES:
                        last = (f"exit code {worker.proc.exitcode}" if dead
                                else f"no answer within {_STARTUP_TIMEOUT_S:.0f} s")
                        self._fatal = (f"{self._startup_failures} verifier workers in a row failed to "
                                       f"start (last: {last})")
                if self._fatal is not None:
                    log.error("verifier pool disabled, every item scores 0 as an error: %s", self._fatal)
                    for i, r in enumerate(results):
                        if r is None:
                            settle(i, 0.0, ERROR)
                    self.close()
                    return [r for r in results if r is not None]
                if dead:
                    if worker.inflight:
                        crashed = worker.inflight.popleft()
                        log.warning("verifier worker died (exit code %s) on item %d; scored 0 as an error",
                                    worker.proc.exitcode, crashed)
                        settle(crashed, 0.0, ERROR)
                    requeue(worker)
                    self._replace(worker)
                elif start_timed_out:
                    log.error("verifier worker did not start within %.0f s; replacing it", _STARTUP_TIMEOUT_S)
                    self._replace(worker)
                elif worker.inflight and now - worker.item_started > self.timeout_s:
                    hung = worker.inflight.popleft()
                    log.warning("verification of item %d exceeded %.1f s; worker killed, item scored 0",
                                hung, self.timeout_s)
                    settle(hung, 0.0, TIMEOUT)
                    requeue(worker)
                    self._replace(worker)
        return [r for r in results if r is not None]

    def close(self) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()
