"""The broker's worker pool (broker/workers.py): all threads started at once, the thread that
went idle last serving next, waiting calls served in order of arrival, ThreadPoolExecutor's
contract for futures and shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.workers import Workers


def _named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix + "_")]


def _occupy_all(pool: Workers, order: list[int]) -> None:
    """Run one call on every thread at once, each ending (and going idle) in turn, recording
    the threads in the order they went idle."""
    started = threading.Barrier(pool.size + 1)
    turns = [threading.Event() for _ in range(pool.size)]
    lock = threading.Lock()

    def hold(i: int) -> None:
        started.wait(5)
        turns[i].wait(5)
        with lock:
            order.append(threading.get_ident())

    done = [pool.submit(hold, i) for i in range(pool.size)]
    started.wait(5)
    for i, f in enumerate(done):
        turns[i].set()
        f.result(5)
        deadline = time.monotonic() + 10  # the thread is back on the idle stack before the next one ends
        while pool.load()[0] > pool.size - (i + 1) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool.load()[0] == pool.size - (i + 1)


def test_every_thread_is_started_when_the_pool_is_made_and_ended_by_shutdown() -> None:
    pool = Workers(6, "wk-start")
    try:
        assert len(_named("wk-start")) == 6
        for _ in range(20):
            pool.submit(time.sleep, 0).result(5)
        assert len(_named("wk-start")) == 6  # no thread added or lost
    finally:
        pool.shutdown(wait=True)
    assert _named("wk-start") == []


def test_the_thread_that_went_idle_last_serves_the_next_call() -> None:
    # ThreadPoolExecutor's idle threads take calls in turn (the longest idle first), so every
    # thread of a large pool touches memory; here one call at a time stays on one thread
    pool = Workers(4, "wk-lifo")
    try:
        went_idle: list[int] = []
        _occupy_all(pool, went_idle)
        assert len(set(went_idle)) == 4
        served = [pool.submit(threading.get_ident).result(5) for _ in range(12)]
        assert set(served) == {went_idle[-1]}
    finally:
        pool.shutdown()


def test_calls_that_find_no_idle_thread_wait_in_order_of_arrival() -> None:
    pool = Workers(1, "wk-fifo")
    try:
        gate = threading.Event()
        blocker = pool.submit(gate.wait, 5)
        order: list[int] = []
        waiting = [pool.submit(order.append, i) for i in range(5)]
        gate.set()
        assert blocker.result(5) is True
        for f in waiting:
            f.result(5)
        assert order == [0, 1, 2, 3, 4]
    finally:
        pool.shutdown()


def test_results_and_exceptions_reach_the_future() -> None:
    pool = Workers(2, "wk-fut")
    try:
        assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(5) == 5
        f = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            f.result(5)
        assert pool.submit(threading.current_thread).result(5).name.startswith("wk-fut_")  # the pool survives
    finally:
        pool.shutdown()


def test_a_cancelled_waiting_call_never_runs() -> None:
    pool = Workers(1, "wk-cancel")
    try:
        gate = threading.Event()
        pool.submit(gate.wait, 5)
        ran: list[int] = []
        queued = pool.submit(ran.append, 1)
        assert queued.cancel()
        after = pool.submit(ran.append, 2)
        gate.set()
        after.result(5)
        assert ran == [2] and queued.cancelled()
    finally:
        pool.shutdown()


def test_shutdown_cancels_waiting_calls_when_asked_and_refuses_new_ones() -> None:
    pool = Workers(1, "wk-stop")
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    queued = pool.submit(time.sleep, 0)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(time.sleep, 0)
    gate.set()
    assert running.result(5) is True  # what was running finishes
    pool.shutdown(wait=True)
    assert _named("wk-stop") == []


def test_shutdown_without_cancelling_runs_what_waits() -> None:
    pool = Workers(1, "wk-drain")
    gate = threading.Event()
    pool.submit(gate.wait, 5)
    ran: list[int] = []
    queued = [pool.submit(ran.append, i) for i in range(3)]
    pool.shutdown(wait=False)
    gate.set()
    for f in queued:
        f.result(5)
    pool.shutdown(wait=True)
    assert ran == [0, 1, 2]


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        Workers(0)


def test_a_stopped_broker_leaves_none_of_its_threads(tmp_path) -> None:
    from tests.federation.helpers import start_broker

    before = set(threading.enumerate())  # the threads themselves: an ended thread's ident may come back
    broker = start_broker(BrokerConfig(listen="127.0.0.1:0", db=str(tmp_path / "b.db"), insecure=True,
                                       max_workers=16, max_long_polls=8))
    workers = [t for t in threading.enumerate() if t not in before and t.name.startswith("broker_")]
    assert len(workers) == 16  # all started with the broker
    broker.stop(0)
    for t in workers:
        t.join(5)
    assert not any(t.is_alive() for t in workers)


def test_metrics_say_how_far_behind_the_broker_is(prompt_file):
    """/metrics: worker threads running a call and calls waiting for one, per pool, and the
    publishes waiting for the publish queue: an operator's sign that the broker is behind."""
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.server import render_metrics
    from graft_fed.broker.servicer import BrokerServicer
    from graft_fed.broker.state_memory import InMemoryState
    from tests.federation.helpers import broker_config

    fed = Federation(broker_config(prompt_file), InMemoryState())
    servicer = BrokerServicer(fed)
    pool = Workers(2, "gauge")
    release, started = threading.Event(), threading.Semaphore(0)

    def held(works: list) -> list:  # the publish queue's batch (stand-in works), held until released
        started.release()
        release.wait(10)
        return [(0, 0)] * len(works)

    fed.publishing.queue._run = held

    def values() -> dict[str, float]:
        text = render_metrics(fed, servicer, pools=[pool])
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("graft_fed_worker_threads_busy", "graft_fed_calls_waiting",
                                    "graft_fed_publish_queue_waiting"))}
    calls: list = []
    try:
        assert values() == {'graft_fed_worker_threads_busy{pool="gauge"}': 0,
                            'graft_fed_calls_waiting{pool="gauge"}': 0, "graft_fed_publish_queue_waiting": 0}
        # three publishes: the first taken into a batch and held, the other two waiting for it;
        # five calls on two threads: two running, three waiting
        publishers = [threading.Thread(target=lambda k=k: fed.publishing.queue.submit(k, []), daemon=True)
                      for k in ("a", "b", "c")]
        publishers[0].start()
        assert started.acquire(timeout=5)
        for t in publishers[1:]:
            t.start()
        calls += [pool.submit(release.wait, 10) for _ in range(5)]
        deadline = time.monotonic() + 5
        while values()["graft_fed_publish_queue_waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert values() == {'graft_fed_worker_threads_busy{pool="gauge"}': 2,
                            'graft_fed_calls_waiting{pool="gauge"}': 3, "graft_fed_publish_queue_waiting": 2}
    finally:
        release.set()
        for f in calls:
            f.result(10)
        pool.shutdown()
        fed.publishing.queue.stop(10)
