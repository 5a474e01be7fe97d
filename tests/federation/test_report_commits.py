"""Compatibility reports that arrive together share one commit (broker/reports.py): each
caller gets its own (accepted, duplicates), the counts in memory equal the state's, and a
commit that fails fails every report of its batch with the storage's error, storing none."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from graft_fed.federation.errors import InvalidArgument, Unavailable
from graft_fed.federation.limits import MAX_STRING_LEN
from graft_fed.node.client import new_tag
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, summary

RECEIVERS = 6


def _matched(broker, prompts):
    """A source with informative groups for 4 prompts, RECEIVERS receivers that failed them
    all, every receiver offered the source's 4 groups."""
    source = client(broker, prompts, "src")
    receivers = [client(broker, prompts, f"r{i}") for i in range(RECEIVERS)]
    source.publish(0, [summary(p, 1) for p in prompts[:4]])
    for r in receivers:
        r.publish(0, [summary(p, 0) for p in prompts[:4]])
    for r in receivers:
        assert len(r.get_matches(0, 5.0).offers) == 4
    return source, receivers


@pytest.fixture
def matched(prompt_file, prompts):
    """(broker, receivers) after `_matched`; the clients closed and the broker stopped after."""
    broker = start_broker(broker_config(prompt_file, balance="none", min_nodes=RECEIVERS + 1))
    clients = []
    try:
        source, receivers = _matched(broker, prompts)
        clients = [source, *receivers]
        yield broker, receivers
    finally:
        for x in clients:
            x.close()
        broker.stop()


def _entries(prompts, rejected=False):
    return [pb.CompatibilityReport.Entry(source_node_id="src", prompt_id=p.id, mean_s=0.5 + i / 10,
                                         admitted_fraction=0.25 * i, rejected=rejected)
            for i, p in enumerate(prompts[:4])]


