"""Hostile peers and hostile bytes (issue 12): one test per class of what an external
client written from the .proto alone found, and their neighbours.

1. INTERNAL for client errors     2. accepted although wrong or too big
4. stalling the federation        5. framing an honest node        6. confidentiality
(3, poisoning a receiver, is tested where the receiver's defences live: tests/core/test_screening.py.)
"""

import dataclasses
import json
import math
import os
import threading
import time

import grpc
import pytest

from graft_fed.broker.auth import Allowlist
from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.federation import certs
from graft_fed.federation.bundles import decode_bundle, digest_of, encode_bundle
from graft_fed.federation.codec import manifest_to_pb
from graft_fed.node import client as client_module
from graft_fed.node.client import BrokerClient, new_tag
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker, tls_client
from tests.federation.test_broker_rpc import client, code_of, manifest, record, summary

BAD = 2**63  # the first integer a signed 64-bit column cannot hold
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}


@pytest.fixture()
def pki(tmp_path):
    return certs.loopback_pki(tmp_path / "certs", "test", ("alice", "bob", "mallory", "outsider"))


def raw_unary(channel, method):
    return channel.unary_unary(f"/graft_fed.v1.Broker/{method}", request_serializer=None,
                               response_deserializer=None)


def status_of(fn):
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


# ------------------------------------------------------------------ 1. INTERNAL for client errors

def test_integers_beyond_int64_are_invalid_argument_everywhere(broker, prompts):
    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1)])
    before = sorted((n.node_id, n.round) for n in broker.state.list_nodes())
    s = a.stub
    join = pb.JoinRequest(node_id="z", model_id="m", tokenizer_id="t", manifest=manifest_to_pb(manifest(prompts)),
                          privacy=pb.PRIVACY_SHARE_ALL, resume_round=BAD, tag=new_tag())
    bad_summary = summary(prompts[1], 1)
    bad_summary.policy_version = 2**64 - 1
    calls = {
        "Join resume_round": lambda: s.Join(join, timeout=5),
        "Heartbeat round": lambda: s.Heartbeat(pb.HeartbeatRequest(node_id="a", session_id=a.session, round=BAD,
                                                                   tag=new_tag()), timeout=5),
        "Publish round": lambda: s.PublishSummaries(pb.PublishRequest(
            node_id="a", session_id=a.session, round=BAD, summaries=[summary(prompts[1], 1, round=0)],
            tag=new_tag()), timeout=5),
        "Publish policy_version": lambda: s.PublishSummaries(pb.PublishRequest(
            node_id="a", session_id=a.session, round=0, summaries=[bad_summary], tag=new_tag()), timeout=5),
        "GetMatches round": lambda: s.GetMatches(pb.MatchRequest(node_id="a", session_id=a.session, round=BAD,
                                                                 wait_ms=10), timeout=5),
        "Report round": lambda: s.ReportCompatibility(pb.CompatibilityReport(
            node_id="a", session_id=a.session, round=BAD, tag=new_tag()), timeout=5),
        "tag sent_at_ms": lambda: s.Heartbeat(pb.HeartbeatRequest(node_id="a", session_id=a.session, round=1,
                                                                  tag=pb.RequestTag(request_id="x" * 32,
                                                                                    sent_at_ms=2**64 - 1)), timeout=5),
        "Upload round": lambda: s.UploadBundle(iter([pb.BundleChunk(
            digest="0" * 64, total_size=1, offset=0, data=b"x", node_id="a", session_id=a.session,
            prompt_id=prompts[0].id, round=BAD, tag=new_tag())]), timeout=5),
        "Upload offset": lambda: s.UploadBundle(iter([pb.BundleChunk(
            digest="0" * 64, total_size=1, offset=2**64 - 1, data=b"x", node_id="a", session_id=a.session,
            prompt_id=prompts[0].id, round=0, tag=new_tag())]), timeout=5),
    }
    for what, call in calls.items():
        code, details = status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
        assert "64-bit" in details or "int64" in details or "range" in details, (what, details)
    assert sorted((n.node_id, n.round) for n in broker.state.list_nodes()) == before
    a.close()


UNPARSEABLE = [
    b"\xff\xff\xff",  # a field tag that is not a valid varint
    b"\x0a\x05ab",  # a length-delimited field cut short
    b"\x0a\x02\xff\xfe",  # field 1 (a string in every request) that is not UTF-8
    b"\x08",  # a varint field with no value
    b"\x0b",  # a start-group with no end
    b"\x0a\x80\x80\x80\x80\x10",  # a length beyond the message
]


def test_bytes_that_do_not_parse_are_invalid_argument_for_every_rpc(broker, prompts):
    a = client(broker, prompts, "a")
    ch = a.channel
    unary = ["Join", "Leave", "Heartbeat", "PublishSummaries", "GetMatches", "HasBundles", "ReportCompatibility",
             "GetStatus"]
    nested = b"\x22\x80\x01" + b"\x22\x7e" * 1  # a submessage that is itself cut short
    for method in unary:
        for data in UNPARSEABLE + [nested]:
            code, details = status_of(lambda: raw_unary(ch, method)(data, timeout=5))
            if method == "GetStatus" and code == grpc.StatusCode.OK:
                continue  # StatusRequest has no fields: unknown fields are ignored, as protobuf does
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, data, code, details)
            assert "does not parse" in details
    fetch = ch.unary_stream("/graft_fed.v1.Broker/FetchBundle", request_serializer=None, response_deserializer=None)
    upload = ch.stream_unary("/graft_fed.v1.Broker/UploadBundle", request_serializer=None, response_deserializer=None)
    for data in UNPARSEABLE:
        assert status_of(lambda: list(fetch(data, timeout=5)))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(lambda: upload(iter([data]), timeout=5))[0] == grpc.StatusCode.INVALID_ARGUMENT
        good = pb.BundleChunk(digest="0" * 64, total_size=2, offset=0, data=b"x", node_id="a", session_id=a.session,
                              prompt_id=prompts[0].id, round=0, tag=new_tag()).SerializeToString()
        assert status_of(lambda: upload(iter([good, data]), timeout=5))[0] == grpc.StatusCode.INVALID_ARGUMENT
    a.close()


