"""Property-based fuzzing of every RPC of a real broker: random and mutated messages never
crash it, never get INTERNAL for a client's mistake, and a rejected call leaves the state
exactly as it was; an accepted state-changing call sent again verbatim is refused as a
replay (ALREADY_EXISTS) and changes nothing."""

import time

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, manifest, summary

SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}

text = st.one_of(st.text(max_size=40), st.sampled_from(["", "a", "n0", "x" * 300, "\x00", "\ud800".encode(
    "utf-8", "surrogatepass").decode("utf-8", "replace")]))
u64 = st.one_of(st.integers(0, 10), st.integers(0, 2**64 - 1))
u32 = st.one_of(st.integers(0, 10), st.integers(0, 2**32 - 1))
f64 = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.5, 0.5, 1.0]))


def _fresh(key: bytes, skew_ms: int = 0) -> pb.RequestTag:
    return pb.RequestTag(request_id=key.hex(), sent_at_ms=max(0, int(time.time() * 1000) + skew_ms))


keys = st.binary(min_size=8, max_size=32)
# mostly a valid fresh tag (so the fuzz reaches the handlers), else none, a malformed one or a
# send time far from the broker's clock
tags = st.one_of(st.builds(_fresh, keys), st.builds(_fresh, keys), st.builds(_fresh, keys), st.none(),
                 st.builds(pb.RequestTag, request_id=text, sent_at_ms=u64),
                 st.builds(_fresh, keys, st.sampled_from([-10**9, -400_000, 400_000, 10**9])))
STATE_CHANGING = {"Join", "Heartbeat", "PublishSummaries", "ReportCompatibility", "Leave"}


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("fuzz") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(12)))
    from graft_fed.data.config import DataConfig, load_prompts

    prompts = load_prompts(DataConfig(source=str(path)))
    broker = start_broker(broker_config(path))
    c = client(broker, prompts, "fuzzer")
    c.publish(0, [summary(prompts[0], 1)])
    yield broker, c, prompts
    c.close()
    broker.stop()


def snapshot(broker):
    st_ = broker.state
    return (sorted((s.node_id, s.round, s.prompt_id, s.k) for s in st_.summaries()),
            sorted((n.node_id, n.session_id, n.state) for n in st_.list_nodes()),
            st_.bundle_stats(), sorted((m.receiver, m.prompt_id) for m in st_.matches()),
            sorted((c.source, c.receiver, c.groups) for c in st_.compat()))


