"""Every RPC over a real server on 127.0.0.1:0: status codes, idempotence, authorisation."""

import dataclasses
import math
import threading
import time
import urllib.request

import grpc
import pytest

from graft_fed.core.records import GroupRecord
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.federation.codec import manifest_to_pb
from graft_fed.federation.errors import FederationError
from graft_fed.federation.transport import TIMING_KEY, parse_timing
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version
from graft_fed.node.client import BrokerClient, new_tag
from graft_fed.proto import broker_pb2 as pb
from graft_fed.rewards.config import VerifierConfig
from tests.federation.helpers import broker_config, start_broker


def manifest(prompts, **over):
    m = Manifest(federation_id="", protocol_version=PROTOCOL_VERSION, dataset_id=prompts[0].dataset,
                 dataset_hash=dataset_hash(prompts), seed=3, n=2, prompts_per_round=8, mode="",
                 verifier_name="tests.plugins:odd_char_sum",
                 verifier_version=verifier_version(VerifierConfig(name="tests.plugins:odd_char_sum")),
                 staleness_rounds=0, advantage="group/sample")
    return dataclasses.replace(m, **over)


def client(broker, prompts, name, privacy="share_all"):
    c = BrokerClient(broker.address, name)
    c.join(name, "tok", manifest(prompts), privacy, 0)
    return c


def summary(p, k, round=0):
    return pb.GroupSummary(prompt_id=p.id, round=round, policy_version=round, n=2, k=k, reward_mean=k / 2,
                           reward_std=math.sqrt(0.5) if k == 1 else 0.0, lengths=[3, 4], mean_logprobs=[-0.5, -0.25])


def record(p, k, model="a"):
    rewards = (1.0, 0.0) if k == 1 else (0.0, 0.0)
    adv = (0.7071, -0.7071) if k == 1 else (0.0, 0.0)
    return GroupRecord(prompt_id=p.id, step=0, model_id=model, tokenizer_id="tok", problem=p.problem, answer=p.answer,
                       rewards=rewards, advantages=adv, texts=("x", "y"), finish_reasons=("stop", "stop"),
                       lengths=(3, 4), mean_logprobs=(-0.5, -0.25))


def code_of(call):
    """(status code, message) of a call that must fail, through the client (a domain error)
    or a raw stub (grpc.RpcError)."""
    with pytest.raises((grpc.RpcError, FederationError)) as info:
        call()
    if isinstance(info.value, FederationError):
        return grpc.StatusCode[info.value.status], str(info.value).split(": ", 1)[-1]
    return info.value.code(), info.value.details()


