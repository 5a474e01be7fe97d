"""Replay protection: a state-changing request sent twice is applied once. A verbatim replay
is refused (ALREADY_EXISTS), so is a stale one (FAILED_PRECONDITION), an untagged one where
tags are required (INVALID_ARGUMENT); a node retrying after a lost reply still succeeds; and
a replay that reaches a restarted broker (which has forgotten its request ids) changes
nothing, because every state change those RPCs make is idempotent."""

import math
import time

import grpc
import numpy as np
import pytest

from graft_fed.broker.state import MatchRow
from graft_fed.broker.replay import ReplayGuard, RequestIds
from graft_fed.federation.codec import manifest_to_pb
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.federation.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument
from graft_fed.node.client import BrokerClient, broker_stub, new_tag
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, code_of, manifest, record, summary

ID = "0123456789abcdef0123456789abcdef"


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_guard_refuses_duplicates_stale_and_untagged_requests():
    clock = Clock()
    g = ReplayGuard(window_s=300, clock=clock)
    ms = int(clock.t * 1000)
    with g.admit("Publish", "a", ID, ms):
        pass
    with pytest.raises(AlreadyExists, match="already applied"):
        g.begin("Publish", "a", ID, ms)
    with g.admit("Publish", "b", ID, ms):  # ids are per node
        pass
    with pytest.raises(FailedPrecondition, match="sent 301 s ago.*synchronise"):
        g.begin("Publish", "a", "x" * 32, ms - 301_000)
    with pytest.raises(FailedPrecondition, match="in the future"):
        g.begin("Publish", "a", "x" * 32, ms + 301_000)
    with pytest.raises(InvalidArgument, match="carries no tag.*require_request_ids"):
        g.begin("Publish", "a", "", 0)
    for bad in ("short", "x" * 65, "has space 0123456789", "ünïcode-0123456789"):
        with pytest.raises(InvalidArgument, match="16-64 characters"):
            g.begin("Publish", "a", bad, ms)
    assert ReplayGuard(required=False, clock=clock).begin("Publish", "a", "", 0) is None  # admitted, untracked

    # a request that fails is not remembered: its retry is applied
    with pytest.raises(RuntimeError):
        with g.admit("Report", "a", "f" * 32, ms):
            raise RuntimeError("refused by the handler")
    with g.admit("Report", "a", "f" * 32, ms):
        pass
    # the same request while the first is still being processed
    t = g.begin("Upload", "a", "e" * 32, ms)
    with pytest.raises(Aborted, match="still being processed"):
        g.begin("Upload", "a", "e" * 32, ms)
    g.end(t, applied=True)
    with pytest.raises(AlreadyExists):
        g.begin("Upload", "a", "e" * 32, ms)

    # ids are forgotten once their send time leaves the window (a replay is then stale)
    assert g.remembered() == 4
    clock.t += 301
    assert g.expire() == 4 and g.remembered() == 0
    with pytest.raises(FailedPrecondition):
        g.begin("Publish", "a", ID, ms)
    assert dict(g.counters) == {"admitted": 4, "refused_duplicate": 2, "refused_stale": 3, "refused_untagged": 1,
                                "refused_inflight": 1}

    # bounded memory: at most max_per_node ids per node, the oldest forgotten first
    small = ReplayGuard(window_s=300, max_per_node=3, clock=clock)
    now = int(clock.t * 1000)
    for i in range(5):
        with small.admit("Heartbeat", "a", f"{i:032d}", now + 1000 * i):
            pass
    assert small.remembered() == 3 and small.counters["evicted"] == 2
    with pytest.raises(AlreadyExists):
        small.begin("Heartbeat", "a", f"{4:032d}", now + 4000)
    small.end(small.begin("Heartbeat", "a", f"{0:032d}", now), applied=False)  # forgotten early: admitted
    small.end(small.begin("Heartbeat", "a", f"{1:032d}", now + 1000), applied=False)
    for i in (2, 3):
        with pytest.raises(AlreadyExists):
            small.begin("Heartbeat", "a", f"{i:032d}", now + 1000 * i)