def call(fn):
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def summaries_st(prompts):
    return st.lists(st.builds(
        pb.GroupSummary, prompt_id=st.one_of(text, st.sampled_from([p.id for p in prompts])), round=u64,
        policy_version=u64, n=u32, k=u32, reward_mean=f64, reward_std=f64,
        lengths=st.lists(u32, max_size=10), mean_logprobs=st.lists(f64, max_size=10), bundle_digest=text),
        max_size=5)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_fuzz_unary_rpcs(fed, data):
    broker, c, prompts = fed
    session = data.draw(st.sampled_from([c.session, "", "bogus"]))
    node = data.draw(st.sampled_from(["fuzzer", "", "other", "x" * 300]))
    rpc = data.draw(st.sampled_from(["Join", "Heartbeat", "PublishSummaries", "GetMatches", "HasBundles",
                                     "ReportCompatibility", "Leave", "GetStatus"]))
    if rpc == "Join":
        req = pb.JoinRequest(node_id=data.draw(text), model_id=data.draw(text), tokenizer_id=data.draw(text),
                             privacy=data.draw(st.integers(0, 5)), resume_round=data.draw(u64))
        if data.draw(st.booleans()):
            from graft_fed.federation.codec import manifest_to_pb

            req.manifest.CopyFrom(manifest_to_pb(manifest(prompts, seed=data.draw(st.integers(0, 5)))))
    elif rpc == "Heartbeat":
        req = pb.HeartbeatRequest(node_id=node, session_id=session, round=data.draw(u64))
    elif rpc == "PublishSummaries":
        req = pb.PublishRequest(node_id=node, session_id=session, round=data.draw(u64),
                                summaries=data.draw(summaries_st(prompts)))
        if data.draw(st.booleans()):  # the columns nodes send (issue 13): sizes and values at random
            cols = data.draw(st.builds(pb.SummaryColumns, prompt_ids=st.lists(
                st.one_of(text, st.sampled_from([p.id for p in prompts])), max_size=4),
                **{f: st.binary(max_size=40) for f in ("policy_versions", "n", "k", "reward_means", "reward_stds",
                                                        "n_responses", "lengths", "mean_logprobs")}))
            if data.draw(st.booleans()):  # well-formed sizes, values at random
                count = len(cols.prompt_ids)
                for f, w in (("policy_versions", 8), ("n", 4), ("k", 4), ("reward_means", 8), ("reward_stds", 8)):
                    setattr(cols, f, data.draw(st.binary(min_size=w * count, max_size=w * count)))
                resp = data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
                cols.n_responses = b"".join(r.to_bytes(4, "little") for r in resp)
                cols.lengths = data.draw(st.binary(min_size=4 * sum(resp), max_size=4 * sum(resp)))
                cols.mean_logprobs = data.draw(st.binary(min_size=8 * sum(resp), max_size=8 * sum(resp)))
            req.columns.CopyFrom(cols)
    elif rpc == "GetMatches":
        req = pb.MatchRequest(node_id=node, session_id=session, round=data.draw(u64), wait_ms=data.draw(
            st.integers(0, 50)))
    elif rpc == "HasBundles":
        req = pb.HasBundlesRequest(node_id=node, session_id=session, digests=data.draw(st.lists(text, max_size=4)))
    elif rpc == "ReportCompatibility":
        req = pb.CompatibilityReport(node_id=node, session_id=session, round=data.draw(u64), entries=data.draw(
            st.lists(st.builds(pb.CompatibilityReport.Entry, source_node_id=text, prompt_id=text, mean_s=f64,
                               admitted_fraction=f64, rejected=st.booleans()), max_size=3)))
    elif rpc == "Leave":
        req = pb.LeaveRequest(node_id=node, session_id=data.draw(st.sampled_from(["", "bogus"])))
    else:
        req = pb.StatusRequest()
    if rpc in STATE_CHANGING:
        tag = data.draw(tags)
        if tag is not None:
            req.tag.CopyFrom(tag)
    before = snapshot(broker)
    code = call(lambda: getattr(c.stub, rpc)(req, timeout=10))
    event(f"{rpc}: {code.name}")
    assert code not in SERVER_FAULTS, (rpc, req)
    if code != grpc.StatusCode.OK:
        assert snapshot(broker) == before, f"{rpc} was rejected ({code}) but changed the state"
    elif rpc in STATE_CHANGING:
        after = snapshot(broker)
        assert call(lambda: getattr(c.stub, rpc)(req, timeout=10)) == grpc.StatusCode.ALREADY_EXISTS, (rpc, req)
        assert snapshot(broker) == after, f"a replayed {rpc} changed the state"


@FUZZ
@given(data=st.data())
def test_fuzz_bundle_streams(fed, data):
    broker, c, prompts = fed
    chunks = data.draw(st.lists(st.builds(
        pb.BundleChunk, digest=st.one_of(text, st.just("0" * 64)), total_size=u64, offset=u64,
        data=st.binary(max_size=64), node_id=st.sampled_from(["fuzzer", "other"]),
        session_id=st.sampled_from([c.session, "bogus"]), prompt_id=st.sampled_from([prompts[0].id, "nope"]),
        round=st.integers(0, 2), tag=tags), max_size=4))
    before = snapshot(broker)
    code = call(lambda: c.stub.UploadBundle(iter(chunks), timeout=10))
    assert code not in SERVER_FAULTS
    if code != grpc.StatusCode.OK:
        assert snapshot(broker) == before
    digest = data.draw(st.one_of(text, st.just("f" * 64)))
    code = call(lambda: list(c.stub.FetchBundle(pb.FetchBundleRequest(node_id="fuzzer", session_id=c.session,
                                                                       digest=digest), timeout=10)))
    assert code not in SERVER_FAULTS


def test_fuzz_bench_small_run():
    """bench/broker/fuzz.py at a small size: generated, mutated and targeted messages to a
    mutual-TLS broker with an allowlist; no server fault, the broker up, the honest nodes'
    state unchanged, heartbeats served during a GetMatches flood. (The full run sends
    100,000 messages: docs/security.md.)"""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "broker" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("graft_fed_fuzz_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.run(messages=1500, seed=1, threads=2, db="sqlite", flood=40)
    assert res["faults"] == {"INTERNAL": 0, "UNKNOWN": 0, "DATA_LOSS": 0}, res["by_rpc"]
    assert res["server_faults"] == {"INTERNAL": 0, "UNKNOWN": 0, "DATA_LOSS": 0}
    assert res["broker_error_logs"] == 0, res["broker_error_samples"]
    assert res["broker_up"] and res["honest_state_changed"] == []
    assert res["by_rpc"]["GetMatches(flood)"].get("RESOURCE_EXHAUSTED", 0) >= 38
    assert res["ok"]
    assert res["messages"] >= 1500 and len(res["by_rpc"]) == 12  # every RPC, and the flood
