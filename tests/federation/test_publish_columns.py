"""A publish as SummaryColumns (what nodes send, issue 13) and as GroupSummary messages are
the same publish: the same summaries stored, the same checks, the same errors."""

import grpc
import pytest

from graft_fed.federation.codec import columns_to_pb
from graft_fed.node.client import new_tag
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import damaged
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


def _request_bytes(node, round, columns_payload: bytes, twice: bool = False, errors: str = "strict") -> bytes:
    """A PublishRequest on the wire with `columns_payload` as its columns field (6) (the node
    id encoded with `errors`: "surrogateescape" writes bytes that are not UTF-8)."""
    from graft_fed.federation.protowire import varint

    node_id = node.encode("utf-8", errors)
    head = b"\x0a" + varint(len(node_id)) + node_id + pb.PublishRequest(round=round).SerializeToString()
    field = b"\x32" + varint(len(columns_payload)) + columns_payload
    return head + field + (field if twice else b"")


def _read(data: bytes, wire: bool = True):
    """A publish's bytes read as the broker's servicer reads them (`wire`: parse_publish, its
    columns in place when it can), or as protobuf alone reads them: (the message's fields
    other than the columns, the block's rows) or the refusal (exception type and words)."""
    from graft_fed.federation.codec import parse_publish, summaries_from_columns

    try:
        message, on_wire = parse_publish(data) if wire else (pb.PublishRequest.FromString(data), None)
        block = summaries_from_columns(message, data if wire else None, on_wire).block
    except Exception as exc:  # noqa: BLE001 - the same refusal both ways
        return type(exc).__name__, str(exc)
    message.ClearField("columns")
    rows = [(r.prompt_id, r.policy_version, r.n, r.k, r.reward_mean, r.reward_std, r.lengths, r.mean_logprobs)
            for r in block.rows()]
    return message.SerializeToString(deterministic=True), rows