@pytest.mark.parametrize("payload", [
    b"[" * 300_000 + b"]" * 300_000,  # nesting hundreds of thousands deep
    b'{"prompt_id":' + b"9" * 5000 + b"}",  # an integer of thousands of digits
    b'{"step":1e999}',  # a number beyond the double range
    b'{"step":NaN}',
    b'{"a":' * 20 + b"1" + b"}" * 20,
    b"\xc3\x28",  # not UTF-8
])
def test_pathological_bundle_json_is_refused_by_broker_and_receiver(broker, prompts, payload):
    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1)])
    digest = digest_of(payload)
    code, details = code_of(lambda: a._upload_bytes(payload, digest, prompts[0].id, 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert len(details) < 1100
    with pytest.raises(RecordError):  # a receiver decodes with the same bounds (a hostile broker's bytes)
        decode_bundle(payload, digest)
    a.close()


def test_record_fields_that_are_not_what_they_claim_are_record_errors():
    base = encode_bundle(record(load_prompts(DataConfig())[0], 1))
    d = json.loads(base)
    for field, value in [("step", "3"), ("step", 2**70), ("step", 1.5), ("lengths", [3, True]),
                         ("rewards", ["1", 0]), ("advantages", [1e300, -1e300]), ("mean_logprobs", [-1e6, -0.5]),
                         ("texts", "xy"), ("rewards", [0.0] * 5000), ("texts", ["\ud800", "y"]),
                         ("problem", 12), ("prompt_id", None)]:
        bad = json.dumps({**d, field: value}).encode()
        with pytest.raises(RecordError):
            decode_bundle(bad, digest_of(bad))


def test_an_upload_refused_inside_its_stream_is_permission_denied_not_internal(pki, prompt_file, prompts, tmp_path):
    allow = tmp_path / "allow.yaml"
    for name in ("alice", "mallory"):
        Allowlist.edit(allow, "add", name)
    broker = start_broker(broker_config(prompt_file, tls_cert=str(pki / "broker.pem"), tls_key=str(pki / "broker.key"),
                                        client_ca=str(pki / "ca.pem"), allowlist=str(allow)))
    try:
        alice = tls_client(pki, broker.address, "alice")
        alice.join("alice", "tok", manifest(prompts), "share_all", 0)
        alice.publish(0, [summary(prompts[0], 1)])
        data = encode_bundle(record(prompts[0], 1, "alice"))
        mallory = tls_client(pki, broker.address, "mallory")

        def chunks(node, session):
            return iter([pb.BundleChunk(digest=digest_of(data), total_size=len(data), offset=0, data=data,
                                        node_id=node, session_id=session, prompt_id=prompts[0].id, round=0,
                                        tag=new_tag())])
        # mallory uploads as alice (a certificate that is not alice's)
        code, details = status_of(lambda: mallory.stub.UploadBundle(chunks("alice", alice.session), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "cannot act as node 'alice'" in details
        # a second chunk that changes the node mid-stream
        good = next(chunks("alice", alice.session))
        evil = pb.BundleChunk(digest=good.digest, total_size=good.total_size, offset=len(data), data=b"",
                              node_id="mallory", session_id="s", prompt_id=prompts[0].id, round=0)
        code, _ = status_of(lambda: alice.stub.UploadBundle(iter([good, evil]), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # revoked between two uploads: the next stream is refused in-stream, as PERMISSION_DENIED
        Allowlist.edit(allow, "revoke", "alice")
        code, details = status_of(lambda: alice.stub.UploadBundle(chunks("alice", alice.session), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "revoked" in details
        assert broker.state.bundle_stats() == (0, 0)
        alice.close()
        mallory.close()
    finally:
        broker.stop()


# ------------------------------------------------------------------ 2. accepted although wrong or too big

def test_oversized_fields_are_refused_and_never_echoed(broker, prompts):
    c = BrokerClient(broker.address, "x", max_message_mib=16)
    huge_tok = pb.JoinRequest(node_id="x", model_id="m", tokenizer_id="t" * (8 * 2**20),
                              manifest=manifest_to_pb(manifest(prompts)), privacy=pb.PRIVACY_SHARE_ALL, tag=new_tag())
    code, details = status_of(lambda: c.stub.Join(huge_tok, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 1100
    m = manifest_to_pb(manifest(prompts))
    m.dataset_id = "d" * (4 * 2**20)
    code, details = status_of(lambda: c.stub.Join(pb.JoinRequest(node_id="x", model_id="m", tokenizer_id="t",
                                                                 manifest=m, privacy=1, tag=new_tag()), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 1100
    # within the uniform bound but different: the mismatch is named, the value quoted by a prefix only
    m.dataset_id = "d" * 1000
    code, details = status_of(lambda: c.stub.Join(pb.JoinRequest(node_id="x", model_id="m", tokenizer_id="t",
                                                                 manifest=m, privacy=1, tag=new_tag()), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "dataset_id" in details and len(details) < 600
    for bad_id in ("m\x9b31m", "m\u200e", "m\x00"):  # a C1 escape, a format character, NUL
        code, _ = status_of(lambda: c.stub.Join(pb.JoinRequest(
            node_id="x", model_id=bad_id, tokenizer_id="t", manifest=manifest_to_pb(manifest(prompts)), privacy=1,
            tag=new_tag()), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad_id
    code, _ = status_of(lambda: c.stub.Join(pb.JoinRequest(
        node_id="x", model_id="m", tokenizer_id="t" * 2000, manifest=manifest_to_pb(manifest(prompts)), privacy=1,
        tag=new_tag()), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert broker.state.list_nodes() == []
    c.close()


def test_claimed_numbers_must_agree_with_each_other(broker, prompts):
    a = client(broker, prompts, "a")
    lying_std = summary(prompts[0], 1)
    lying_std.reward_std = 5.0  # k=1 of n=2: the std is sqrt(1/2) (sample) or 1/2 (population)
    code, details = code_of(lambda: a.publish(0, [lying_std]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "reward_std" in details
    zero = summary(prompts[0], 0)
    zero.reward_std = 0.3
    assert code_of(lambda: a.publish(0, [zero]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    population = summary(prompts[0], 1)
    population.reward_std = 0.5
    assert a.publish(0, [population]) == (1, 0)  # the population std is accepted too
    dangling = summary(prompts[1], 1)
    dangling.bundle_digest = "a" * 64  # a digest of bytes the broker does not hold
    code, details = code_of(lambda: a.publish(0, [dangling]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bundle_digest" in details
    absurd = summary(prompts[1], 1)
    absurd.mean_logprobs[:] = [-1e6, -0.5]
    assert code_of(lambda: a.publish(0, [absurd]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # a bundle whose lengths or step differ from the summary it claims to hold
    rec = dataclasses.replace(record(prompts[0], 1), lengths=(30, 40))
    code, details = code_of(lambda: a.upload(rec, 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lengths" in details
    rec = dataclasses.replace(record(prompts[0], 1), step=7)
    assert code_of(lambda: a.upload(rec, 0))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert broker.state.bundle_stats() == (0, 0)
    a.close()


def test_a_huge_report_is_refused_at_once_and_heartbeats_go_on(broker, prompts):
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    a.publish(0, [summary(prompts[0], 0)])
    b.publish(0, [summary(prompts[0], 1)])
    assert a.get_matches(0, 5.0).ready
    entries = [pb.CompatibilityReport.Entry(source_node_id="b", prompt_id=prompts[0].id, mean_s=0.5,
                                            admitted_fraction=1.0)] * 300_000
    for n in (300_000, 5000, 4 * 8 + 1):  # beyond the uniform bound, then beyond 4 x prompts_per_round
        # the request built before the clock starts: the client's own work on 300,000 entries
        # is not the broker's, and took seconds of its own on a loaded machine
        req = pb.CompatibilityReport(node_id="a", session_id=a.session, round=0, entries=entries[:n], tag=new_tag())
        t0 = time.perf_counter()
        code, details = code_of(lambda: a.stub.ReportCompatibility(req, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "entries" in details, (n, details)
        assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    b.stub.Heartbeat(pb.HeartbeatRequest(node_id="b", session_id=b.session, round=0, tag=new_tag()), timeout=5)
    assert time.perf_counter() - t0 < 2.0
    assert broker.state.reports() == []
    a.close()
    b.close()


def test_a_report_without_a_live_session_is_told_to_join_whatever_else_is_wrong(broker, prompts):
    a = client(broker, prompts, "a")
    bad = [pb.CompatibilityReport.Entry(source_node_id="b", prompt_id=prompts[0].id, mean_s=float("nan"),
                                        admitted_fraction=2.0)] * 2  # out of range, and twice
    for session in ("", "not-" + a.session):
        code, details = code_of(lambda: a.stub.ReportCompatibility(pb.CompatibilityReport(
            node_id="a", session_id=session, round=0, entries=bad, tag=new_tag()), timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Join" in details, details
    # with its session, the same report is refused for its content
    code, details = code_of(lambda: a.report(0, bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert broker.state.reports() == []
    a.close()


# ------------------------------------------------------------------ 4. stalling the federation

def test_a_node_claiming_a_far_round_does_not_stall_synchronous_rounds(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, round_deadline_s=30.0))
    try:
        a, b, m = (client(broker, prompts, n) for n in ("a", "b", "mallory"))
        for far in (10**12, 2**63 - 1):
            m.stub.Heartbeat(pb.HeartbeatRequest(node_id="mallory", session_id=m.session, round=far, tag=new_tag()),
                             timeout=5)
        assert broker.state.get_node("mallory").round <= broker.fed.current_round() + 1000
        a.publish(0, [summary(prompts[0], 0)])
        b.publish(0, [summary(prompts[0], 1)])
        t0 = time.perf_counter()
        assert a.get_matches(0, 10.0).ready  # not waiting for mallory until the 30 s deadline
        assert time.perf_counter() - t0 < 5.0
        # a node one round behind (working on it) is still waited for, one ahead is not
        m.stub.Heartbeat(pb.HeartbeatRequest(node_id="mallory", session_id=m.session, round=0, tag=new_tag()),
                         timeout=5)
        for x in (a, b, m):
            x.close()
    finally:
        broker.stop()


def _heartbeat(c, name, round):
    c.stub.Heartbeat(pb.HeartbeatRequest(node_id=name, session_id=c.session, round=round, tag=new_tag()), timeout=5)


def test_nodes_that_reach_a_round_a_node_ahead_sealed_are_matched_together(prompt_file, prompts):
    # a and b work on round 0; mallory publishes round 2 and asks for its matches at once: no
    # node is at round 2 or one behind it, so round 2 is ready and matched with mallory alone
    # (as it is for an honest node running ahead). When a and b get there, they are matched
    # late (match_one), but the first to ask waits for the other online node near the round,
    # as a round does: before, each was matched at once on its own, and a, asking first,
    # received nothing from b (every round a node runs ahead of, with min_nodes above 1 too,
    # once the round's deadline from its publish had passed)
    broker = start_broker(broker_config(prompt_file, round_deadline_s=30.0))
    try:
        a, b, m = (client(broker, prompts, n) for n in ("a", "b", "mallory"))
        m.publish(2, [summary(prompts[5], 0, round=2)])
        m.get_matches(2, 1.0)
        for c, name in ((a, "a"), (b, "b")):  # a and b reach round 1, then round 2
            _heartbeat(c, name, 1)
        a.publish(2, [summary(prompts[0], 0, round=2), summary(prompts[1], 1, round=2)])
        # a asks as soon as it has published, as a node does: b (online, one round behind)
        # has not published yet, so the round must not be ready for a (it was: matched late,
        # alone, with nothing from b)
        assert not a.get_matches(2, 1.0).ready
        b.publish(2, [summary(prompts[0], 1, round=2), summary(prompts[1], 0, round=2)])
        got = a.get_matches(2, 10.0)
        assert got.ready and [(o.source_node, o.prompt_id) for o in got.offers] == [("b", prompts[0].id)]
        for x in (a, b, m):
            x.close()
    finally:
        broker.stop()


def test_late_nodes_wait_for_each_other_at_most_the_round_deadline(prompt_file, prompts):
    # as above, but b never publishes round 2: a waits for it as a round would, then is
    # matched on what is there once round_deadline_s has passed since it asked
    broker = start_broker(broker_config(prompt_file, round_deadline_s=1.0))
    try:
        a, b, m = (client(broker, prompts, n) for n in ("a", "b", "mallory"))
        m.publish(2, [summary(prompts[5], 0, round=2)])
        assert m.get_matches(2, 5.0).ready
        for c, name in ((a, "a"), (b, "b")):
            _heartbeat(c, name, 1)
        a.publish(2, [summary(prompts[0], 0, round=2), summary(prompts[1], 1, round=2)])
        t0 = time.monotonic()
        got = a.get_matches(2, 10.0)
        assert got.ready and not got.offers
        assert time.monotonic() - t0 >= 0.9  # it waited for b (the round's deadline, not the call's)
        for x in (a, b, m):
            x.close()
    finally:
        broker.stop()


def test_long_polls_are_bounded_per_node_and_heartbeats_are_served(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, min_nodes=3, round_deadline_s=60.0))
    try:
        m, h = client(broker, prompts, "mallory"), client(broker, prompts, "honest")
        m.publish(0, [summary(prompts[0], 1)])
        codes: list = []
        lock = threading.Lock()

        def poll():
            code, _ = status_of(lambda: m.stub.GetMatches(pb.MatchRequest(node_id="mallory", session_id=m.session,
                                                                          round=0, wait_ms=10_000), timeout=30))
            with lock:
                codes.append(code)
        threads = [threading.Thread(target=poll) for _ in range(80)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        for _ in range(5):
            h.stub.Heartbeat(pb.HeartbeatRequest(node_id="honest", session_id=h.session, round=0, tag=new_tag()),
                             timeout=8)
        # answered while the admitted long-polls still wait (the round cannot complete: they
        # return only at their 10 s): heartbeats do not queue behind them (an order, not a speed)
        still_waiting = sum(t.is_alive() for t in threads)
        for t in threads:
            t.join()
        assert still_waiting >= 1, "every long-poll had returned before the heartbeats were answered"
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 78
        assert codes.count(grpc.StatusCode.OK) <= 2 and not set(codes) & SERVER_FAULTS
        m.close()
        h.close()
    finally:
        broker.stop()


# ------------------------------------------------------------------ 5. framing an honest node

def test_a_node_id_held_by_its_secret_cannot_be_taken_over(prompt_file, prompts, broker):
    """Without mutual TLS, anyone who could reach the broker took a node id over by joining
    under it: the honest node's session ended, and what was published next under its name
    was the taker's (its lies counted against the honest node). The first Join carrying a
    node secret now holds the id; another secret, or none, is refused and changes nothing."""
    honest = BrokerClient(broker.address, "alice")
    honest.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="s" * 64)
    honest.publish(0, [summary(prompts[0], 1)])
    session = honest.session
    for taker_secret in ("m" * 64, ""):
        taker = BrokerClient(broker.address, "alice")
        code, details = code_of(lambda: taker.join("alice", "tok", manifest(prompts), "share_all", 0,
                                                   node_secret=taker_secret))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "held by another node" in details, details
        taker.close()
    assert broker.state.get_node("alice").session_id == session  # the honest session goes on
    honest.publish(0, [summary(prompts[1], 1)])
    again = BrokerClient(broker.address, "alice")  # the same node, restarted: its secret from its folder
    again.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="s" * 64)
    assert broker.state.get_node("alice").session_id == again.session
    assert broker.state.node_secret("alice") != "s" * 64  # a hash is kept, not the secret
    # a node id nobody has claimed with a secret is open, as before (clients that send none)
    for c in (client(broker, prompts, "bob"), client(broker, prompts, "bob")):
        c.close()
    for c in (honest, again):
        c.close()


def test_the_operator_gives_a_taken_node_id_back_and_the_taker_cannot_join_again_first(prompts, broker):
    """A node id never joined with a secret (a node of an older client) is held by whichever
    Join brings one first: a taker locks the honest node out. `graft-fed broker forget-secret`
    ends the session under the id, but a taker that is online joins again first (shown
    below); `--hold-for` the honest node's secret hash hands the id to that node alone.
    Making forget keep the taker's session, or hold_for leave the hash unset, fails it."""
    from graft_fed.federation.nodesecret import secret_hash

    old = BrokerClient(broker.address, "alice")
    old.join("alice", "tok", manifest(prompts), "share_all", 0)  # an older client: no secret
    taker = BrokerClient(broker.address, "alice")
    taker.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="m" * 64)
    honest = BrokerClient(broker.address, "alice")
    code, _ = code_of(lambda: honest.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="s" * 64))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    publish = lambda c, i: c.publish(0, [summary(prompts[i], 1)])  # noqa: E731

    said = broker.fed.forget_secret("alice")
    assert "no longer held" in said and "session is ended" in said, said
    assert code_of(lambda: publish(taker, 0))[0] == grpc.StatusCode.UNAUTHENTICATED
    taker.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="m" * 64)  # first again

    said = broker.fed.forget_secret("alice", {"hold_for": secret_hash("s" * 64).upper()})
    assert "held for the node whose secret hashes to" in said and "session is ended" in said, said
    assert code_of(lambda: publish(taker, 1))[0] == grpc.StatusCode.UNAUTHENTICATED
    for secret in ("m" * 64, ""):
        code, _ = code_of(lambda: taker.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret=secret))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    honest.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="s" * 64)
    publish(honest, 2)
    assert broker.state.get_node("alice").session_id == honest.session
    assert broker.fed.registry.get("alice").state == "online"
    # applied again (a retried command, a request that waited): nothing changes, nothing ends
    said = broker.fed.forget_secret("alice", {"hold_for": secret_hash("s" * 64)})
    assert "already held" in said and "session" not in said, said
    publish(honest, 3)

    # an id held for a node before its first Join; a bad hash or option changes nothing
    said = broker.fed.forget_secret("carol", {"hold_for": secret_hash("c" * 64)})
    assert "no node has joined under this id" in said, said  # a mistyped id reads otherwise than a taken one
    carol = BrokerClient(broker.address, "carol")
    for secret in ("d" * 64, ""):
        code, _ = code_of(lambda: carol.join("carol", "tok", manifest(prompts), "share_all", 0, node_secret=secret))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    carol.join("carol", "tok", manifest(prompts), "share_all", 0, node_secret="c" * 64)
    with pytest.raises(ValueError, match="64 hexadecimal digits.*--print-secret-hash"):
        broker.fed.forget_secret("alice", {"hold_for": "not a hash"})
    with pytest.raises(ValueError, match="takes the option hold_for, not 'keep'"):
        broker.fed.forget_secret("alice", {"keep": "x"})
    assert broker.state.node_secret("alice") == secret_hash("s" * 64)
    assert broker.state.get_node("alice").session_id == honest.session
    for c in (old, taker, honest, carol):
        c.close()


def _verified_record(p, model):
    # tests.plugins:odd_char_sum scores "y" 1 and "x" 0: the claimed rewards (1, 0) verify
    return GroupRecord(prompt_id=p.id, step=0, model_id=model, tokenizer_id="tok", problem=p.problem,
                       answer=p.answer, rewards=(1.0, 0.0), advantages=(0.7071, -0.7071), texts=("y", "x"),
                       finish_reasons=("stop", "stop"), lengths=(3, 4), mean_logprobs=(-0.5, -0.25))


def _framing_round(broker, prompts, victim, receivers, upload, lying=False):
    victim.publish(0, [summary(p, 1) for p in prompts[:8]])
    for r in receivers:
        r.publish(0, [summary(p, 0) for p in prompts[:8]])
    if upload:
        for p in prompts[:8]:
            # record(): "x" claimed 1 and "y" 0, which re-verification scores the other way round
            victim.upload(record(p, 1, "victim") if lying else _verified_record(p, "victim"), 0)
    for r in receivers:
        assert len(r.get_matches(0, 5.0).offers) == 8
        r.report(0, [pb.CompatibilityReport.Entry(source_node_id="victim", prompt_id=p.id, rejected=True)
                     for p in prompts[:8]])


def test_one_receiver_cannot_quarantine_a_source_alone(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, balance="none"))
    try:
        victim, framer = client(broker, prompts, "victim"), client(broker, prompts, "framer")
        _framing_round(broker, prompts, victim, [framer], upload=False)
        assert "victim" not in broker.fed.quarantined()
        assert {n.node_id: n.state for n in framer.status().nodes}["victim"] != "quarantined"
        victim.close()
        framer.close()
    finally:
        broker.stop()


def test_rejections_from_several_receivers_still_quarantine(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, balance="none", quarantine_min_receivers=2))
    try:
        victim = client(broker, prompts, "victim")
        receivers = [client(broker, prompts, n) for n in ("r1", "r2")]
        # bundles whose claimed rewards do not verify: the rejections are founded
        _framing_round(broker, prompts, victim, receivers, upload=True, lying=True)
        assert broker.fed.quarantined() == {"victim"}
        assert broker.fed.counters["disputed_rejections"] == 0
        for x in (victim, *receivers):
            x.close()
    finally:
        broker.stop()


def test_a_source_cannot_dilute_its_rejections_by_withholding_groups(prompt_file, prompts):
    """A source that lies about 4 groups and never uploads the 8 others it is matched to:
    each receiver reports 4 rejected and 8 undelivered. Undelivered groups counted in the
    quarantine rate (4 of 12, under 0.5), so withholding as many groups as it lied about
    kept a liar out of quarantine for ever. They still make it the least compatible source
    (mean s 0), but the rate counts the groups received: 4 of 4."""
    broker = start_broker(broker_config(prompt_file, balance="none"))
    try:
        liar = client(broker, prompts, "liar")
        receivers = [client(broker, prompts, n) for n in ("r1", "r2")]
        liar.publish(0, [summary(p, 1) for p in prompts])
        for r in receivers:
            r.publish(0, [summary(p, 0) for p in prompts])
        for p in prompts[:4]:
            liar.upload(record(p, 1, "liar"), 0)  # claimed rewards that do not verify
        for r in receivers:
            assert len(r.get_matches(0, 5.0).offers) == 12
            r.report(0, [pb.CompatibilityReport.Entry(source_node_id="liar", prompt_id=p.id, rejected=True)
                         for p in prompts[:4]]
                     + [pb.CompatibilityReport.Entry(source_node_id="liar", prompt_id=p.id, undelivered=True)
                        for p in prompts[4:]])
        assert broker.fed.quarantined() == {"liar"}
        row = {(c.source, c.receiver): c for c in broker.state.compat()}[("liar", "r1")]
        assert (row.groups, row.undelivered, row.rejected, row.mean_s) == (8, 8, 4, 0.0)
        # an entry both undelivered and scored is refused whole
        code, details = code_of(lambda: receivers[0].report(0, [pb.CompatibilityReport.Entry(
            source_node_id="liar", prompt_id=prompts[0].id, mean_s=0.5, undelivered=True)]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "undelivered" in details
        for x in (liar, *receivers):
            x.close()
    finally:
        broker.stop()


def test_the_broker_rechecks_a_rejection_of_a_bundle_it_holds(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, balance="none", quarantine_min_receivers=1,
                                        quarantine_min_reports=4))
    try:
        victim = client(broker, prompts, "victim")
        receivers = [client(broker, prompts, n) for n in ("r1", "r2")]
        _framing_round(broker, prompts, victim, receivers, upload=True)
        assert broker.fed.quarantined() == set()
        assert broker.fed.counters["disputed_rejections"] == 16
        assert all(not r.rejected for r in broker.state.reports())
        from graft_fed.broker.server import render_metrics

        assert "graft_fed_disputed_rejections_total 16" in render_metrics(broker.fed, broker.servicer)
        for x in (victim, *receivers):
            x.close()
    finally:
        broker.stop()


def test_a_rejection_of_a_group_never_uploaded_is_not_counted(prompt_file, prompts):
    # two nodes (quarantine_min_receivers: 1, as config.py advises for two): the framer
    # reports the victim's groups rejected as soon as it is matched to them, before the
    # victim uploads any. It cannot have received them, so it cannot have re-verified them;
    # the broker, holding no bundle to re-check, counted every one and quarantined the victim
    broker = start_broker(broker_config(prompt_file, balance="none", quarantine_min_receivers=1,
                                        quarantine_min_reports=4))
    try:
        victim, framer = client(broker, prompts, "victim"), client(broker, prompts, "framer")
        _framing_round(broker, prompts, victim, [framer], upload=False)
        assert broker.fed.quarantined() == set()
        assert not any(r.rejected for r in broker.state.reports())
        assert all(c.rejected == 0 for c in broker.fed.compat())
        for x in (victim, framer):
            x.close()
    finally:
        broker.stop()


def test_a_bundle_too_big_for_the_receiver_is_undelivered_not_a_rejection_of_its_source(prompt_file, prompts,
                                                                                       caplog):
    """A broker that takes bundles larger than a receiver fetches (broker.max_bundle_mib above
    the node's federation.max_bundle_mib; here 2 and 1 MiB): an honest group the receiver
    cannot take is undelivered (s 0), not a rejection that quarantine counts against its
    source (here without the broker's recheck, which would dispute it)."""
    from graft_fed.federation.messages import ReportEntry
    from graft_fed.node.peers import fetch_offers

    broker = start_broker(broker_config(prompt_file, balance="none", max_bundle_mib=2, recheck_rejections=False,
                                        quarantine_min_receivers=1, quarantine_min_reports=1))
    try:
        source = client(broker, prompts, "source")
        receiver = BrokerClient(broker.address, "receiver", max_bundle_mib=1)
        with caplog.at_level("WARNING", logger="graft_fed.node"):
            receiver.join("receiver", "tok", manifest(prompts), "share_all", 0)
        # the node says at join that it fetches less than the broker stores
        assert "stores bundles of up to 2 MiB and this node fetches at most 1" in caplog.text
        source.publish(0, [summary(prompts[0], 1)])
        receiver.publish(0, [summary(prompts[0], 0)])
        # an honest group of 1.2 MiB: odd_char_sum scores the first response 1, the second 0
        big = dataclasses.replace(_verified_record(prompts[0], "source"), texts=("a" * 600_001, "a" * 600_000))
        digest, stored = source.upload(big, 0)
        assert stored
        offers = receiver.get_matches(0, 5.0).offers
        assert [(o.source_node, o.digest) for o in offers] == [("source", digest)]
        got = fetch_offers(receiver, offers, n=2)
        assert got.records == {} and got.bad == 1
        assert got.rejections == [ReportEntry("source", prompts[0].id, 0.0, 0.0, False, undelivered=True)]
        receiver.report(0, got.rejections)
        assert "source" not in broker.fed.quarantined()
        for c in (source, receiver):
            c.close()
    finally:
        broker.stop()


def test_a_refused_bundle_does_not_stop_the_nodes_other_uploads(broker, prompts, monkeypatch):
    """The broker refuses a bundle that does not match the summary the node published for its
    prompt (say, a resume that sampled the round again): that bundle only. The others still
    go, and the node learns how many of each (BundlesRefused, an INVALID_ARGUMENT)."""
    from graft_fed.federation.errors import PermissionDenied
    from graft_fed.node.client import BundlesRefused

    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1), summary(prompts[1], 1)])
    other = dataclasses.replace(record(prompts[0], 1), lengths=(5, 6))  # not the published summary
    good = record(prompts[1], 1)
    with pytest.raises(BundlesRefused, match="refused 1 of the 2 bundles") as info:
        a.upload_missing([(other, 0), (good, 0)])
    assert (info.value.sent, info.value.refused) == (1, 1)
    assert a.has_bundles([digest_of(encode_bundle(good)), digest_of(encode_bundle(other))]) == {
        digest_of(encode_bundle(good))}
    # quarantined meanwhile (the broker's answer, stood in for): PERMISSION_DENIED at once, with
    # what went and what was held back
    more = [record(prompts[i], 1) for i in (2, 3, 4)]
    a.publish(0, [summary(prompts[i], 1) for i in (2, 3, 4)])
    real = a._upload_bytes
    calls = []

    def upload_then_quarantined(*args):
        calls.append(args)
        if len(calls) == 2:
            raise PermissionDenied("node a is quarantined")
        return real(*args)

    a._upload_bytes = upload_then_quarantined
    with pytest.raises(PermissionDenied) as denied:
        a.upload_missing([(r, 0) for r in more])
    assert (denied.value.sent, denied.value.refused, len(calls)) == (1, 2, 2)
    # every bundle refused (a setting, not the bundles): it stops trying after the first few
    # (REFUSED_BEFORE_GIVING_UP, 16; 3 here)
    monkeypatch.setattr(client_module, "REFUSED_BEFORE_GIVING_UP", 3)
    tried = []
    a._upload_bytes = lambda *args: (tried.append(args), real(*args))[1]
    wrong = [(dataclasses.replace(record(p, 1), lengths=(5, 6)), 0) for p in prompts[5:12]]
    assert len(wrong) == 7
    a.publish(0, [summary(p, 1) for p in prompts[5:12]])
    with pytest.raises(BundlesRefused, match=r"refused 3 of the 3 bundles uploaded \(4 more not tried\)") as info:
        a.upload_missing(wrong)
    assert (info.value.sent, info.value.refused, len(tried)) == (0, 7, 3)
    a.close()


def test_a_bundle_larger_than_the_broker_stores_is_not_sent(prompt_file, prompts):
    """Join says how large a bundle the broker stores: a larger one is refused by the node
    itself (BundlesRefused) without the upload, which the broker would refuse as
    RESOURCE_EXHAUSTED, and which stopped the node's other uploads."""
    from graft_fed.node.client import BundlesRefused

    broker = start_broker(broker_config(prompt_file, max_bundle_mib=1))
    try:
        a = client(broker, prompts, "a")
        assert a.broker_max_bundle == 2**20
        a.publish(0, [summary(prompts[0], 1), summary(prompts[1], 1)])
        big = dataclasses.replace(_verified_record(prompts[0], "a"), texts=("a" * 600_001, "a" * 600_000))
        sent = []
        real = a._upload_bytes
        a._upload_bytes = lambda *args: (sent.append(args[2]), real(*args))[1]
        with pytest.raises(BundlesRefused, match="more than the broker stores") as info:
            a.upload_missing([(big, 0), (record(prompts[1], 1), 0)])
        assert (info.value.sent, info.value.refused) == (1, 1) and sent == [prompts[1].id]
        a.close()
    finally:
        broker.stop()


def test_a_node_asks_which_bundles_the_broker_holds_in_calls_it_takes(broker, prompts):
    """HasBundles may name at most MAX_DIGESTS_PER_CALL digests; a share_all node with more
    informative groups in a round asked for all at once, was refused (INVALID_ARGUMENT) and
    uploaded none of them."""
    from graft_fed.federation.limits import MAX_DIGESTS_PER_CALL

    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1)])
    digest, _ = a.upload(record(prompts[0], 1), 0)
    others = [f"{i:064x}" for i in range(MAX_DIGESTS_PER_CALL + 10)]
    assert a.has_bundles(others + [digest]) == {digest}
    a.close()


def test_quarantine_weighs_each_receiver_the_same(prompt_file, prompts):
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.state import ReportRow
    from graft_fed.broker.state_memory import InMemoryState

    fed = Federation(broker_config(prompt_file, quarantine_min_receivers=2, quarantine_min_reports=8), InMemoryState())
    rows = [ReportRow(0, "r1", "v", f"p{i}", 0.0, 0.0, True) for i in range(50)]  # one receiver, 50 rejections
    rows += [ReportRow(0, "r2", "v", "q0", 0.0, 0.0, True)]  # a second receiver, one rejection
    rows += [ReportRow(0, f"h{i}", "v", "q0", 0.9, 1.0, False) for i in range(5)]  # five receivers happy
    fed.state.put_reports(rows)
    # 51 of 56 groups rejected, but 2 of 7 receivers: the mean receiver rate is 2/7 < 0.5
    assert fed.quarantined() == set()


# ------------------------------------------------------------------ 6. confidentiality

def test_get_status_needs_an_allowlisted_unrevoked_certificate(pki, prompt_file, prompts, tmp_path):
    allow = tmp_path / "allow.yaml"
    for name in ("alice", "bob"):
        Allowlist.edit(allow, "add", name)
    broker = start_broker(broker_config(prompt_file, tls_cert=str(pki / "broker.pem"), tls_key=str(pki / "broker.key"),
                                        client_ca=str(pki / "ca.pem"), allowlist=str(allow)))
    try:
        alice = tls_client(pki, broker.address, "alice")
        assert alice.status().manifest.n == 2
        outsider = tls_client(pki, broker.address, "outsider")
        code, _ = code_of(outsider.status)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # nor can an outsider learn anything from a request that names nobody or does not parse
        code, _ = status_of(lambda: raw_unary(outsider.channel, "GetMatches")(b"\xff\xff", timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        Allowlist.edit(allow, "revoke", "bob")
        bob = tls_client(pki, broker.address, "bob")
        assert code_of(bob.status)[0] == grpc.StatusCode.PERMISSION_DENIED
        for c in (alice, outsider, bob):
            c.close()
    finally:
        broker.stop()


def test_the_bundle_quota_survives_a_broker_restart(prompt_file, prompts, tmp_path):
    db = str(tmp_path / "broker.sqlite")
    broker = start_broker(broker_config(prompt_file, db=db, max_node_bundle_mib=1))
    a = client(broker, prompts, "a")
    a.publish(0, [summary(p, 1) for p in prompts[:2]])
    a.upload(record(prompts[0], 1, "a"), 0)
    used = broker.state.bundle_bytes_held("a")
    assert used > 0
    a.close()
    broker.stop()
    broker = start_broker(broker_config(prompt_file, db=db, max_node_bundle_mib=1))
    try:
        assert broker.state.bundle_bytes_held("a") == used and broker.state.bundle_bytes_held("b") == 0
    finally:
        broker.stop()


def test_a_node_publishing_round_after_round_is_held_to_its_summary_quota(prompt_file, prompts, tmp_path, caplog):
    """A node may open rounds up to 1000 past its own, and retention keeps the rounds ahead
    of the others: one id publishing round after round grew the state without end (the
    publish rate and the per-round cap bounded its speed, not its total). The summaries the
    broker holds of a node are now bounded by max_node_summaries: past it a publish is
    refused RESOURCE_EXHAUSTED, saying what to do, and stores nothing; a publish sent again
    (its answer lost) adds nothing and is not refused; the other nodes go on; retention
    frees the quota; a restarted broker counts the same."""
    db = str(tmp_path / "broker.sqlite")
    cfg = broker_config(prompt_file, db=db, max_node_summaries=32, keep_rounds=2)  # 4 x prompts_per_round
    broker = start_broker(cfg)
    eight = prompts[:8]
    try:
        a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
        for r in (0, 1, 900):  # far ahead: allowed, and kept by retention
            a.publish(r, [summary(p, 1, round=r) for p in eight])
        assert "of its quota" not in caplog.text  # 24 held: under 80%
        a.publish(901, [summary(p, 1, round=901) for p in eight])
        # the operator is told by the publish that takes the node near its quota, before any is refused
        warned = [r.getMessage() for r in caplog.records if "of its quota" in r.getMessage()]
        assert len(warned) == 1 and "node 'a' reaches 32 summaries, 100% of its quota of 32 summaries" in warned[0]
        assert "broker.max_node_summaries" in warned[0]
        code, details = code_of(lambda: a.publish(902, [summary(prompts[0], 1, round=902)]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "holds 32 summaries" in details and "1 more would pass its quota of 32" in details
        assert "broker.max_node_summaries" in details and "keep_rounds" in details
        assert broker.state.summaries_held("a") == 32 and not broker.state.summaries(round=902)
        assert broker.state.get_round(902) is None  # refused before its round was opened
        assert a.publish(901, [summary(p, 1, round=901) for p in eight]) == (0, 8)  # sent again: nothing new
        code, details = code_of(lambda: a.publish(901, [summary(p, 1, round=901) for p in prompts[:9]]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 more would pass" in details
        assert sum("of its quota" in r.getMessage() for r in caplog.records) == 1  # not again
        for r in range(3):  # b is not held to a's count
            b.publish(r, [summary(p, 0, round=r) for p in prompts[:2]])
        broker.fed.prune()  # the agreed round is 2 (a's 901 is its own): round 0 goes
        assert broker.state.summaries_held("a") == 24 and broker.state.summaries_held("b") == 4
        assert a.publish(902, [summary(p, 1, round=902) for p in eight]) == (8, 0)
        assert broker.state.summaries_held("a") == 32
        a.close()
        b.close()
    finally:
        broker.stop()
    broker = start_broker(cfg)
    try:
        assert broker.state.summaries_held("a") == 32
        a = client(broker, prompts, "a")
        assert code_of(lambda: a.publish(903, [summary(prompts[0], 1, round=903)]))[0] == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        a.close()
    finally:
        broker.stop()


def test_two_publishes_of_a_node_in_flight_do_not_pass_its_summary_quota_together(prompt_file, prompts):
    """Without the publish queue a node may have two publishes in flight; each was checked
    against the quota before either was stored, so together they passed it. The check is
    made again under the node's lock, just before the store (found in review)."""
    import threading
    import time

    broker = start_broker(broker_config(prompt_file, max_node_summaries=32, publish_queue=False))
    try:
        a = client(broker, prompts, "a")
        for r in (0, 1):
            a.publish(r, [summary(p, 1, round=r) for p in prompts])  # 24 of 32
        real, first = broker.state.put_summary_blocks, threading.Event()

        def slow(items):
            if not first.is_set():
                first.set()
                time.sleep(0.5)  # the second publish is checked meanwhile
            return real(items)

        broker.state.put_summary_blocks = slow
        got = {}

        def publish(r):
            try:
                got[r] = a.publish(r, [summary(p, 1, round=r) for p in prompts[:8]])
            except Exception as exc:  # noqa: BLE001
                got[r] = exc

        t2 = threading.Thread(target=publish, args=(2,))
        t2.start()
        assert first.wait(10)
        t3 = threading.Thread(target=publish, args=(3,))
        t3.start()
        t2.join()
        t3.join()
        assert broker.state.summaries_held("a") == 32, got
        assert sorted(type(v).__name__ for v in got.values()) == ["ResourceExhausted", "tuple"]
        a.close()
    finally:
        broker.stop()


def test_bundle_bytes_held_count_each_uploaders_bundles_until_retention_drops_them(tmp_path):
    """What the bundle quota (max_node_bundle_mib) reads, in both backends: the bytes of
    the bundles a node uploaded (stored first) that the state still holds. It counted every
    byte a node had ever uploaded in the broker's life: retention (max_bundle_gib) dropping
    them freed nothing, so an honest node of a long run hit its quota for good, until the
    broker restarted."""
    from graft_fed.broker.state_memory import InMemoryState
    from graft_fed.broker.state_sqlite import SqliteState

    for st in (InMemoryState(), SqliteState(tmp_path / "s.sqlite")):
        assert st.put_bundle("d1", b"x" * 10, node_id="a")
        assert not st.put_bundle("d1", b"x" * 10, node_id="b")  # held: the first uploader keeps it
        w = st.begin_bundle()
        w.write(b"y" * 7)
        assert w.commit("d2", node_id="b")
        st.put_bundle("d3", b"z" * 5, node_id="a")
        st.put_bundle("d4", b"w" * 3)  # no uploader (a test's, a tool's): counts against nobody
        assert [st.bundle_bytes_held(n) for n in ("a", "b", "")] == [15, 7, 0]
        st.prune(max_bundle_bytes=12)  # d1 and d2, the oldest, go
        assert [st.bundle_bytes_held(n) for n in ("a", "b")] == [5, 0]
        if isinstance(st, SqliteState):
            st.close()
            st = SqliteState(tmp_path / "s.sqlite")
            assert [st.bundle_bytes_held(n) for n in ("a", "b")] == [5, 0]
        st.close()


def test_round_retention_drops_the_bundles_only_its_rounds_named_and_frees_their_quota(tmp_path):
    """keep_rounds dropped a round's summaries (and their digests) but kept the bundles:
    nothing could grant them any more, yet they filled the disk and, once the quota counted
    each uploader's bundles, counted against it for good (found in review). The bundles only
    the dropped rounds named go with them; one a kept round names too stays."""
    from graft_fed.broker.state import RoundRow
    from graft_fed.broker.state_memory import InMemoryState
    from graft_fed.broker.state_sqlite import SqliteState
    from graft_fed.federation.messages import SummaryRow

    def rows(rounds, prompt="p"):
        return [SummaryRow(node_id="a", round=r, prompt_id=prompt, policy_version=0, n=2, k=1, reward_mean=0.5,
                           reward_std=math.sqrt(0.5), lengths=[1, 1], mean_logprobs=[-1.0, -1.0]) for r in rounds]

    for st in (InMemoryState(), SqliteState(tmp_path / "s.db")):
        for r in range(4):
            st.put_round(RoundRow(round=r, state="open", opened_at=0.0))
        st.put_summaries(rows(range(4)) + rows([0, 3], "q"))
        for digest, size, r, prompt in (("d" * 64, 10, 0, "p"), ("e" * 64, 7, 0, "q"), ("f" * 64, 5, 3, "p")):
            w = st.begin_bundle()
            w.write(b"x" * size)
            assert w.commit_attached(digest, b"", b"", "a", r, prompt) == (True, True)
        assert st.set_bundle_digest("a", 3, "q", "e" * 64)  # the same bytes named by a kept round too
        assert st.bundle_bytes_held("a") == 22
        st.prune(keep_rounds=1)  # rounds 0-2 go, and d (only round 0 named it)
        assert st.has_bundles(["d" * 64, "e" * 64, "f" * 64]) == ["e" * 64, "f" * 64]
        assert st.bundle_bytes_held("a") == 12
        if isinstance(st, SqliteState):
            st.close()
            st = SqliteState(tmp_path / "s.db")
            files = str(tmp_path / "s.db") + "-bundles"
            assert st.bundle_bytes_held("a") == 12
            assert not os.path.exists(os.path.join(files, "d" * 64)) and os.path.exists(os.path.join(files, "f" * 64))
        st.close()


def test_an_upload_whose_round_retention_drops_meanwhile_is_refused_and_holds_nothing(prompt_file, prompts):
    """Retention dropping the round of an upload in flight: the upload is refused NOT_FOUND
    (the node takes it as that bundle's refusal), and neither its bytes nor its file stay."""
    from graft_fed.federation.bundles import digest_of, encode_bundle
    from graft_fed.federation.errors import NotFound

    broker = start_broker(broker_config(prompt_file))
    try:
        a = client(broker, prompts, "a")
        for r in (0, 1):
            a.publish(r, [summary(prompts[0], 1, round=r)])
        data = encode_bundle(record(prompts[0], 1, "a"))
        up = broker.fed.begin_upload("a", a.session, prompts[0].id, 0, digest_of(data), len(data))
        up.write(data)
        commit = up.writer.commit_attached

        def pruned_first(*args):  # round 0 goes after the summary's check, before the commit
            broker.state.prune(keep_rounds=1)
            return commit(*args)

        up.writer.commit_attached = pruned_first
        with pytest.raises(NotFound, match="pruned by retention while its bundle arrived"):
            up.finish()
        up.abort()
        assert broker.state.bundle_bytes_held("a") == 0 and not broker.state.has_bundles([digest_of(data)])
        assert not broker.fed.bundles._in_flight
        a.close()
    finally:
        broker.stop()


def test_two_uploads_of_a_node_in_flight_do_not_pass_its_bundle_quota_together(prompt_file, prompts):
    """The bundle quota was checked as each upload began, against what the state held: two
    uploads of a node in flight at once (the broker takes two) each passed it, and both were
    stored (found in review). An upload's bytes count from its start."""
    import dataclasses as dc

    from graft_fed.federation.bundles import digest_of, encode_bundle
    from graft_fed.federation.errors import ResourceExhausted

    broker = start_broker(broker_config(prompt_file, max_node_bundle_mib=1))
    try:
        a = client(broker, prompts, "a")
        a.publish(0, [summary(p, 1) for p in prompts[:2]])
        datas = [encode_bundle(dc.replace(record(p, 1, "a"), texts=("x" * 700_000, "y"))) for p in prompts[:2]]
        first = broker.fed.begin_upload("a", a.session, prompts[0].id, 0, digest_of(datas[0]), len(datas[0]))
        with pytest.raises(ResourceExhausted, match="or is receiving"):
            broker.fed.begin_upload("a", a.session, prompts[1].id, 0, digest_of(datas[1]), len(datas[1]))
        first.abort()  # the first given up: its bytes no longer count
        second = broker.fed.begin_upload("a", a.session, prompts[1].id, 0, digest_of(datas[1]), len(datas[1]))
        second.write(datas[1])
        assert second.finish()
        second.abort()  # as the servicer does whatever ends the call: nothing more given back
        assert broker.state.bundle_bytes_held("a") == len(datas[1]) and not broker.fed.bundles._in_flight
        a.close()
    finally:
        broker.stop()


def test_retention_frees_a_nodes_bundle_quota(prompt_file, prompts, caplog):
    """A node at its bundle quota uploads again once retention dropped some of its bundles
    (before, the broker's count of its bytes only grew until a restart)."""
    import dataclasses as dc

    from graft_fed.federation.errors import ResourceExhausted

    broker = start_broker(broker_config(prompt_file, max_node_bundle_mib=1))
    try:
        a = client(broker, prompts, "a")
        a.publish(0, [summary(p, 1) for p in prompts[:4]])
        big = [dc.replace(record(p, 1, "a"), texts=("x" * 400_000, "y")) for p in prompts[:3]]
        a.upload(big[0], 0)
        a.upload(big[1], 0)
        assert "of its quota" not in caplog.text  # 0.8 MB of 1 MiB: under 80%
        with pytest.raises(ResourceExhausted, match=r"quota of 1 MiB .*holds 0\.8 MiB"):
            a.upload(big[2], 0)
        assert "of its quota" not in caplog.text  # a refused upload takes the node nowhere
        a.upload(dc.replace(record(prompts[3], 1, "a"), texts=("x" * 100_000, "y")), 0)
        # the upload that takes the node near its quota tells the operator, once
        warned = [r.getMessage() for r in caplog.records if "of its quota" in r.getMessage()]
        assert len(warned) == 1 and "node 'a' reaches 0.9 MiB of bundles, 86% of its quota of 1.0 MiB" in warned[0]
        assert "broker.max_node_bundle_mib" in warned[0] and "uploads are refused" in warned[0]
        broker.state.prune(max_bundle_bytes=600_000)  # the oldest two of a's three go
        assert 490_000 < broker.state.bundle_bytes_held("a") < 600_000
        a.upload(big[2], 0)
        a.close()
    finally:
        broker.stop()


# ------------------------------------------------------------------ 4. (cont.) slow streams and request floods

def test_slow_uploads_are_bounded_per_node(broker, prompts):
    a = client(broker, prompts, "a")
    a.publish(0, [summary(prompts[0], 1)])
    data = encode_bundle(record(prompts[0], 1))
    release = threading.Event()

    def trickle():
        yield pb.BundleChunk(digest=digest_of(data), total_size=len(data), offset=0, data=data[:1], node_id="a",
                             session_id=a.session, prompt_id=prompts[0].id, round=0, tag=new_tag())
        release.wait(10)  # and then nothing: the stream stays open, holding a broker thread

    results: list = []
    futs = [a.stub.UploadBundle.future(trickle(), timeout=15) for _ in range(2)]
    time.sleep(0.5)
    code, details = status_of(lambda: a.stub.UploadBundle(trickle(), timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in details
    release.set()
    for f in futs:
        results.append(status_of(f.result)[0])
    assert grpc.StatusCode.INTERNAL not in results
    # once they ended, the node can upload again
    assert a.upload(record(prompts[0], 1), 0)[1]
    a.close()


def test_in_flight_bound_is_per_node_and_released():
    from graft_fed.broker.servicer import InFlight
    from graft_fed.federation.errors import ResourceExhausted

    f = InFlight(2, "fetches")
    with f.hold("a"), f.hold("a"), f.hold("b"):
        with pytest.raises(ResourceExhausted, match="2 fetches in flight"):
            with f.hold("a"):
                pass
    with f.hold("a"), f.hold("a"):
        pass


def test_a_request_flood_from_one_certificate_is_rate_limited(pki, prompt_file, prompts, tmp_path):
    allow = tmp_path / "allow.yaml"
    for name in ("alice", "mallory"):
        Allowlist.edit(allow, "add", name)
    broker = start_broker(broker_config(prompt_file, tls_cert=str(pki / "broker.pem"), tls_key=str(pki / "broker.key"),
                                        client_ca=str(pki / "ca.pem"), allowlist=str(allow), max_requests_per_s=5))
    try:
        alice, mallory = tls_client(pki, broker.address, "alice"), tls_client(pki, broker.address, "mallory")
        codes = [status_of(lambda: mallory.stub.GetStatus(pb.StatusRequest(), timeout=5))[0] for _ in range(40)]
        assert codes[:20] == [grpc.StatusCode.OK] * 20  # a burst of 4x the rate
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 15
        raw = raw_unary(mallory.channel, "Heartbeat")
        assert status_of(lambda: raw(b"\xff", timeout=5))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert alice.status().manifest.n == 2  # another certificate has its own budget
        alice.close()
        mallory.close()
    finally:
        broker.stop()


def _two_honest_rounds(broker, prompts):
    """a and b publish rounds 0-2."""
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    for r in range(3):
        a.publish(r, [summary(prompts[0], 1, round=r)])
        b.publish(r, [summary(prompts[0], 0, round=r)])
    return a, b


def _two_honest_rounds_and_one_far_ahead(broker, prompts):
    """a and b publish rounds 0-2; mallory publishes round 1000 (accepted: within 1000 of the agreed round)."""
    a, b = _two_honest_rounds(broker, prompts)
    m = client(broker, prompts, "mallory")
    m.publish(1000, [summary(prompts[0], 1, round=1000)])
    return a, b, m


def test_one_node_publishing_far_ahead_does_not_make_retention_drop_the_others(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, keep_rounds=3, max_publishes_per_s=0))
    try:
        a, b, m = _two_honest_rounds_and_one_far_ahead(broker, prompts)
        broker.fed.prune()
        kept = {(s.node_id, s.round) for s in broker.state.summaries()}
        assert {("a", r) for r in range(3)} <= kept and {("b", r) for r in range(3)} <= kept
        for r in range(3, 8):  # the honest nodes move on: their old rounds go as configured
            a.publish(r, [summary(prompts[0], 1, round=r)])
            b.publish(r, [summary(prompts[0], 0, round=r)])
        broker.fed.prune()
        assert min(s.round for s in broker.state.summaries() if s.node_id == "a") == 5
        for x in (a, b, m):
            x.close()
    finally:
        broker.stop()


def test_one_node_running_ahead_does_not_move_the_bound_of_the_others(prompt_file, prompts):
    # "a round up to current + 1000 is accepted" counted from the highest round with a row,
    # which the publish itself moved: one node's 1000, 2000, 3000, ... each moved every node's
    # bound (the heartbeat clamp, the report check). The bound now counts from the highest
    # round two nodes have published (2 here), or from the node's own round: mallory moves
    # only its own
    broker = start_broker(broker_config(prompt_file, keep_rounds=3, max_publishes_per_s=0))
    try:
        a, b, m = _two_honest_rounds_and_one_far_ahead(broker, prompts)
        m.publish(2000, [summary(prompts[0], 1, round=2000)])  # 1000 past its own
        newcomer = client(broker, prompts, "newcomer")
        code, details = code_of(lambda: newcomer.publish(2001, [summary(prompts[0], 1, round=2001)]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "at most 1002" in details, details
        _heartbeat(newcomer, "newcomer", 10**12)
        assert broker.state.get_node("newcomer").round == 1002
        _heartbeat(m, "mallory", 10**12)  # one past what it published
        assert broker.state.get_node("mallory").round == 2001
        entry = pb.CompatibilityReport.Entry(source_node_id="a", prompt_id=prompts[0].id, mean_s=1.0,
                                             admitted_fraction=1.0)
        code, details = code_of(lambda: b.stub.ReportCompatibility(pb.CompatibilityReport(
            node_id="b", session_id=b.session, round=3003, entries=[entry], tag=new_tag()), timeout=5))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "far ahead" in details, details
        a.publish(3, [summary(prompts[0], 1, round=3)])  # the honest nodes open their rounds as before
        for x in (a, b, m, newcomer):
            x.close()
    finally:
        broker.stop()


@pytest.mark.parametrize("max_lag", [None, 0])
def test_two_ids_cannot_make_retention_drop_the_groups_of_the_nodes_at_work(prompt_file, prompts, max_lag):
    # claims do not count towards the agreed round (two ids heartbeating agreed + 1000 moved
    # it 1000 a time without publishing anything); two ids publishing far ahead still move it,
    # but retention also counts back from the lowest round an online node has come to: before,
    # m1 and m2 at 6002 had retention delete every one of a's and b's groups. With a bound on
    # how far behind a node may hold retention back (measured from the lower median online
    # node: 2 here), two ids of four do not move it either
    broker = start_broker(broker_config(prompt_file, keep_rounds=3, max_publishes_per_s=0,
                                        retention_max_lag_rounds=max_lag))
    try:
        a, b = _two_honest_rounds(broker, prompts)
        m1, m2 = client(broker, prompts, "m1"), client(broker, prompts, "m2")
        for _ in range(5):
            top = broker.fed.rounds.agreed() + 1000
            _heartbeat(m1, "m1", top)
            _heartbeat(m2, "m2", top)
        assert broker.fed.rounds.agreed() == 2
        m1.publish(1002, [summary(prompts[0], 1, round=1002)])
        m2.publish(1002, [summary(prompts[0], 1, round=1002)])
        assert broker.fed.rounds.agreed() == 1002
        broker.fed.prune()
        kept = {(s.node_id, s.round) for s in broker.state.summaries()}
        assert {(n, r) for n in "ab" for r in range(3)} <= kept
        for x in (a, b, m1, m2):
            x.close()
    finally:
        broker.stop()


def test_ids_that_only_claim_far_rounds_do_not_move_the_median_retention_counts_from(prompt_file, prompts):
    # with retention_max_lag_rounds the median online node decides who is too far behind; a
    # heartbeat's claimed round counts for where a node is, but not for the median: three ids
    # of five heartbeating agreed + 1000 (published nothing) would otherwise have put a and b
    # "1000 behind" and had retention drop their groups
    broker = start_broker(broker_config(prompt_file, keep_rounds=3, max_publishes_per_s=0,
                                        retention_max_lag_rounds=0))
    try:
        a, b = _two_honest_rounds(broker, prompts)
        claimers = [client(broker, prompts, f"m{i}") for i in range(3)]
        for i, m in enumerate(claimers):
            _heartbeat(m, f"m{i}", broker.fed.rounds.agreed() + 1000)
        assert broker.state.get_node("m0").round == 1002
        broker.fed.prune()
        kept = {(s.node_id, s.round) for s in broker.state.summaries()}
        assert {(n, r) for n in "ab" for r in range(3)} <= kept and broker.fed.left_behind() == []
        for x in (a, b, *claimers):
            x.close()
    finally:
        broker.stop()


@pytest.mark.parametrize("max_lag", [None, 4])
def test_a_node_far_behind_holds_retention_back_unless_further_than_retention_max_lag_rounds(
        prompt_file, prompts, caplog, max_lag):
    # a and b work on round 9; "slow" (online, heartbeating) is still at round 0. Retention
    # counts back from the lowest round an online node has come to, so without a bound slow
    # keeps every round since 0 (a slow site or a node claiming to be one: the state grows
    # with every round). With retention_max_lag_rounds 4 it is 9 behind the median online
    # node and no longer holds retention back (logged once); caught up, it holds it again
    from graft_fed.broker.server import render_metrics
    broker = start_broker(broker_config(prompt_file, keep_rounds=3, max_publishes_per_s=0,
                                        retention_max_lag_rounds=max_lag))
    try:
        slow = client(broker, prompts, "slow")
        slow.publish(0, [summary(prompts[1], 0, round=0)])
        a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
        for r in range(10):
            a.publish(r, [summary(prompts[0], 1, round=r)])
            b.publish(r, [summary(prompts[0], 0, round=r)])
        _heartbeat(slow, "slow", 0)
        warned = lambda: [r for r in caplog.records if "retention_max_lag_rounds" in r.getMessage()]
        with caplog.at_level("WARNING", logger="graft_fed.broker"):
            broker.fed.prune()
            broker.fed.prune()
        kept = {(s.node_id, s.round) for s in broker.state.summaries()}
        if max_lag is None:
            assert {("a", r) for r in range(10)} <= kept and ("slow", 0) in kept
            assert not warned()
            return
        assert {r for n, r in kept if n == "a"} == {7, 8, 9} and ("slow", 0) not in kept
        assert len(warned()) == 1 and "node slow is at round 0" in warned()[0].getMessage()
        assert "graft_fed_retention_nodes_left_behind 1\n" in render_metrics(broker.fed, broker.servicer)
        slow.publish(6, [summary(prompts[1], 0, round=6)])  # within 4 of the median (9): it holds retention again
        broker.fed.prune()
        assert ("slow", 6) in {(s.node_id, s.round) for s in broker.state.summaries()}
        assert "graft_fed_retention_nodes_left_behind 0\n" in render_metrics(broker.fed, broker.servicer)
        for r in (10, 11):
            a.publish(r, [summary(prompts[0], 1, round=r)])
            b.publish(r, [summary(prompts[0], 0, round=r)])
        broker.fed.prune()  # 11 - 6 > 4: left behind again, and said so again
        assert len(warned()) == 2 and "node slow is at round 6" in warned()[1].getMessage()
        assert {r for n, r in ((s.node_id, s.round) for s in broker.state.summaries()) if n == "a"} == {9, 10, 11}
        for x in (a, b, slow):
            x.close()
    finally:
        broker.stop()


def test_a_node_far_ahead_of_the_others_goes_on_after_a_round_it_missed(prompt_file, prompts):
    # the node's own bound is 1000 past its own round: one that missed a round (kept in its
    # backlog, or refused) is not stopped by the gap, as it was with "one past its own"
    broker = start_broker(broker_config(prompt_file, max_publishes_per_s=0))
    try:
        gone = client(broker, prompts, "gone")
        gone.publish(0, [summary(prompts[0], 1, round=0)])
        gone.close()
        fast = client(broker, prompts, "fast")
        for r in (0, 1000, 1500):  # each within 1000 of its own
            fast.publish(r, [summary(prompts[0], 1, round=r)])
        for r in (1502, 1503):  # 1501 missed
            fast.publish(r, [summary(prompts[0], 1, round=r)])
        fast.publish(1501, [summary(prompts[0], 1, round=1501)])  # its backlog, later
        fast.close()
    finally:
        broker.stop()


def test_a_node_refuses_a_fetched_bundle_that_is_too_big_or_inconsistent(broker, prompts, monkeypatch):
    """What a hostile broker sends back is bounded too: the node does not buffer without end."""
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    a.publish(0, [summary(prompts[0], 0), summary(prompts[1], 1)])
    b.publish(0, [summary(prompts[0], 1), summary(prompts[1], 0)])
    digest, _ = b.upload(record(prompts[0], 1, "b"), 0)
    assert a.get_matches(0, 5.0).offers[0].digest == digest
    a.max_bundle = 10
    with pytest.raises(RecordError, match="more than this node accepts"):
        a.fetch(digest)
    a.max_bundle = 2**20
    real = a.stub.FetchBundle

    class Lying:  # the broker's stream, with a chunk that does not continue where the last ended
        def __init__(self, request, timeout=None):
            self.chunks = list(real(request, timeout=timeout))
            self.chunks[0].offset = 7

        def __iter__(self):
            return iter(self.chunks)

        def cancel(self):
            pass
    lying = Lying
    a.stub.FetchBundle = lying
    with pytest.raises(RecordError, match="inconsistent"):
        a.fetch(digest)

    class Reshaped(Lying):  # the same bytes, cut into other chunks by `cut(data)`
        cut = staticmethod(lambda data: [data])

        def __init__(self, request, timeout=None):
            first = next(iter(real(request, timeout=timeout)))
            assert first.offset == 0 and len(first.data) == first.total_size  # one chunk: a small bundle
            self.chunks, off = [], 0
            for piece in self.cut(first.data):
                chunk = type(first)()
                chunk.CopyFrom(first)
                chunk.offset, chunk.data = off, piece
                self.chunks.append(chunk)
                off += len(piece)

    class Trickle(Reshaped):  # every byte in a chunk of its own: a whole fetch of tiny messages
        cut = staticmethod(lambda data: [data[i:i + 1] for i in range(len(data))])

    class Empties(Reshaped):  # empty chunks for as long as the node listens, then the bytes
        cut = staticmethod(lambda data: [*([b""] * 100_000), data])

        def __iter__(self):
            sent = []
            for chunk in self.chunks:
                sent.append(chunk)
                yield chunk
            assert False, f"the node read all {len(sent)} chunks"  # noqa: B011 - it must stop at the first empty one

    a.stub.FetchBundle = Reshaped  # the real bytes, reassembled: still fetched
    assert a.fetch(digest) == record(prompts[0], 1, "b")
    a.stub.FetchBundle = Trickle
    with pytest.raises(RecordError, match=r"more chunks than its bytes need \(2 for 2 bytes\)"):
        a.fetch(digest)
    # an honest broker's stream of a bundle held as an upload's pieces (each at least the
    # minimum chunk) read in chunks smaller than a piece: a full chunk and a short rest per
    # piece. The rule scaled down (a 64-byte minimum) so that this small bundle has pieces.
    monkeypatch.setattr(client_module, "MIN_CHUNK_BYTES", 64)

    def pieces(*sizes):  # 96-byte pieces, each cut into chunks of `sizes`
        return staticmethod(lambda data: [data[j + sum(sizes[:i]):j + sum(sizes[:i + 1])] for j in range(0, len(data), 96)
                                          for i in range(len(sizes)) if j + sum(sizes[:i]) < len(data)])

    class Pieces(Reshaped):
        cut = pieces(64, 32)

    class ThreePerPiece(Reshaped):
        cut = pieces(64, 16, 16)
    a.stub.FetchBundle = Pieces
    assert len(Pieces(pb.FetchBundleRequest(node_id="a", session_id=a.session, digest=digest)).chunks) >= 6
    assert a.fetch(digest) == record(prompts[0], 1, "b")
    a.stub.FetchBundle = ThreePerPiece
    with pytest.raises(RecordError, match=r"more chunks than its bytes need \(4 for 160 bytes\)"):
        a.fetch(digest)
    a.stub.FetchBundle = Empties
    with pytest.raises(RecordError, match="an empty chunk"):
        a.fetch(digest)
    a.close()
    b.close()


def test_a_node_over_its_bundle_quota_still_receives(prompt_file, prompts, caplog):
    """The per-node bundle quota (max_node_bundle_mib) only grows: a share_all node that used
    it up had every upload refused RESOURCE_EXHAUSTED, which read as a lost broker, so from
    then on every step dropped its exchange (no offers, no report) and re-joined, until the
    broker restarted. It is a refusal of these bundles: the offers to the node still come."""
    from types import SimpleNamespace

    from graft_fed.federation.errors import ResourceExhausted
    from graft_fed.federation.messages import MatchResult
    from graft_fed.node.peers import BrokerPeers
    from tests.federation.helpers import InformativeStore

    broker = start_broker(broker_config(prompt_file, max_node_bundle_mib=1))
    try:
        a = client(broker, prompts, "a")
        a.publish(0, [summary(prompts[0], 1), summary(prompts[1], 1)])
        broker.state.bundle_bytes_held = lambda node: 2**20  # its quota used up
        with pytest.raises(ResourceExhausted, match="quota") as info:
            a.upload_missing([(record(prompts[0], 1), 0), (record(prompts[1], 1), 0)])
        assert (info.value.sent, info.value.refused) == (0, 2)
        m = manifest(prompts)
        peers = BrokerPeers(a, "a", "share_all", m, broker.address, None, 1, 1, 1, 5, 1, 1)
        peers.broker_manifest, peers.connected = m, True
        learner = SimpleNamespace(step=1, store=InformativeStore(), run_id="r", model_id="m", tok_id="t")
        asks = MatchResult(ready=True, offers=[], upload_requests=[(prompts[0].id, 0), (prompts[1].id, 0)])
        with caplog.at_level("WARNING", logger="graft_fed.node"):
            assert peers._serve_uploads(learner, asks, {}) == 0
        assert peers.connected and peers.uploads_refused_by_broker == 2
        # the bundles' round (0), not the node's current step (1), as the warning said before
        assert "refused round 0's bundles" in caplog.text and "round 1" not in caplog.text
        a.close()
    finally:
        broker.stop()


def test_one_group_scored_beyond_the_brokers_bound_does_not_lose_the_whole_report(prompt_file, prompts):
    """s = exp(lbar_R - lbar_S) (Eq. 7): a source claiming mean log-probs of -20 (the lowest
    screening admits) gets s up to exp(20), and the broker refuses a report with any mean_s
    above 1e6, whole. Sent as it was, one such group cost the receiver its whole report,
    the rejection of another source's lie with it (a liar could shield its lies that way)."""
    import math
    from types import SimpleNamespace

    from graft_fed.graft.receive import GroupReport
    from graft_fed.node.peers import BrokerPeers, _Round

    broker = start_broker(broker_config(prompt_file, balance="none", recheck_rejections=False))
    try:
        high, liar = client(broker, prompts, "high"), client(broker, prompts, "liar")
        receiver = client(broker, prompts, "receiver")
        high.publish(0, [summary(prompts[0], 1)])
        liar.publish(0, [summary(prompts[1], 1)])
        liar.upload(record(prompts[1], 1, "liar"), 0)  # a rejection counts of a group uploaded only
        receiver.publish(0, [summary(prompts[0], 0), summary(prompts[1], 0)])
        offers = receiver.get_matches(0, 5.0).offers
        assert sorted((o.source_node, o.prompt_id) for o in offers) == sorted(
            [("high", prompts[0].id), ("liar", prompts[1].id)])
        m = manifest(prompts)
        peers = BrokerPeers(receiver, "receiver", "share_all", m, broker.address, None, 1, 1, 1, 5, 1, 1)
        peers.broker_manifest, peers.connected = m, True
        peers._round = _Round(round=0, live=True)
        learner = SimpleNamespace(is_main=True, step=0, store=None, run_id="r", model_id="m", tok_id="t")
        got = peers.report(learner, [GroupReport(prompts[0].id, "high", math.exp(19.5), 1.0, False),
                                     GroupReport(prompts[1].id, "liar", math.nan, 0.0, True)])
        assert "federation/report_refused" not in got
        rows = {r.source: r for r in broker.state.reports(round=0, receiver="receiver")}
        assert rows["liar"].rejected and rows["high"].mean_s == 1e6
        for c in (high, liar, receiver):
            c.close()
    finally:
        broker.stop()


def test_a_heartbeat_of_the_session_a_rejoin_replaced_does_not_mark_the_new_one_lost(broker, prompts):
    """A node re-joins after a failed exchange (say, GetMatches past its deadline) while its
    heartbeat thread still beats with the old, still live, session. A heartbeat of that
    session answered after the re-join is UNAUTHENTICATED (the broker replaced it): that set
    `session_lost` for the new session, so the node re-joined again at its next step."""
    a = client(broker, prompts, "a")
    old = a.session
    entered, joined = threading.Event(), threading.Event()
    real_heartbeat, real_join = a.stub.Heartbeat, a.stub.Join

    answered = threading.Event()

    def heartbeat(req, timeout):  # in flight across the re-join, taken by the broker after it
        entered.set()
        joined.wait(5)
        while a.session == old:
            time.sleep(0.001)
        try:
            return real_heartbeat(req, timeout=timeout)
        finally:
            answered.set()

    def join(req, timeout):
        try:
            return real_join(req, timeout=timeout)
        finally:
            joined.set()

    a.stub.Heartbeat, a.stub.Join = heartbeat, join
    a._alive_sent, a.heartbeat_interval_s = 0.0, 0.05
    a._start_heartbeats()
    assert entered.wait(5)
    a.join("a", "tok", manifest(prompts), "share_all", 0)
    assert a.session != old
    assert answered.wait(5)  # the old session's heartbeat answered (UNAUTHENTICATED) ...
    time.sleep(0.2)  # ... and its thread done with it
    assert not a.session_lost.is_set()
    # the session it holds now replaced behind its back (as by a broker that lost it): lost
    other = client(broker, prompts, "a")
    deadline = time.monotonic() + 5
    while not a.session_lost.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.session_lost.is_set()
    for c in (a, other):
        c.close()
