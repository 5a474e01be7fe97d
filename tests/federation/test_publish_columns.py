"""A publish as SummaryColumns (what nodes send, issue 13) and as GroupSummary messages are
the same publish: the same summaries stored, the same checks, the same errors."""

import grpc
import pytest

from graft_fed.federation.codec import columns_to_pb
from graft_fed.node.client import new_tag
from graft_fed.proto import broker_pb2 as pb
from tests.federation.test_broker_rpc import client, summary


def _publish(c, round, summaries=(), columns=None):
    req = pb.PublishRequest(node_id=c.node_id, session_id=c.session, round=round, summaries=list(summaries),
                            tag=new_tag())
    if columns is not None:
        req.columns.CopyFrom(columns)
    return c.stub.PublishSummaries(req, timeout=5)


def _code(fn):
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def test_columns_and_messages_store_the_same_summaries(broker, prompts):
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    groups = [summary(p, k) for p, k in zip(prompts[:4], (0, 1, 2, 1))]
    groups[1].lengths[:] = [7, 1]
    groups[2].mean_logprobs[:] = [-0.0, -1e-300]
    assert _publish(a, 0, columns=columns_to_pb(groups)).accepted == 4
    assert _publish(b, 0, summaries=groups).accepted == 4
    rows = {n: [(s.prompt_id, s.k, s.n, s.lengths, [x.hex() for x in s.mean_logprobs], s.policy_version)
                for s in broker.state.summaries(node_id=n)] for n in ("a", "b")}
    assert rows["a"] == rows["b"] and len(rows["a"]) == 4
    assert _publish(a, 0, columns=columns_to_pb(groups)).duplicates == 4  # idempotent, as rows are
    assert a.publish(1, [summary(p, 1, round=1) for p in prompts[:2]]) == (2, 0)  # the client sends columns


def test_malformed_columns_are_invalid_argument_and_store_nothing(broker, prompts):
    a = client(broker, prompts, "a")
    good = columns_to_pb([summary(p, 1) for p in prompts[:3]])
    cases = {}
    for field, cut in (("k", 4), ("n_responses", 1), ("lengths", 4), ("mean_logprobs", 3), ("policy_versions", 8)):
        bad = pb.SummaryColumns()
        bad.CopyFrom(good)
        setattr(bad, field, getattr(good, field)[:-cut])
        cases[f"short {field}"] = bad
    wrong_k = pb.SummaryColumns()
    wrong_k.CopyFrom(good)
    wrong_k.k = (3).to_bytes(4, "little") * 3  # k > n = 2
    cases["k > n"] = wrong_k
    huge = pb.SummaryColumns()
    huge.CopyFrom(good)
    huge.policy_versions = (2**64 - 1).to_bytes(8, "little") * 3
    cases["policy_version beyond int64"] = huge
    unknown = pb.SummaryColumns()
    unknown.CopyFrom(good)
    unknown.prompt_ids[0] = "no-such-prompt"
    cases["unknown prompt"] = unknown
    for what, cols in cases.items():
        code, details = _code(lambda: _publish(a, 0, columns=cols))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
    code, details = _code(lambda: _publish(a, 0, summaries=[summary(prompts[0], 1)], columns=good))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not both" in details
    assert broker.state.summaries() == []


@pytest.mark.parametrize("k", [3, 0])
def test_a_bad_group_gets_the_same_error_either_way(broker, prompts, k):
    a = client(broker, prompts, "a")
    bad = summary(prompts[1], 1)
    bad.k = k  # k > n, or reward_mean contradicting k/n
    groups = [summary(prompts[0], 1), bad]
    by_columns = _code(lambda: _publish(a, 0, columns=columns_to_pb(groups)))
    by_messages = _code(lambda: _publish(a, 0, summaries=groups))
    assert by_columns == by_messages and by_columns[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_columns_past_the_uniform_bounds_get_check_messages_words(broker, prompts):
    """The servicer leaves a publish's columns to the codec, which says what check_message
    said: too many prompt ids, or one too long."""
    from graft_fed.federation.limits import MAX_REPEATED, MAX_STRING_LEN

    a = client(broker, prompts, "a")
    many = pb.SummaryColumns(prompt_ids=["p"] * (MAX_REPEATED + 1))
    code, details = _code(lambda: _publish(a, 0, columns=many))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"columns.prompt_ids has {MAX_REPEATED + 1} entries; at most {MAX_REPEATED}"
    long = columns_to_pb([summary(p, 1) for p in prompts[:2]])
    long.prompt_ids[1] = "x" * (MAX_STRING_LEN + 5)
    code, details = _code(lambda: _publish(a, 0, columns=long))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"columns.prompt_ids is {MAX_STRING_LEN + 5} characters long; at most {MAX_STRING_LEN}"
    assert broker.state.summaries() == []


def test_publishes_of_the_same_prompts_share_one_checked_list(broker, prompts):
    """The prompt ids of publishes with the same prompts are one interned list, checked once;
    a list that differs (an unknown id, a repeated one) is checked on its own and refused."""
    from graft_fed.federation.codec import summaries_from_columns
    from graft_fed.federation.summaryblock import facts_of

    groups = [summary(p, 1) for p in prompts[:3]]
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    assert _publish(a, 0, columns=columns_to_pb(groups)).accepted == 3
    first = summaries_from_columns(pb.PublishRequest(round=0, columns=columns_to_pb(groups))).block.prompt_ids
    again = summaries_from_columns(pb.PublishRequest(round=0, columns=columns_to_pb(groups))).block.prompt_ids
    assert again is first and facts_of(first)["valid"][1] is True and facts_of(first)["unique"] is True
    assert _publish(b, 0, columns=columns_to_pb(groups)).accepted == 3
    twice = columns_to_pb(groups + [summary(prompts[0], 1)])
    code, details = _code(lambda: _publish(a, 1, columns=twice))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "twice" in details
    code, details = _code(lambda: _publish(a, 1, columns=twice))  # refused again, from the memo
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "twice" in details
    assert len(broker.state.summaries()) == 6