def test_a_publishs_columns_are_read_in_place_only_when_they_are_exactly_a_known_list(prompts):
    """From its second sighting, a list of prompt ids is recognised in a publish's bytes, and
    the publish's columns are not parsed at all (the same interned list, without reading the
    ids one by one; the other fields parsed from the bytes around the columns). Whatever is
    not exactly that list, field for field, is parsed whole as protobuf parses it: fields in
    another order, one more id after the other columns, the columns field twice (protobuf
    merges them), another list with the same start; and every case reads as protobuf alone
    reads it."""
    from graft_fed.federation import codec
    from graft_fed.federation.codec import parse_publish, summaries_from_columns
    from graft_fed.federation.protowire import varint

    groups = [summary(p, 1) for p in prompts[:5]]
    cols = columns_to_pb(groups)
    tag = pb.RequestTag(request_id="r-1", sent_at_ms=5)
    raw = pb.PublishRequest(node_id="a", session_id="s", round=7, tag=tag, columns=cols).SerializeToString()

    def read(data: bytes):
        message, on_wire = parse_publish(data)
        return message, on_wire, summaries_from_columns(message, data, on_wire).block

    calls = []
    real = codec.intern_ids
    codec.intern_ids = lambda ids: (calls.append(1), real(ids))[1]
    try:
        (_, w1, first), (_, w2, second) = read(raw), read(raw)
        assert calls == [1, 1] and w1 is None and w2 is None
        message, on_wire, third = read(raw)
        assert on_wire is not None and not message.HasField("columns")  # recognised: the columns not parsed
        assert calls == [1, 1] and third.prompt_ids is first.prompt_ids is second.prompt_ids
        assert (message.node_id, message.session_id, message.round, message.tag) == ("a", "s", 7, tag)
        expected = list(pb.PublishRequest.FromString(raw).columns.prompt_ids)
        assert third.prompt_ids == expected and list(third.k) == [1] * 5
        assert _read(raw) == _read(raw, wire=False)

        def encoded(ids):
            return b"".join(b"\x0a" + bytes([len(p)]) + p.encode() for p in ids)

        payload = cols.SerializeToString()
        ids_part = encoded(expected)
        assert payload.startswith(ids_part)
        rest = payload[len(ids_part):]
        six = [summary(p, 1) for p in prompts[:6]]
        rest6 = columns_to_pb(six).SerializeToString()[len(encoded([g.prompt_id for g in six])):]
        cases = {
            "ids after the other fields": _request_bytes("a", 7, rest + ids_part),
            "a sixth id after the other fields": _request_bytes("a", 7, ids_part + rest6 + encoded([six[5].prompt_id])),
            "another list, same start": _request_bytes("a", 7, encoded(expected[:-1] + ["zzz"]) + rest),
            "the columns field twice": _request_bytes("a", 7, payload, twice=True),
            "a round after the columns": _request_bytes("a", 7, payload) + b"\x18\x09",
            "the node id twice, around the columns": _request_bytes("a", 7, payload) + b"\x0a\x01b",
            "the columns cut short": _request_bytes("a", 7, payload)[:-3],
            "a field of wire type 7 after the columns": _request_bytes("a", 7, payload) + b"\x3f",
            "field number 0 after the columns": _request_bytes("a", 7, payload) + b"\x00\x01",
            "invalid UTF-8 in the node id": _request_bytes("\udcff", 7, payload, errors="surrogateescape"),
        }
        # varints longer than their shortest encoding where the columns are cut out (protobuf's
        # parsers differ on them: upb refuses a tag or length over 5 bytes, the pure-Python
        # parser reads an over-long tag as another field): parsed whole, never in place
        head = pb.PublishRequest(node_id="a", round=7).SerializeToString()
        size = varint(len(payload))
        at = len(ids_part)
        assert payload[at:at + 2] == b"\x12\x28"  # policy_versions: 5 x 8 bytes
        long_array_tag = payload[:at] + b"\x92\x00" + payload[at + 1:]
        long_array_size = payload[:at + 1] + b"\xa8\x00" + payload[at + 2:]
        cases.update({
            "the columns' tag in 6 bytes": head + b"\xb2\x80\x80\x80\x80\x00" + size + payload,
            "the columns' tag in 2 bytes": head + b"\xb2\x00" + size + payload,
            "the columns' length in 6 bytes": head + b"\x32" + bytes(b | 0x80 for b in size) + b"\x80" * (5 - len(size)) + b"\x00" + payload,
            "the columns' length in one byte more": head + b"\x32" + bytes(b | 0x80 for b in size) + b"\x00" + payload,
            "an array's tag in 2 bytes": head + b"\x32" + varint(len(long_array_tag)) + long_array_tag,
            "an array's length in 2 bytes": head + b"\x32" + varint(len(long_array_size)) + long_array_size,
        })
        in_place = {"a round after the columns", "the node id twice, around the columns"}
        for name, data in cases.items():
            try:
                message, on_wire = parse_publish(data)
            except Exception:  # noqa: BLE001 - refused: protobuf's own error, below
                on_wire = None
            assert (on_wire is not None) == (name in in_place), name
            assert _read(data) == _read(data, wire=False), name
        assert len(_read(cases["a sixth id after the other fields"])[1]) == 6
        assert _read(cases["the node id twice, around the columns"])[0] == pb.PublishRequest(
            node_id="b", round=7).SerializeToString()
        assert _read(cases["a round after the columns"])[0] == pb.PublishRequest(node_id="a", round=9).SerializeToString()
        assert _read(cases["the columns cut short"])[0] == "DecodeError"
        calls.clear()
        assert read(raw)[2].prompt_ids is first.prompt_ids and calls == []  # still known
    finally:
        codec.intern_ids = real


