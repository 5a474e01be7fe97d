"""The publish queue (graft_fed/broker/publishqueue.py): one thread runs the waiting works in
batches, each caller gets its own result or error, a key never twice in one batch, a failed
batch does not end the thread, and a stop runs what is queued then refuses."""

from __future__ import annotations

import threading
import time

import pytest

from graft_fed.broker.publishqueue import PublishQueue
from graft_fed.federation.errors import InvalidArgument, Unavailable


class Recorder:
    """A `run` that records its batches, holds the first one until released, and answers
    each work with work * 10, or raises the work when it is an exception."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.first = threading.Event()
        self.release = threading.Event()

    def __call__(self, works: list) -> list:
        self.batches.append(list(works))
        if len(self.batches) == 1:
            self.first.set()
            assert self.release.wait(10)
        return [w if isinstance(w, BaseException) else w * 10 for w in works]


def submit_all(q: PublishQueue, items: list[tuple[str, object]]) -> tuple[dict, list[threading.Thread]]:
    out: dict = {}

    def one(i: int, key: str, work: object) -> None:
        try:
            out[i] = q.submit(key, work)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i, k, w)) for i, (k, w) in enumerate(items)]
    for t in threads:
        t.start()
    return out, threads


def held(key: str, work: int) -> tuple[Recorder, PublishQueue, dict, list[threading.Thread]]:
    """A queue whose thread is held in its first batch, the one work submitted."""
    run = Recorder()
    q = PublishQueue(run)
    first, threads = submit_all(q, [(key, work)])
    assert run.first.wait(10)
    return run, q, first, threads


def wait_queued(q: PublishQueue, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(q._items) < count:  # noqa: SLF001 - the test waits for its callers to queue
        assert time.monotonic() < deadline, "callers did not queue"
        time.sleep(0.005)


def test_waiting_works_run_as_one_batch_and_each_caller_gets_its_own_answer():
    run, q, first, t0 = held("a", 1)  # the thread is busy with a's first publish: the rest queue
    bad = InvalidArgument("b's publish is malformed")
    rest, threads = submit_all(q, [("b", bad), ("c", 3), ("d", 4)])
    wait_queued(q, 3)
    time.sleep(0.2)  # the three wait at least this long behind the first batch
    run.release.set()
    for t in t0 + threads:
        t.join(10)
    assert first == {0: 10}
    assert rest[0] is bad and rest[1] == 30 and rest[2] == 40  # the error goes to its caller only
    assert [sorted(map(str, b)) for b in run.batches] == [["1"], sorted(map(str, [bad, 3, 4]))]
    assert (q.batches, q.items) == (2, 4)
    # the time its thread ran batches and the works' waits, for /metrics (the first batch was
    # held over 0.2 s; each of the three waited that long, a's work hardly at all)
    assert 0.2 <= q.busy_s < 10 and 0.6 <= q.waited_s < 30
    q.stop()


def test_a_key_is_never_twice_in_a_batch_and_keeps_its_order():
    run, q, first, t0 = held("x", 0)
    out, threads = [], []
    for work in (1, 2, 3):  # one at a time, so that their order in the queue is known
        got, ts = submit_all(q, [("a", work)])
        out.append(got)
        threads += ts
        wait_queued(q, work)
    got, ts = submit_all(q, [("b", 9)])
    threads += ts
    wait_queued(q, 4)
    run.release.set()
    for t in t0 + threads:
        t.join(10)
    assert [o[0] for o in out] == [10, 20, 30] and got == {0: 90}
    assert run.batches[1:] == [[1, 9], [2], [3]]
    q.stop()


def test_a_batch_that_fails_fails_its_callers_and_the_thread_goes_on():
    calls = []

    def run(works: list) -> list:
        calls.append(list(works))
        if len(calls) == 1:
            raise RuntimeError("the disk went away")
        if len(calls) == 2:
            return []  # a run that loses results is a bug, reported to its callers
        return [w + 1 for w in works]

    q = PublishQueue(run)
    with pytest.raises(RuntimeError, match="disk went away"):
        q.submit("a", 1)
    with pytest.raises(RuntimeError, match="returned 0 results for 1"):
        q.submit("a", 1)
    assert q.submit("a", 1) == 2
    q.stop()


def test_callers_failed_by_one_error_each_get_their_own_copy_of_it():
    shared = InvalidArgument("the batch's commit failed")

    def run(works: list) -> list:
        if works == [0]:  # the first batch, held while the others queue
            started.set()
            assert release.wait(10)
            return [0]
        return [shared] * len(works)

    started, release = threading.Event(), threading.Event()
    q = PublishQueue(run)
    first, t0 = submit_all(q, [("x", 0)])
    assert started.wait(10)
    out, threads = submit_all(q, [("a", 1), ("b", 2), ("c", 3)])
    wait_queued(q, 3)
    release.set()
    for t in t0 + threads:
        t.join(10)
    errors = [out[i] for i in range(3)]
    assert all(isinstance(e, InvalidArgument) and str(e) == "the batch's commit failed" for e in errors)
    assert len({id(e) for e in errors}) == 3  # each caller raised its own object
    assert sum(e is shared for e in errors) == 1 and all(e.__cause__ is shared for e in errors if e is not shared)
    q.stop()


def test_stop_runs_what_is_queued_then_refuses():
    run, q, first, t0 = held("a", 1)
    queued, threads = submit_all(q, [("b", 2)])
    wait_queued(q, 1)
    stopper = threading.Thread(target=q.stop)
    stopper.start()
    run.release.set()
    stopper.join(10)
    for t in t0 + threads:
        t.join(10)
    assert first == {0: 10} and queued == {0: 20}
    with pytest.raises(Unavailable, match="stopping"):
        q.submit("c", 3)
    assert q._thread is not None and not q._thread.is_alive()  # noqa: SLF001 - the thread ended