def test_request_ids_across_merges_expiry_and_eviction():
    ids = RequestIds(max_per_node=1000, epoch=0.0, merge_s=5.0, merge_at=64)
    fps = {}
    for i in range(600):  # three nodes, expiries 100..699 s: merged every 64 ids on the way
        node = "abc"[i % 3]
        fps[(node, i)] = fp = ids.fingerprint(node, f"req-{i:016d}")
        assert ids.add(fp, node, expires=100.0 + i, now=0.0) == 0
    assert len(ids) == 600 and len(ids._hi) >= 400  # most of them merged into the columns
    assert all(fp in ids for fp in fps.values())
    assert ids.fingerprint("a", "req-0000000000000000") != ids.fingerprint("b", "req-0000000000000000")
    assert RequestIds(10, 0.0).fingerprint("a", "r" * 16) != ids.fingerprint("a", "r" * 16)  # keyed per guard
    assert ids.fingerprint("d", "req-0000000000000000") not in ids
    assert not ids.due(99.0) and ids.due(101.0)  # nothing expired yet; then the first id
    assert ids.merge(now=400.0) == 300  # expiries 100..399 dropped, 400.. kept
    assert len(ids) == 300 and ids._recent == {}
    assert [fp in ids for (_, i), fp in fps.items() if i in (299, 300, 599)] == [False, True, True]
    assert ids._count == {"a": 100, "b": 100, "c": 100}
    assert not ids.due(402.0)  # within merge_s of the last merge
    assert ids.merge(now=10_000.0) == 300 and len(ids) == 0 and ids._count == {} and ids._names == []

    # a node beyond max_per_node loses its oldest eighth at once; the others keep theirs
    small = RequestIds(max_per_node=16, epoch=0.0, merge_at=4)
    other = small.fingerprint("quiet", "q" * 16)
    small.add(other, "quiet", expires=50.0, now=0.0)
    mine = [small.fingerprint("loud", f"{i:016d}") for i in range(17)]
    evicted = [small.add(fp, "loud", expires=100.0 + i, now=0.0) for i, fp in enumerate(mine)]
    assert evicted == [0] * 16 + [3]  # 17 held -> 14 (16 - 16 // 8)
    assert [fp in small for fp in mine] == [False] * 3 + [True] * 14 and other in small
    assert small._count == {"quiet": 1, "loud": 14} and small.evicted == 3
    # a node at the cap whose ids have all expired by the time its last one is applied
    late = RequestIds(max_per_node=1, epoch=0.0)
    late.add(1, "slow", expires=10.0, now=0.0)
    assert late.add(2, "slow", expires=5.0, now=20.0) == 0 and len(late) == 0 and late._count == {}


def test_request_ids_share_a_high_half():
    ids = RequestIds(max_per_node=10, epoch=0.0)
    hi = 0xDEADBEEF << 64
    for lo in (7, 3, 5):
        ids.add(hi | lo, "a", expires=10.0, now=0.0)
    ids.add((hi + (1 << 64)) | 3, "a", expires=10.0, now=0.0)
    ids.merge(now=0.0)
    assert [hi | lo in ids for lo in (3, 4, 5, 7, 8)] == [True, False, True, True, False]
    assert (hi + (1 << 64)) | 3 in ids and (hi - (1 << 64)) | 3 not in ids