def test_join_refuses_a_different_manifest_naming_the_fields(broker, prompts):
    c = BrokerClient(broker.address, "x")
    code, details = code_of(lambda: c.join("x", "tok", manifest(prompts, n=4, seed=9), "share_all", 0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "n: broker has 2, node has 4" in details and "seed" in details
    # a node that normalises its advantages otherwise: receivers would train on them as they are
    code, details = code_of(lambda: c.join("x", "tok", manifest(prompts, advantage="none/sample"), "share_all", 0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "advantage: broker has 'group/sample', node has 'none/sample'" in details
    # other problems (one prompt fewer): the digests alone would not say what to change
    code, details = code_of(lambda: c.join("x", "tok", manifest(prompts[:-1]), "share_all", 0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "dataset_hash: broker has" in details and "loaded different problems" in details
    assert "data.source, split" in details and len(details) < 1024
    # a client written before the field existed sends none: taken as the paper's group/sample
    old = manifest_to_pb(manifest(prompts))
    old.ClearField("advantage")
    resp = c.stub.Join(pb.JoinRequest(node_id="old", model_id="m", tokenizer_id="tok", manifest=old, privacy=1,
                                      tag=new_tag()), timeout=5)
    assert resp.session_id and resp.manifest.advantage == "group/sample"
    code, details = code_of(lambda: c.join("", "tok", manifest(prompts), "share_all", 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    c.close()


def test_publish_validates_is_idempotent_and_leaves_state_on_rejection(broker, prompts):
    a = client(broker, prompts, "a")
    bad = summary(prompts[0], 3)  # k > n
    code, details = code_of(lambda: a.publish(0, [summary(prompts[1], 1), bad]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "k=3" in details
    assert broker.state.summaries() == []  # the valid summary of the rejected batch was not stored
    assert a.publish(0, [summary(prompts[1], 1)]) == (1, 0)
    assert a.publish(0, [summary(prompts[1], 1)]) == (0, 1)  # a retried publish never duplicates
    lying = summary(prompts[2], 1)
    lying.reward_mean = 0.9
    assert code_of(lambda: a.publish(0, [lying]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    unknown = summary(prompts[2], 1)
    unknown.prompt_id = "ffffffffffffffff"
    assert "unknown prompt id" in code_of(lambda: a.publish(0, [unknown]))[1]
    a.session = "stale"
    assert code_of(lambda: a.publish(0, [summary(prompts[3], 1)]))[0] == grpc.StatusCode.UNAUTHENTICATED
    a.close()


@pytest.fixture(params=[False, True], ids=["grpc-in-broker", "front-process"])
def queued_broker(prompt_file, request):
    server = start_broker(broker_config(prompt_file, front_process=request.param, publish_queue=True))
    yield server
    server.stop()


def test_the_publish_queue_is_on_by_default(broker, prompts):
    a = client(broker, prompts, "a")
    assert a.publish(0, [summary(prompts[0], 1)]) == (1, 0)
    assert broker.fed.publishing.queue._thread is not None  # noqa: SLF001 - the queue's thread took it
    assert broker.fed.publishing.queue.items == 1
    a.close()


def test_a_new_client_of_a_broker_started_where_none_answered_joins_at_once(prompt_file, prompts):
    """A channel keeps its own connections (`grpc.use_local_subchannel_pool`): another
    channel of the process to the same address, failing and backing off while nothing
    listened there, must not hand its backoff and last error ("Connection refused") to a
    client of the broker that then starts at that address (a restart; in the suite, a
    port the kernel hands out again)."""
    import socket

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    stale = BrokerClient(f"127.0.0.1:{port}", "stale", rpc_timeout_s=1)
    for _ in range(5):  # refused each time: its connection backs off
        with pytest.raises(grpc.RpcError):
            stale.stub.Heartbeat(pb.HeartbeatRequest(node_id="stale"), timeout=1)
        time.sleep(0.2)
    server = start_broker(broker_config(prompt_file, listen=f"127.0.0.1:{port}"))
    try:
        a = client(server, prompts, "a")  # its first call: Join
        assert a.publish(0, [summary(prompts[0], 1)]) == (1, 0)
        a.close()
    finally:
        server.stop()
        stale.close()


def test_without_the_publish_queue_each_thread_publishes_its_own(prompt_file, prompts):
    server = start_broker(broker_config(prompt_file, publish_queue=False))
    try:
        a = client(server, prompts, "a")
        assert a.publish(0, [summary(prompts[0], 1)]) == (1, 0)
        assert a.publish(0, [summary(prompts[0], 1), summary(prompts[1], 0)]) == (1, 1)
        assert server.fed.publishing.queue._thread is None  # noqa: SLF001 - no queue thread was started
        assert server.fed.publishing.queue.items == 0
        a.close()
    finally:
        server.stop()


def test_publishes_waiting_together_are_stored_in_one_batch_each_with_its_own_answer(queued_broker, prompts):
    """The publish queue (broker/publishqueue.py, `publish_queue: true`) over gRPC: publishes
    that arrive while its thread is busy are decoded, checked and committed as one batch; a
    malformed one gets its own error; the others are stored and credited. What needs no
    decoding is refused at once, without waiting for the queue: a stale session, more
    summaries than a round allows, and a node's third publish in flight."""
    broker = queued_broker
    names = [f"n{i}" for i in range(6)]
    clients = {name: client(broker, prompts, name) for name in names}
    queue = broker.fed.publishing.queue
    slots = broker.cfg.work_slots
    for _ in range(slots):  # the queue's thread will wait in the first publish's work slot
        broker.fed.work.acquire()
    answers: dict = {}

    def raw(name: str, rows):
        c = clients[name]
        return pb.PublishRequest(node_id=name, session_id=c.session, round=0, summaries=rows, tag=new_tag())

    def publish(name: str, rows, key: str | None = None) -> None:
        try:
            if key is None:
                answers[name] = clients[name].publish(0, rows)
            else:  # a second publish of the same node, beside its client's own
                got = clients[name].stub.PublishSummaries(raw(name, rows), timeout=20)
                answers[key] = (got.accepted, got.duplicates)
        except (FederationError, grpc.RpcError) as exc:
            answers[key or name] = exc

    rows = {name: [summary(prompts[i], 1), summary(prompts[i + 1], 0)] for i, name in enumerate(names)}
    rows["n3"] = [summary(prompts[3], 3)]  # k > n
    threads = [threading.Thread(target=publish, args=(name, rows[name])) for name in names if name != "n4"]
    threads.append(threading.Thread(target=publish, args=("n1", [summary(prompts[7], 1)], "n1 again")))
    batches = queue.batches

    def wait_for(what: str, done) -> None:
        deadline = time.monotonic() + 20
        while not done():
            assert time.monotonic() < deadline, f"{what}: {answers}"
            time.sleep(0.01)

    try:
        threads[0].start()  # taken by the queue's thread, which waits for a work slot
        wait_for("the first publish was not taken", lambda: queue.items + len(queue._items) == 0 and queue._thread)
        for t in threads[1:]:
            t.start()
        wait_for("the publishes did not queue", lambda: len(queue._items) == 5)  # noqa: SLF001
        # refused at once while the queue is held
        clients["n4"].session = "stale"
        assert code_of(lambda: clients["n4"].publish(0, rows["n4"]))[0] == grpc.StatusCode.UNAUTHENTICATED
        too_many = [summary(p, 1) for p in prompts[:8]] * 4 + [summary(prompts[0], 1)]  # 33 > 4 x 8
        code, details = code_of(lambda: clients["n5"].stub.PublishSummaries(raw("n5", too_many), timeout=20))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "33 summaries in one publish; at most 32" in details
        code, details = code_of(lambda: clients["n1"].stub.PublishSummaries(raw("n1", rows["n1"]), timeout=20))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already has 2 publishes in flight" in details
        assert len(queue._items) == 5 and not answers  # noqa: SLF001 - nothing else moved
    finally:
        for _ in range(slots):
            broker.fed.work.release()
    for t in threads:
        t.join(20)
    # the first alone; the four others that waited together; n1's second after its first
    assert queue.batches == batches + 3
    assert "k=3" in str(answers["n3"]) and answers["n3"].status == "INVALID_ARGUMENT"
    for name in ("n0", "n1", "n2", "n5"):
        assert answers[name] == (2, 0)
    assert answers["n1 again"] == (1, 0) and broker.state.get_node("n1").published == 3
    for name in ("n0", "n2", "n5"):
        assert broker.state.get_node(name).published == 2
    assert {s.node_id for s in broker.state.summaries()} == {"n0", "n1", "n2", "n5"}
    if broker.http_port:
        with urllib.request.urlopen(f"http://127.0.0.1:{broker.http_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert f"graft_fed_publish_batches_total {queue.batches}" in metrics
        assert f"graft_fed_publish_batched_total {queue.items}" in metrics
    for c in clients.values():
        c.close()


def test_stopping_the_broker_stores_the_publishes_it_queued(prompt_file, prompts, tmp_path):
    """BrokerServer.stop: gRPC stops, then the publish queue stores what it holds (the state
    is still open), then the state closes; a publish queued when the stop began is durable."""
    from graft_fed.broker.state_sqlite import SqliteState

    db = str(tmp_path / "b.db")
    server = start_broker(broker_config(prompt_file, db=db, publish_queue=True))
    a = client(server, prompts, "a")
    for _ in range(server.cfg.work_slots):  # the queue's thread waits in the publish's work slot
        server.fed.work.acquire()
    answer: dict = {}

    def publish() -> None:
        try:
            answer["a"] = a.publish(0, [summary(prompts[0], 1)])
        except FederationError as exc:
            answer["a"] = exc

    t = threading.Thread(target=publish)
    t.start()
    queue = server.fed.publishing.queue
    deadline = time.monotonic() + 20
    while not (queue._thread and not queue._items):  # noqa: SLF001 - taken by the queue's thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stopper = threading.Thread(target=server.stop, args=(0.2,))
    stopper.start()
    time.sleep(0.5)  # gRPC has stopped; the stop now waits for the queue
    assert stopper.is_alive()
    for _ in range(server.cfg.work_slots):
        server.fed.work.release()
    stopper.join(20)
    t.join(20)
    a.close()
    assert not stopper.is_alive() and queue.items == 1
    state = SqliteState(db)
    try:
        assert [(s.node_id, s.prompt_id) for s in state.summaries()] == [("a", prompts[0].id)]
        assert state.get_node("a").published == 1
    finally:
        state.close()


def test_a_failure_after_the_commit_does_not_fail_the_batch_and_every_ticket_ends(broker, prompts, monkeypatch,
                                                                                   caplog):
    """`publish_many`: when the broker's memory of one stored publish cannot be updated, that
    publish still answers as stored (it is durable), the others are untouched, and the
    round's index is read again from the state. `run_batch`: whatever escapes (even a
    BaseException), every replay ticket taken is ended, stored or not."""
    from graft_fed.broker.publishing import Publish, Received

    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    pub = broker.fed.publishing
    blocks = {n: broker.fed.check_rows(n, 0, summaries_of(n, prompts)) for n in "ab"}
    real = broker.fed.index.add_columns

    def add_columns(round, node_id, pids, ks):
        if node_id == "a":
            raise RuntimeError("index broken")
        return real(round, node_id, pids, ks)

    monkeypatch.setattr(broker.fed.index, "add_columns", add_columns)
    out = pub.publish_many([Publish("a", a.session, 0, blocks["a"]), Publish("b", b.session, 0, blocks["b"])])
    monkeypatch.undo()
    assert out == [(2, 0), (2, 0)] and "is stored, but the broker's memory of it was not updated" in caplog.text
    assert broker.fed.index.published(0) == {"a", "b"}  # read again from the state
    assert broker.state.get_node("a").published == 2

    ended = []
    works = [Received("a", a.session, 1, lambda: (broker.fed.check_rows("a", 1, summaries_of("a", prompts, 1)),
                                                lambda stored: ended.append(("a", stored)))),
             Received("b", b.session, 1, lambda: (_ for _ in ()).throw(KeyboardInterrupt()))]
    with pytest.raises(KeyboardInterrupt):
        pub.run_batch(works)
    assert ended == [("a", False)]
    a.close()
    b.close()


def summaries_of(node, prompts, round=0):
    from graft_fed.federation.codec import summaries_from_pb

    req = pb.PublishRequest(node_id=node, round=round, summaries=[summary(prompts[0], 1, round),
                                                                  summary(prompts[1], 0, round)])
    return summaries_from_pb(req)


def test_matching_bundles_and_authorisation(broker, prompts):
    a, b, c = (client(broker, prompts, n) for n in "abc")
    p0, p1 = prompts[0], prompts[1]
    # a and b complement each other (a failed p0, b solved it once; the reverse for p1), so the
    # pairwise rule lets one group move each way; c failed everything and gives nothing, so it
    # receives nothing either (m = 0 for its pairs)
    a.publish(0, [summary(p0, 0), summary(p1, 1)])
    b.publish(0, [summary(p0, 1), summary(p1, 0)])
    c.publish(0, [summary(p0, 0), summary(p1, 0)])
    rec = record(p0, 1, model="b")
    digest, stored = b.upload(rec, 0)
    assert stored and b.upload(rec, 0) == (digest, False)  # content-addressed: never stored twice
    assert b.has_bundles([digest]) == {digest}
    resp = a.get_matches(0, 5.0)
    assert resp.ready and [(o.prompt_id, o.source_node, o.digest) for o in resp.offers] == [
        (p0.id, "b", digest)]
    assert resp.candidates == 1 and resp.solved_by_peers == 1
    assert a.fetch(digest) == rec
    # c was never matched to that bundle
    assert list(c.get_matches(0, 5.0).offers) == []
    assert a.get_matches(0, 1.0).upload_requests == [(p1.id, 0)]
    assert code_of(lambda: c.fetch(digest))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: c.fetch("0" * 64))[0] == grpc.StatusCode.NOT_FOUND
    # a bundle that does not hold the group its summary describes is refused
    wrong = dataclasses.replace(rec, mean_logprobs=(-0.1, -0.2))
    assert code_of(lambda: b.upload(wrong, 0))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # uploading for a group never published
    assert code_of(lambda: b.upload(record(prompts[5], 1, "b"), 0))[0] == grpc.StatusCode.NOT_FOUND
    # compatibility reports feed the status matrix
    a.report(0, [pb.CompatibilityReport.Entry(source_node_id="b", prompt_id=p0.id, mean_s=0.9, admitted_fraction=1.0)])
    bad = pb.CompatibilityReport.Entry(source_node_id="b", prompt_id=p0.id, mean_s=float("nan"), admitted_fraction=1)
    assert code_of(lambda: a.report(0, [bad]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    st = a.status()
    pair = [p for p in st.pairs if (p.source, p.receiver) == ("b", "a")][0]
    assert pair.groups == 1 and pair.mean_s == pytest.approx(0.9)
    for x in (a, b, c):
        x.close()


def test_summaries_only_nodes_upload_nothing_and_are_never_sources(broker, prompts):
    a, s = client(broker, prompts, "a"), client(broker, prompts, "s", privacy="summaries_only")
    p0 = prompts[0]
    a.publish(0, [summary(p0, 0)])
    s.publish(0, [summary(p0, 1)])
    assert code_of(lambda: s.upload(record(p0, 1, "s"), 0))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert list(a.get_matches(0, 5.0).offers) == []
    a.close()
    s.close()


def test_upload_chunk_checks(broker, prompts):
    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1)])
    data = encode_bundle(record(prompts[0], 1))

    def send(chunks):
        return a.stub.UploadBundle(iter(chunks), timeout=5)

    good = dict(digest=digest_of(data), total_size=len(data), node_id="a", session_id=a.session,
                prompt_id=prompts[0].id, round=0, tag=new_tag())  # refused uploads may be retried with one tag
    assert code_of(lambda: send([pb.BundleChunk(offset=0, data=data[:-1], **{**good, "total_size": len(data) - 1})]))[
        0] == grpc.StatusCode.INVALID_ARGUMENT  # bytes do not hash to the digest
    assert code_of(lambda: send([pb.BundleChunk(offset=5, data=data, **good)]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: send([]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    huge = pb.BundleChunk(offset=0, data=b"x", **{**good, "total_size": 10 * 2**30})
    assert code_of(lambda: send([huge]))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    # only the last chunk may be small (a trickle of tiny chunks would hold a broker thread)
    code, details = code_of(lambda: send([pb.BundleChunk(offset=0, data=data[:10], **good),
                                          pb.BundleChunk(offset=10, data=data[10:], **good)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at least" in details
    assert send([pb.BundleChunk(offset=0, data=data, **good)]).stored
    a.close()


def test_metrics_and_healthz(broker, prompts):
    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1)])
    base = f"http://127.0.0.1:{broker.http_port}"
    assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    assert 'graft_fed_nodes{state="online"} 1' in text
    assert "graft_fed_summaries_total 1" in text
    assert 'graft_fed_rpc_total{method="PublishSummaries",code="OK"} 1' in text
    memory = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("graft_fed_broker_memory_bytes{")}
    assert memory["sqlite"] >= 0 and memory["resident_anon"] > 0  # (this broker's state is in memory)
    assert float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("graft_fed_process_threads "))) >= 2
    a.close()


def test_metrics_say_how_the_state_checkpoints(prompt_file, prompts, tmp_path):
    """A SQLite state's checkpointer on /metrics: the WAL's size, checkpoints run and failed,
    whether the thread runs (an operator alerts on failures rising or the thread gone)."""
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.server import render_metrics
    from graft_fed.broker.servicer import BrokerServicer
    from graft_fed.broker.state_sqlite import SqliteState

    state = SqliteState(tmp_path / "b.db")
    fed = Federation(broker_config(prompt_file), state)
    servicer = BrokerServicer(fed)
    try:
        with state._tx() as conn:  # 100 KB into the WAL
            conn.execute("CREATE TABLE pad (b BLOB)")
            conn.execute("INSERT INTO pad VALUES (?)", (bytes(100_000),))
        state.checkpointer.failures = 2
        values = {line.split()[0]: float(line.split()[1]) for line in render_metrics(fed, servicer).splitlines()
                  if line.startswith("graft_fed_state_")}
        assert values["graft_fed_state_wal_bytes"] == state.checkpointer.wal_bytes() > 100_000
        assert values["graft_fed_state_checkpoints_total"] == state.checkpointer.runs
        assert values["graft_fed_state_wal_truncations_total"] == state.checkpointer.truncations
        assert values["graft_fed_state_checkpoint_failures_total"] == 2
        assert values["graft_fed_state_checkpointer_up"] == 1
        state.checkpointer.stop()  # as if the thread had died
        assert "graft_fed_state_checkpointer_up 0" in render_metrics(fed, servicer).splitlines()
    finally:
        state.close()


def test_a_call_that_asks_gets_the_brokers_timing_in_its_trailers(broker, prompts):
    a = client(broker, prompts, "a")
    heartbeat = pb.HeartbeatRequest(node_id="a", session_id=a.session, round=0, tag=new_tag())
    sent = time.time()
    _, call = a.stub.Heartbeat.with_call(heartbeat, timeout=5, metadata=((TIMING_KEY, "1"),))
    picked, entered, left = parse_timing(call.trailing_metadata())
    assert sent - 1 <= picked <= entered <= left <= time.time() + 1
    _, call = a.stub.Heartbeat.with_call(pb.HeartbeatRequest(node_id="a", session_id=a.session, round=0,
                                                            tag=new_tag()), timeout=5)
    assert parse_timing(call.trailing_metadata()) is None  # only calls that ask
    a.close()


def test_every_method_is_taken_by_a_call_request_of_its_own_and_others_are_unimplemented(broker, prompts):
    """grpcio's serving thread takes a generic handler's calls one at a time, all methods
    in one line: a heartbeat would wait behind every publish of a burst. The broker
    registers each method instead (servicer.add_to_server); a method it lacks is still
    answered UNIMPLEMENTED, and the registered ones serve (a join, a heartbeat)."""
    from graft_fed.broker.servicer import METHODS, SERVICE

    if broker.grpc is not None:  # gRPC in the broker; the front (an aio server) takes calls itself
        assert set(broker.grpc._state.registered_method_handlers) == {f"/{SERVICE}/{m}" for m in METHODS}
    a = client(broker, prompts, "a")
    a.stub.Heartbeat(pb.HeartbeatRequest(node_id="a", session_id=a.session, round=0, tag=new_tag()), timeout=5)
    with grpc.insecure_channel(broker.address) as channel:
        for method in (f"/{SERVICE}/NoSuchMethod", "/graft_fed.v1.Other/Heartbeat"):
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(method)(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
    a.close()


def test_a_late_joiner_learns_from_a_departed_peers_stored_groups(broker, prompts):
    b = client(broker, prompts, "b")
    p0 = prompts[0]
    b.publish(0, [summary(p0, 1)])
    rec = record(p0, 1, model="b")
    digest, _ = b.upload(rec, 0)
    assert b.get_matches(0, 5.0).ready  # round 0 is matched with b alone
    b.leave()
    b.close()
    late = client(broker, prompts, "late")
    late.publish(0, [summary(p0, 0)])  # it failed p0 entirely in round 0
    offers = late.get_matches(0, 5.0).offers
    assert [(o.prompt_id, o.source_node, o.digest) for o in offers] == [(p0.id, "b", digest)]
    assert late.fetch(digest) == rec
    st = {n.node_id: n.state for n in late.status().nodes}
    assert st == {"b": "left", "late": "online"}
    late.close()


def test_a_lying_source_is_quarantined_and_the_operator_can_release_it(prompt_file, prompts, tmp_path):
    from graft_fed.broker.auth import Allowlist

    allow = tmp_path / "allow.yaml"
    Allowlist.edit(allow, "add", "a")
    Allowlist.edit(allow, "add", "liar")
    broker = start_broker(broker_config(prompt_file, allowlist=str(allow), quarantine_min_reports=4, quarantine_min_receivers=1,
                                        quarantine_rejection_rate=0.5, balance="none"))
    try:
        a, liar = client(broker, prompts, "a"), client(broker, prompts, "liar")
        liar.publish(0, [summary(p, 1) for p in prompts[:4]])
        a.publish(0, [summary(p, 0) for p in prompts[:4]])
        for p in prompts[:3]:  # record(): claimed rewards that re-verification disagrees with
            liar.upload(record(p, 1, "liar"), 0)
        offered = a.get_matches(0, 5.0).offers
        assert sorted((o.source_node, o.prompt_id) for o in offered) == sorted(("liar", p.id) for p in prompts[:4])
        # nobody can report on a group it was not matched to (e.g. invent rejections of an honest source)
        made_up = [pb.CompatibilityReport.Entry(source_node_id="liar", prompt_id=p.id, rejected=True)
                   for p in prompts[4:8]]
        code, details = code_of(lambda: a.report(0, made_up))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "was not matched" in details
        wrong_round = [pb.CompatibilityReport.Entry(source_node_id="liar", prompt_id=prompts[0].id, rejected=True)]
        code, _ = code_of(lambda: a.report(1, wrong_round))  # the right group, in another round
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert {n.node_id: n.state for n in a.status().nodes}["liar"] == "online"
        bad = [pb.CompatibilityReport.Entry(source_node_id="liar", prompt_id=p.id, rejected=True) for p in prompts[:3]]
        good = [pb.CompatibilityReport.Entry(source_node_id="liar", prompt_id=prompts[3].id, mean_s=0.9,
                                             admitted_fraction=1.0)]
        a.report(0, bad + good)  # 3 of the 4 groups it received failed re-verification
        assert {n.node_id: n.state for n in a.status().nodes}["liar"] == "quarantined"
        liar.publish(1, [summary(prompts[0], 1, round=1), summary(prompts[1], 0, round=1)])
        a.publish(1, [summary(prompts[0], 0, round=1), summary(prompts[1], 1, round=1)])
        assert list(a.get_matches(1, 5.0).offers) == []  # never matched as a source
        code, details = code_of(lambda: liar.upload(record(prompts[0], 1, "liar"), 0))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "quarantined" in details
        Allowlist.edit(allow, "release", "liar")
        assert {n.node_id: n.state for n in a.status().nodes}["liar"] == "online"
        assert liar.upload(record(prompts[3], 1, "liar"), 0)[1]
        a.close()
        liar.close()
    finally:
        broker.stop()


def test_rate_limit_and_storage_quota(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, max_publishes_per_s=1.0, max_node_bundle_mib=0))
    try:
        a = client(broker, prompts, "a")
        codes = []
        for i in range(6):  # burst of 4, then refused until tokens refill
            try:
                a.publish(i, [summary(prompts[0], 1, round=i)])
                codes.append("ok")
            except FederationError as exc:
                codes.append(grpc.StatusCode[exc.status])
        assert codes[:4] == ["ok"] * 4 and grpc.StatusCode.RESOURCE_EXHAUSTED in codes[4:]
        a.close()
    finally:
        broker.stop()
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.state_memory import InMemoryState

    from graft_fed.federation.errors import ResourceExhausted

    fed = Federation(broker_config(prompt_file, max_node_bundle_mib=1), InMemoryState())
    session, _ = fed.join("a", "a", "tok", manifest(prompts), "share_all", 0)
    fed.state.bundle_bytes_held = lambda node: 2**20  # as if it had already uploaded its whole quota
    with pytest.raises(ResourceExhausted, match="quota"):
        fed.put_bundle("a", session, prompts[0].id, 0, "0" * 64, b"x")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_receiver_waiting_for_bundles_is_woken_by_the_upload_not_by_polling(prompt_file, prompts, mode):
    """GetMatches with wait_for_bundles answers as soon as the offered bundle arrives (the
    source uploads it while the receiver waits), and at the deadline without it; in either
    mode (each waits on its own wake-up key, wakeups.bundles_key)."""
    import threading
    import time

    broker = start_broker(broker_config(prompt_file, mode=mode))
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    p0, p1 = prompts[0], prompts[1]
    a.publish(0, [summary(p0, 0), summary(p1, 1)])
    b.publish(0, [summary(p0, 1), summary(p1, 0)])
    first = a.get_matches(0, 5.0)
    assert first.ready and [o.digest for o in first.offers] == [""]  # b has not uploaded yet
    t0 = time.monotonic()
    assert not a.get_matches(0, 0.5, wait_for_bundles=True).offers[0].digest  # the wait ends empty-handed
    assert time.monotonic() - t0 >= 0.45
    uploader = threading.Timer(0.5, lambda: b.upload(record(p0, 1, model="b"), 0))
    t0 = time.monotonic()  # before the timer starts: the upload cannot come sooner than 0.5 s after
    uploader.start()
    got = a.get_matches(0, 20.0, wait_for_bundles=True)
    waited = time.monotonic() - t0
    uploader.join()
    assert got.offers[0].digest and 0.49 <= waited < 10.0  # woken by the upload, long before 20 s
    assert a.fetch(got.offers[0].digest).prompt_id == p0.id
    a.close()
    b.close()
    broker.stop()