def _report_all(receivers, prompts, answers: dict) -> None:
    def one(r):
        try:
            answers[r.node_id] = r.stub.ReportCompatibility(pb.CompatibilityReport(
                node_id=r.node_id, session_id=r.session, round=0, entries=_entries(prompts), tag=new_tag()), timeout=30)
        except grpc.RpcError as exc:
            answers[r.node_id] = exc.code()
    threads = [threading.Thread(target=one, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_reports_that_arrive_together_share_a_commit(matched, prompts):
    broker, receivers = matched
    state = broker.fed.state
    real = state.put_report_batches
    sizes = []

    def slow(batches):  # the first commit takes a while: the other reports queue behind it
        sizes.append(len(batches))
        time.sleep(0.5 if len(sizes) == 1 else 0)
        return real(batches)
    state.put_report_batches = slow
    answers: dict = {}
    _report_all(receivers, prompts, answers)
    assert all(a.accepted == 4 and a.duplicates == 0 for a in answers.values()), answers
    assert sum(sizes) == RECEIVERS and len(sizes) < RECEIVERS, sizes  # some shared a commit
    counters = broker.fed.counters
    assert counters["report_calls"] == RECEIVERS and counters["report_commits"] == len(sizes)
    assert counters["reports"] == 4 * RECEIVERS
    assert broker.fed.compat() == state.compat() and len(state.compat()) == RECEIVERS
    again: dict = {}
    _report_all(receivers, prompts, again)  # the same reports again: duplicates, each told so
    assert all(a.accepted == 0 and a.duplicates == 4 for a in again.values()), again
    assert broker.fed.compat() == state.compat()


def test_reports_waiting_for_their_commit_hold_no_object_per_group(matched, prompts):
    """A report waits for its commit as columns (state.ReportRows): no ReportRow or
    ReportEntry per group that the garbage collector would track and carry into its older
    generations while the commit before it runs."""
    import gc

    from graft_fed.broker.state import ReportRow
    from graft_fed.federation.messages import ReportEntry

    def per_group(old: frozenset) -> int:
        # (not those from before: an earlier test's stopped broker may still hold some, until a
        # collection that could run meanwhile frees them)
        return sum(1 for o in gc.get_objects() if type(o) in (ReportRow, ReportEntry) and id(o) not in old)

    broker, receivers = matched
    state = broker.fed.state
    real = state.put_report_batches
    seen = []
    gc.collect()
    baseline = [o for o in gc.get_objects() if type(o) in (ReportRow, ReportEntry)]  # kept alive: ids stay theirs
    old = frozenset(map(id, baseline))

    def slow(batches):  # while the first commit runs, the other reports queue behind it
        if not seen:
            time.sleep(0.5)
            seen.append((per_group(old), len(broker.fed.reports._queue)))
        return real(batches)
    state.put_report_batches = slow
    answers: dict = {}
    _report_all(receivers, prompts, answers)
    assert all(a.accepted == 4 for a in answers.values()), answers
    assert seen[0][1] >= 2, seen  # reports of 4 groups each waited while it ran
    assert seen[0][0] == 0, seen
    assert len(state.reports()) == 4 * RECEIVERS and broker.fed.compat() == state.compat()


def test_a_failed_commit_fails_every_report_in_it_and_stores_none(matched, prompts):
    broker, receivers = matched
    state = broker.fed.state
    real = state.put_report_batches
    assert broker.fed.compat() == []  # loaded before the failure

    def failing(batches):
        time.sleep(0.3)
        raise Unavailable("the disk went away (a test)")
    state.put_report_batches = failing
    answers: dict = {}
    _report_all(receivers, prompts, answers)
    assert set(answers.values()) == {grpc.StatusCode.UNAVAILABLE}, answers
    assert state.compat() == [] and broker.fed.compat() == [] and state.reports() == []
    assert broker.fed.counters["reports"] == 0
    state.put_report_batches = real  # the storage is back: the nodes' retries are stored
    retried: dict = {}
    _report_all(receivers, prompts, retried)
    assert all(a.accepted == 4 for a in retried.values()), retried
    assert broker.fed.compat() == state.compat() and len(state.reports()) == 4 * RECEIVERS


@pytest.mark.parametrize("bad", [{"mean_s": float("nan")}, {"admitted_fraction": 2.0},
                                 # past the uniform bounds: the servicer only counts a report's
                                 # entries, each is checked as the broker reads it (codec.py)
                                 {"source_node_id": "s" * (MAX_STRING_LEN + 1)},
                                 {"prompt_id": "p" * (MAX_STRING_LEN + 7)}])
@pytest.mark.parametrize("where", [0, 3])
def test_a_malformed_report_is_refused_alone(matched, prompts, bad, where):
    broker, receivers = matched
    entries = _entries(prompts)
    for key, value in bad.items():
        setattr(entries[where], key, value)
    with pytest.raises(grpc.RpcError) as err:
        receivers[0].stub.ReportCompatibility(pb.CompatibilityReport(
            node_id="r0", session_id=receivers[0].session, round=0, entries=entries, tag=new_tag()),
            timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if "source_node_id" in bad or "prompt_id" in bad:
        (key, value), = bad.items()
        assert err.value.details() == (f"entries.{key} is {len(value)} characters long; "
                                       f"at most {MAX_STRING_LEN}")
    assert broker.fed.state.reports() == []
    answers: dict = {}
    _report_all(receivers[1:], prompts, answers)
    assert all(a.accepted == 4 for a in answers.values()), answers
    assert {c.receiver for c in broker.fed.compat()} == {f"r{i}" for i in range(1, RECEIVERS)}


def _fed(prompt_file):
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.state_memory import InMemoryState

    fed = Federation(broker_config(prompt_file), InMemoryState())
    assert fed.compat() == []  # loaded: the commits below update the copy in memory
    return fed


def _shared_commit(fed, good, bad):
    """r0's report commits alone, slowly, while r1, r9 (`bad`), r2 and r3 queue behind it and
    then share a commit: ({name: result or error}, the batches of each call to the state)."""
    inner = fed.state.put_report_batches
    calls = []

    first_running = threading.Event()

    def slow_first(batches):
        calls.append(len(batches))
        if len(calls) == 1:
            first_running.set()
            deadline = time.monotonic() + 10  # until the other four wait behind it
            while len(fed.reports._queue) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        return inner(batches)
    fed.state.put_report_batches = slow_first
    out: dict = {}

    def one(name, rows):
        try:
            out[name] = fed.reports._commit(rows)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[name] = exc
    threads = [threading.Thread(target=one, args=(f"r{i}", rows)) for i, rows in enumerate(good)]
    threads.insert(2, threading.Thread(target=one, args=("r9", bad)))
    threads[0].start()
    assert first_running.wait(10)  # the first commit is under way: the others queue behind it and share the next
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    return out, calls


def test_a_malformed_row_in_a_shared_commit_fails_only_its_report(prompt_file):
    from graft_fed.broker.state import ReportRow

    fed = _fed(prompt_file)
    good = [[ReportRow(0, f"r{i}", "s", "p0", 0.5, 1.0, False)] for i in range(4)]
    bad = [ReportRow(0, "r9", "s", "p0", 0.5, 1.0, 1)]  # rejected must be a bool: a broker bug, not the node's
    out, calls = _shared_commit(fed, good, bad)
    assert isinstance(out.pop("r9"), TypeError)
    assert out == {f"r{i}": (1, 0) for i in range(4)}
    assert calls[1] == 4  # the shared commit was tried, then each report alone
    assert [c.receiver for c in fed.compat()] == [f"r{i}" for i in range(4)] and fed.compat() == fed.state.compat()
    assert fed.counters["report_calls"] == 4 and fed.counters["report_commits"] == 4  # 1, then 3 alone


def test_a_report_stored_alone_succeeds_when_another_alone_fails_on_storage(prompt_file):
    from graft_fed.broker.state import ReportRow

    fed = _fed(prompt_file)
    real = fed.state.put_report_batches

    def flaky(batches):  # r3's report, stored alone, meets a storage error
        if len(batches) == 1 and batches[0] and batches[0][0].receiver == "r3":
            raise Unavailable("the disk went away for r3 (a test)")
        return real(batches)
    fed.state.put_report_batches = flaky
    good = [[ReportRow(0, f"r{i}", "s", "p0", 0.5, 1.0, False)] for i in range(4)]
    out, _ = _shared_commit(fed, good, [ReportRow(0, "r9", "s", "p0", 0.5, 1.0, 1)])
    assert isinstance(out.pop("r9"), TypeError) and isinstance(out.pop("r3"), Unavailable)
    assert out == {f"r{i}": (1, 0) for i in range(3)}  # stored: told so
    assert fed.compat() == fed.state.compat() and [c.receiver for c in fed.compat()] == ["r0", "r1", "r2"]
    assert fed.counters["report_calls"] == 3 and fed.counters["reports"] == 3


def test_reports_stored_succeed_when_every_read_after_fails(prompt_file):
    from graft_fed.broker.state import ReportRow

    fed = _fed(prompt_file)
    real = fed.state.compat
    down = [True]

    def failing(pairs=None):
        if down[0]:
            raise Unavailable("the disk went away (a test)")
        return real(pairs)
    fed.state.compat = failing
    fed.ctx.compat._read_all = failing  # the full read too (what a restart of the table does)
    assert fed.reports._commit([ReportRow(0, "r0", "s", "p0", 0.5, 1.0, True)]) == (1, 0)
    assert fed.counters["reports"] == 1 and fed.counters["report_calls"] == 1 and fed.counters["report_commits"] == 1
    down[0] = False
    assert fed.compat() == real() and fed.reports._commit([ReportRow(0, "r1", "s", "p0", 0.5, 1.0, True)]) == (1, 0)
    assert fed.counters["rejected_groups"] == 2 and fed.compat() == real()


def test_a_report_with_more_entries_than_a_round_has_groups_is_refused_unread(matched, prompts):
    broker, receivers = matched
    limit = broker.fed.manifest.prompts_per_round * 4  # federation.limits.MAX_PER_ROUND_FACTOR
    entries = [pb.CompatibilityReport.Entry(source_node_id="src", prompt_id=f"p{i}", mean_s=1.0)
               for i in range(limit + 50)]
    with pytest.raises(grpc.RpcError) as err:
        receivers[0].stub.ReportCompatibility(pb.CompatibilityReport(
            node_id="r0", session_id=receivers[0].session, round=0, entries=entries, tag=new_tag()), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {limit}" in err.value.details()
    assert broker.fed.state.reports() == [] and broker.fed.counters["report_calls"] == 0
    answers: dict = {}
    _report_all(receivers[:1], prompts, answers)  # the node's proper report goes through
    assert answers["r0"].accepted == 4


def test_a_failed_read_back_keeps_the_commit_and_rereads_the_counts(matched, prompts):
    broker, receivers = matched
    state = broker.fed.state
    assert broker.fed.compat() == []  # loaded
    real = state.compat

    def failing(pairs=None):
        if pairs is not None:
            raise Unavailable("the disk went away (a test)")
        return real()
    state.compat = failing
    answers: dict = {}
    _report_all(receivers[:2], prompts, answers)
    assert all(a.accepted == 4 for a in answers.values()), answers  # stored: the nodes are told so
    state.compat = real
    assert broker.fed.compat() == state.compat() and len(state.compat()) == 2  # read whole again


def test_the_codec_reads_a_report_as_columns_the_same_entries_and_errors_as_one_by_one():
    from graft_fed.federation.codec import report_entries_from_pb
    from graft_fed.federation.errors import InvalidArgument
    from graft_fed.federation.messages import ReportColumns

    def wire(entries):
        return pb.CompatibilityReport.FromString(pb.CompatibilityReport(entries=entries).SerializeToString())

    entries = [pb.CompatibilityReport.Entry(source_node_id=f"s{i % 3}", prompt_id=f"p{i}", mean_s=i / 7,
                                            admitted_fraction=1 / (i + 1), rejected=i % 4 == 1, undelivered=i % 5 == 2)
               for i in range(9)]
    reader = report_entries_from_pb(wire(entries))
    assert reader.columns(100) == ReportColumns.of(reader) == ReportColumns.of(report_entries_from_pb(wire(entries)))
    assert len(reader.columns(4).sources) == 5  # no further than the limit and one: the caller refuses it
    # the first string too long, in the order read, whichever column it is in
    long_source, long_prompt = "s" * (MAX_STRING_LEN + 1), "p" * (MAX_STRING_LEN + 2)
    bad = [pb.CompatibilityReport.Entry(source_node_id=e.source_node_id, prompt_id=e.prompt_id) for e in entries]
    bad[5].source_node_id, bad[3].prompt_id = long_source, long_prompt
    for read in (lambda r: r.columns(100), list):
        with pytest.raises(InvalidArgument, match=f"entries.prompt_id is {MAX_STRING_LEN + 2} characters long"):
            read(report_entries_from_pb(wire(bad)))
    assert len(report_entries_from_pb(wire(bad)).columns(2).sources) == 3  # beyond the limit: not read


def test_an_in_process_report_is_counted_before_its_entries_are_read(prompt_file):
    # a caller of Federation.report with more entries than a round allows is told so, whatever
    # the entries are (the codec's reader counts them too, before checking their strings)
    fed = _fed(prompt_file)
    session, _ = fed.join("r", "m", "tok", fed.manifest, "share_all", 0)
    limit = fed.manifest.prompts_per_round * 4
    with pytest.raises(InvalidArgument, match=f"more than {limit} entries in one report"):
        fed.report("r", session, 0, [("not", "an", "entry")] * (limit + 1))