def test_a_publishs_arrays_are_views_of_its_bytes_only_when_each_is_one_plain_field(prompts):
    """Once a publish's prompt ids are recognised on the wire, its arrays are read in place:
    views of the request's bytes, not the copies protobuf hands out. Only when each array
    field comes once, length-delimited, with nothing else among them; any other layout (a
    field twice, where protobuf keeps the last; a field of another wire type; an unknown
    field; a field left out) is parsed whole, and every case gives the same block (or the
    same refusal) as reading the parsed message alone."""
    from graft_fed.federation.codec import parse_publish, summaries_from_columns
    from graft_fed.federation.protowire import varint

    groups = [summary(p, k % 9) for k, p in enumerate(prompts[:5])]
    for g, extra in zip(groups, range(5)):
        g.lengths[:] = [100 + extra + i for i in range(len(g.lengths))]
    cols = columns_to_pb(groups)
    payload = cols.SerializeToString()
    ids_part = b"".join(b"\x0a" + bytes([len(g.prompt_id)]) + g.prompt_id.encode() for g in groups)
    assert payload.startswith(ids_part)

    def field(number: int, data: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(data)) + data

    arrays = [(f.number, getattr(cols, f.name)) for f in pb.SummaryColumns.DESCRIPTOR.fields if f.number != 1]
    plain = b"".join(field(n, d) for n, d in arrays)
    assert ids_part + plain == payload

    def request(body: bytes) -> bytes:
        return _request_bytes("a", 7, body)

    data = request(payload)
    for _ in range(2):  # the ids are recognised from their second sighting (or known from another test)
        _read(data)
    message, on_wire = parse_publish(data)
    block = summaries_from_columns(message, data, on_wire).block
    for column in (block.lengths, block.k, block.mean_logprobs, block.reward_std):
        assert isinstance(column.base, memoryview) and column.base.obj is data  # read in place
    assert _read(data) == _read(data, wire=False) and _read(data)[1][0][6] == [100 + i for i in range(len(groups[0].lengths))]

    lengths = dict(arrays)[8]
    other = bytes(reversed(lengths))
    cases = {
        "lengths twice (the last wins)": ids_part + plain + field(8, other),
        "lengths twice, the second short": ids_part + plain + field(8, other[:-4]),
        "an unknown field among them": ids_part + field(15, b"xyz") + plain,
        "a varint where an array is": ids_part + b"\x40\x05" + plain,
        "reward_stds left out": ids_part + b"".join(field(n, d) for n, d in arrays if n != 6),
        "the arrays in another order": ids_part + b"".join(field(n, d) for n, d in reversed(arrays)),
    }
    read_in_place = {"reward_stds left out", "the arrays in another order"}
    for name, body in cases.items():
        data = request(body)
        assert (parse_publish(data)[1] is not None) == (name in read_in_place), name
        assert _read(data) == _read(data, wire=False), name
    assert _read(request(cases["lengths twice (the last wins)"]))[1][0][6] == [
        int.from_bytes(other[i:i + 4], "little") for i in range(0, 4 * len(groups[0].lengths), 4)]
    assert _read(request(cases["reward_stds left out"]))[0] == "InvalidArgument"


def test_a_publish_mutated_anywhere_reads_as_protobuf_alone_reads_it(prompts):
    """Random damage to a publish whose prompt ids are known (bytes changed, cut out,
    repeated, inserted; fields appended): read as the broker reads it, each gives exactly
    what protobuf alone gives (the same fields and rows, or the same refusal), whether its
    columns were read in place or parsed."""
    import random

    from graft_fed.federation.codec import parse_publish

    # a list no other test reads (one whose first two sightings had another layout is never
    # learnt: summaries_from_columns memoises that its encoding did not match)
    groups = [summary(p, k % 9) for k, p in enumerate(prompts[1:8])]
    tag = pb.RequestTag(request_id="r-9", sent_at_ms=3)
    raw = pb.PublishRequest(node_id="a", session_id="s", round=4, tag=tag,
                            columns=columns_to_pb(groups)).SerializeToString()
    for _ in range(2):
        _read(raw)
    assert parse_publish(raw)[1] is not None
    rng = random.Random(13)
    in_place = 0
    for i in range(1500):
        data = damaged(raw, rng)
        try:
            in_place += parse_publish(data)[1] is not None
        except Exception:  # noqa: BLE001 - refused, as below
            pass
        assert _read(data) == _read(data, wire=False), (i, data.hex())
    assert in_place > 100  # damage in the arrays' bytes, or fields appended, still read in place


def test_a_varint_reads_back_what_protowire_writes():
    from graft_fed.federation.protowire import read_varint, varint

    for value in (0, 1, 127, 128, 300, 2**32 - 1, 2**63 - 1, 2**64 - 1):
        data = b"\x09" + varint(value) + b"\x07"
        assert read_varint(data, 1) == (value, len(data) - 1)
    with pytest.raises(IndexError):
        read_varint(varint(300)[:-1], 0)  # cut inside
    with pytest.raises(ValueError, match="too long"):
        read_varint(b"\xff" * 11, 0)
    from graft_fed.federation.protowire import read_shortest_varint

    for value in (0, 1, 127, 128, 300, 2**35, 2**64 - 1):
        assert read_shortest_varint(b"\x09" + varint(value), 1) == (value, 1 + len(varint(value)))
    for longer in (b"\x80\x00", b"\x85\x00", b"\xac\x82\x00", b"\x80" * 9 + b"\x00"):
        assert read_varint(longer, 0)[1] == len(longer)  # a varint all the same
        with pytest.raises(ValueError, match="shortest"):
            read_shortest_varint(longer, 0)