def test_request_ids_cost_tens_of_bytes_each():
    """What 20,000 remembered ids hold, traced: the compact columns, not one set of Python
    objects per id (per-node dicts of strings held about 250 bytes each)."""
    import tracemalloc
    ids = RequestIds(max_per_node=100_000, epoch=0.0)
    names = [f"node{i:03d}" for i in range(200)]
    fps = [(ids.fingerprint(names[i % 200], f"{i:032x}"), names[i % 200]) for i in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, (fp, node) in enumerate(fps):
            ids.add(fp, node, expires=1000.0 + i / 100, now=0.0)
        ids.merge(now=0.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(ids) == 20_000
    assert held / 20_000 < 40, f"{held / 20_000:.0f} bytes per remembered id"


@pytest.fixture()
def broker(prompt_file):
    server = start_broker(broker_config(prompt_file))
    yield server
    server.stop()


def snapshot(broker):
    s = broker.state
    return (s.summaries(), [(n.node_id, n.session_id, n.state, n.round) for n in s.list_nodes()],
            s.bundle_stats(), s.compat(), s.reports())


def test_every_state_changing_rpc_refuses_a_verbatim_replay(broker, prompts):
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    p0 = prompts[0]
    b.publish(0, [summary(p0, 1)])
    # a report is accepted only about a group the receiver was matched to: record that match
    broker.state.put_matches([MatchRow(round=0, receiver="a", prompt_id=p0.id, source="b", source_round=0)])
    requests = {
        "Join": pb.JoinRequest(node_id="c", model_id="c", tokenizer_id="tok", privacy=pb.PRIVACY_SHARE_ALL,
                               manifest=manifest_to_pb(manifest(prompts)), tag=new_tag()),
        "Heartbeat": pb.HeartbeatRequest(node_id="a", session_id=a.session, round=3, tag=new_tag()),
        "PublishSummaries": pb.PublishRequest(node_id="a", session_id=a.session, round=0,
                                              summaries=[summary(p0, 0)], tag=new_tag()),
        "ReportCompatibility": pb.CompatibilityReport(node_id="a", session_id=a.session, round=0, tag=new_tag(),
                                                      entries=[pb.CompatibilityReport.Entry(
                                                          source_node_id="b", prompt_id=p0.id, mean_s=0.5,
                                                          admitted_fraction=1.0)]),
    }
    first = {}
    for rpc, req in requests.items():
        first[rpc] = getattr(a.stub, rpc)(req, timeout=5)
        before = snapshot(broker)
        code, details = code_of(lambda: getattr(a.stub, rpc)(req, timeout=5))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "already applied" in details, rpc
        assert snapshot(broker) == before, rpc
    # the replayed Join did not open a new session: the first one is still c's live session
    assert broker.state.get_node("c").session_id == first["Join"].session_id
    assert first["PublishSummaries"].accepted == 1 and first["ReportCompatibility"].accepted == 1

    data = encode_bundle(record(p0, 1, model="b"))
    chunks = [pb.BundleChunk(digest=digest_of(data), total_size=len(data), offset=0, data=data, node_id="b",
                             session_id=b.session, prompt_id=p0.id, round=0, tag=new_tag())]
    assert b.stub.UploadBundle(iter(chunks), timeout=5).stored
    assert code_of(lambda: b.stub.UploadBundle(iter(chunks), timeout=5))[0] == grpc.StatusCode.ALREADY_EXISTS

    leave = pb.LeaveRequest(node_id="a", session_id=a.session, tag=new_tag())
    a.stub.Leave(leave, timeout=5)
    assert code_of(lambda: a.stub.Leave(leave, timeout=5))[0] == grpc.StatusCode.ALREADY_EXISTS

    # what the broker counted, and what /metrics shows
    assert broker.fed.replay.counters["refused_duplicate"] == 6
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{broker.http_port}/metrics", timeout=5).read().decode()
    assert 'graft_fed_replay_refused_total{reason="duplicate"} 6' in text
    assert 'graft_fed_rpc_total{method="Heartbeat",code="ALREADY_EXISTS"} 1' in text
    for c in (a, b):
        c.close()


def test_stale_future_and_untagged_requests_are_refused(broker, prompts):
    a = client(broker, prompts, "a")
    p0 = prompts[0]
    stale = pb.PublishRequest(node_id="a", session_id=a.session, round=0, summaries=[summary(p0, 1)],
                              tag=pb.RequestTag(request_id=ID, sent_at_ms=int((time.time() - 600) * 1000)))
    code, details = code_of(lambda: a.stub.PublishSummaries(stale, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "sent 600 s ago" in details and "NTP" in details
    stale.tag.sent_at_ms = int((time.time() + 3600) * 1000)
    code, details = code_of(lambda: a.stub.PublishSummaries(stale, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in the future" in details
    stale.ClearField("tag")
    code, details = code_of(lambda: a.stub.PublishSummaries(stale, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "carries no tag" in details
    assert broker.state.summaries() == []
    a.close()


def test_untagged_requests_pass_where_tags_are_not_required(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, require_request_ids=False))
    try:
        a = client(broker, prompts, "a")
        req = pb.PublishRequest(node_id="a", session_id=a.session, round=0, summaries=[summary(prompts[0], 1)])
        assert a.stub.PublishSummaries(req, timeout=5).accepted == 1
        assert a.stub.PublishSummaries(req, timeout=5).duplicates == 1  # unprotected, but idempotent
        a.close()
    finally:
        broker.stop()


class LostReply(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset after the broker answered (test)"


class LoseFirstReply(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """The request reaches the broker and is applied; the node never sees the answer."""

    def __init__(self, methods):
        self.pending = set(methods)

    def _intercept(self, continuation, details, request):
        call = continuation(details, request)
        method = details.method.rsplit("/", 1)[-1]
        if method in self.pending and call.code() == grpc.StatusCode.OK:
            self.pending.discard(method)
            raise LostReply()
        return call

    def intercept_unary_unary(self, continuation, details, request):
        return self._intercept(continuation, details, request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return self._intercept(continuation, details, request_iterator)


def test_a_retry_after_a_lost_reply_succeeds_and_is_applied_once(broker, prompts):
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    p0, p1 = prompts[0], prompts[1]
    b.publish(0, [summary(p0, 1)])
    lossy = LoseFirstReply({"PublishSummaries", "UploadBundle", "ReportCompatibility", "Leave"})
    for c in (a, b):
        c.stub = broker_stub(grpc.intercept_channel(c.channel, lossy))
    assert a.publish(0, [summary(p0, 0), summary(p1, 1)]) == (0, 2)  # applied by the attempt whose reply was lost
    assert len(broker.state.summaries(node_id="a")) == 2
    assert b.upload(record(p0, 1, model="b"), 0)[1] is False  # stored by the first attempt
    assert broker.state.bundle_stats()[0] == 1
    broker.state.put_matches([MatchRow(round=0, receiver="a", prompt_id=p0.id, source="b", source_round=0)])
    entry = pb.CompatibilityReport.Entry(source_node_id="b", prompt_id=p0.id, mean_s=0.5, admitted_fraction=1.0)
    a.report(0, [entry])
    assert [(c.source, c.receiver, c.groups) for c in broker.state.compat()] == [("b", "a", 1)]
    a.leave()
    assert broker.state.get_node("a").state == "left"
    assert lossy.pending == set() and a.applied_on_retry == 3 and b.applied_on_retry == 1
    calls = broker.servicer.stats.calls
    for rpc in ("PublishSummaries", "UploadBundle", "ReportCompatibility", "Leave"):
        assert calls[(rpc, "OK")] >= 1 and calls[(rpc, "ALREADY_EXISTS")] == 1, rpc
    for c in (a, b):
        c.close()


class Count(grpc.UnaryUnaryClientInterceptor):
    def __init__(self):
        self.tags = []

    def intercept_unary_unary(self, continuation, details, request):
        self.tags.append(request.tag.request_id)
        return continuation(details, request)


def test_a_broker_that_is_down_is_retried_twice_with_the_same_tag_then_reported(prompts):
    c = BrokerClient("127.0.0.1:1", "a", rpc_timeout_s=2, retries=2)  # nothing listens there
    count = Count()
    c.stub = broker_stub(grpc.intercept_channel(c.channel, count))
    c.session = "s"
    code, _ = code_of(lambda: c.publish(0, [summary(prompts[0], 1)]))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert len(count.tags) == 3 and len(set(count.tags)) == 1  # one request, three attempts
    code_of(lambda: c.publish(1, [summary(prompts[0], 1, round=1)]))
    assert len(set(count.tags)) == 2  # the next request has a tag of its own
    c.close()


def test_a_replay_after_a_broker_restart_changes_nothing(prompt_file, prompts, tmp_path):
    db = str(tmp_path / "broker.sqlite")
    broker = start_broker(broker_config(prompt_file, db=db))
    try:
        a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
        p0 = prompts[0]
        b.publish(0, [summary(p0, 1)])
        b.upload(record(p0, 1, "b"), 0)  # a group whose claimed rewards do not verify: its rejection counts
        publish = pb.PublishRequest(node_id="a", session_id=a.session, round=0, summaries=[summary(p0, 0)],
                                    tag=new_tag())
        report = pb.CompatibilityReport(node_id="a", session_id=a.session, round=0, tag=new_tag(), entries=[
            pb.CompatibilityReport.Entry(source_node_id="b", prompt_id=p0.id, rejected=True)])
        a.stub.PublishSummaries(publish, timeout=5)
        broker.state.put_matches([MatchRow(round=0, receiver="a", prompt_id=p0.id, source="b", source_round=0)])
        a.stub.ReportCompatibility(report, timeout=5)
        for c in (a, b):
            c.close()
    finally:
        broker.stop()
    broker = start_broker(broker_config(prompt_file, db=db))  # the request ids are gone with the process
    try:
        before = snapshot(broker)
        replayer = BrokerClient(broker.address, "a")
        assert replayer.stub.PublishSummaries(publish, timeout=5).duplicates == 1  # admitted, but idempotent
        assert replayer.stub.ReportCompatibility(report, timeout=5).duplicates == 1
        after = snapshot(broker)
        assert after[0] == before[0] and after[2:] == before[2:]  # summaries, bundles, compat, reports unchanged
        assert after[3][0].rejected == 1  # the rejection still counts once
        replayer.close()
    finally:
        broker.stop()


def test_request_ids_match_a_plain_set_through_merges_expiry_eviction_and_keep_their_buffers():
    """Random adds, merges, expiries and evictions against a dict of what must be held; the
    columns' buffers are kept from merge to merge once their size is steady (no new arrays
    for the long-lived ids every few seconds: issue 13's RSS run)."""
    rng = np.random.default_rng(7)
    ids = RequestIds(max_per_node=40, epoch=0.0, merge_s=1.0, merge_at=64)
    held: dict[int, tuple[float, str]] = {}  # fingerprint -> (expiry, node)
    now, buffers = 0.0, set()
    for step in range(6000):
        now += 0.05
        node = f"n{int(rng.integers(0, 12))}"
        fp = ids.fingerprint(node, f"req-{step:016d}")
        expires = now + float(rng.uniform(20.0, 40.0))
        merged = ids._merged_at
        evicted = ids.add(fp, node, expires=expires, now=now)
        held[fp] = (expires, node)
        if ids.due(now):
            ids.merge(now)
        if ids._merged_at != merged:  # what went: the expired, and the node's oldest if it was over the cap
            gone = [f for f in held if f not in ids]
            expired = [f for f in gone if math.ceil(held[f][0]) < math.ceil(now)]
            oldest = [f for f in gone if f not in expired]
            assert len(oldest) == evicted and all(held[f][1] == node for f in oldest)
            if oldest:
                assert max(math.ceil(held[f][0]) for f in oldest) <= min(  # expiries in whole seconds
                    math.ceil(e) for f, (e, n) in held.items() if n == node and f not in gone)
            for f in gone:
                del held[f]
        if step % 97 == 0:
            assert all(f in ids for f in held)
            assert sum(ids._count.values()) >= len(held)
            assert ids.fingerprint(node, f"absent-{step:010d}") not in ids
            assert np.all(np.diff(ids._hi.astype(np.float64)) >= 0)  # sorted by the high half
        if step >= 3000:  # steady: about 30 s of ids held
            buffers.add(id(ids._buf["hi"]))
    ids.merge(now)
    held = {f: v for f, v in held.items() if math.ceil(v[0]) >= math.ceil(now)}
    assert len(ids) == len(held) and all(f in ids for f in held)
    assert set(ids._names) == set(ids._count) == {n for _, n in held.values()}
    assert len(buffers) <= 2, "the columns were reallocated at nearly every merge"
    assert ids.evicted > 100, ids.evicted  # nodes over the cap were exercised
