"""An upload's chunks on the wire (issue 13): the broker reads a BundleChunk's data apart from
the rest (`codec.parse_chunk`) and the client writes it in one copy (`codec.chunk_bytes`).
Both must mean exactly what protobuf alone means by the same bytes."""

import random

import pytest

from graft_fed.federation.codec import chunk_bytes, parse_chunk, wire_bytes
from graft_fed.federation.protowire import varint
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import damaged

DATA = 4  # BundleChunk.data


def _header(**extra):
    return pb.BundleChunk(digest="ab" * 32, total_size=70_000, offset=65_536, node_id="a", session_id="s",
                          prompt_id="p-1", round=3, signature=b"sig", tag=pb.RequestTag(request_id="r-1", sent_at_ms=9),
                          **extra)


def _whole(raw):
    """What protobuf alone reads: (the message without its data, the data), or its error's type."""
    try:
        message = pb.BundleChunk.FromString(raw)
    except Exception as exc:  # noqa: BLE001 - the refusal is compared
        return type(exc).__name__
    data = message.data
    message.ClearField("data")
    return message, data


def _split(raw):
    try:
        return parse_chunk(raw)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__


def _same(raw):
    a, b = _whole(raw), _split(raw)
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a[0] == b[0] and a[0].SerializeToString() == b[0].SerializeToString() and a[1] == b[1] \
        and type(b[1]) is bytes


def test_chunk_bytes_is_the_message_with_its_data():
    for data in (b"", b"x", bytes(range(256)) * 700):
        raw = chunk_bytes(_header(), memoryview(data))
        assert isinstance(raw, bytes)
        assert pb.BundleChunk.FromString(raw) == _header(data=data)
        message, got = parse_chunk(raw)
        assert message == _header() and got == data
    assert wire_bytes(b"as is") == b"as is" and wire_bytes(_header()) == _header().SerializeToString()


def test_layouts_read_as_protobuf_reads_them():
    """The data read apart (once, shortest encoding) or the whole message parsed: either
    way the same fields and the same data as protobuf alone, or the same refusal."""
    head = _header().SerializeToString()
    body = b"payload" * 100
    field = varint(DATA << 3 | 2) + varint(len(body)) + body
    cases = {
        "generated order": _header(data=body).SerializeToString(),
        "data last": head + field,
        "data first": field + head,
        "no data": head,
        "data twice": head + field + varint(DATA << 3 | 2) + varint(3) + b"xyz",
        "data's tag in two bytes": head + bytes([(DATA << 3 | 2) | 0x80, 0]) + varint(len(body)) + body,
        "data's length in six bytes": head + varint(DATA << 3 | 2) + bytes([0x80 | len(body) & 0x7F, 0x80 | len(body) >> 7, 0x80, 0x80, 0x80, 0]) + body,
        "data's length over-long by one": head + varint(DATA << 3 | 2) + bytes([0x80 | len(body) & 0x7F, 0x80 | len(body) >> 7, 0]) + body,
        "data as a varint": head + varint(DATA << 3) + varint(5),
        "data cut short": head + varint(DATA << 3 | 2) + varint(len(body) + 10) + body,
        "a group": head + varint(12 << 3 | 3) + varint(12 << 3 | 4) + field,
        "garbage after": head + field + b"\xff\xff",
        "an unknown field": head + field + varint(30 << 3 | 2) + varint(2) + b"hi",
        "empty": b"",
    }
    for name, raw in cases.items():
        assert _same(raw), name
    assert {name for name, raw in cases.items() if _one(raw)} == {
        "generated order", "data last", "data first", "an unknown field"}


def _one(raw):
    from graft_fed.federation.codec import _DATA_FIELD, _one_field
    return _one_field(raw, _DATA_FIELD) is not None


@pytest.mark.parametrize("seed", [1, 2])
def test_a_chunk_mutated_anywhere_reads_as_protobuf_alone_reads_it(seed):
    """Random damage to a chunk (bytes changed, cut out, repeated, inserted; fields
    appended): the broker's reading is protobuf's, field for field, data included."""
    raw = _header(data=bytes(random.Random(0).randrange(256) for _ in range(300))).SerializeToString()
    rng = random.Random(seed)
    apart = 0
    for i in range(1500):
        data = damaged(raw, rng)
        apart += _one(data)
        assert _same(data), (i, data.hex())
    assert apart > 100  # damage inside the data, or fields appended, still read apart


def test_a_chunk_padded_with_fields_is_parsed_whole_not_scanned():
    """A peer padding a chunk with thousands of tiny unknown fields: the broker's scan gives
    up after MAX_SCANNED_FIELDS and protobuf reads it, with the same meaning."""
    from graft_fed.federation.codec import MAX_SCANNED_FIELDS

    pad = (varint(30 << 3) + b"\x01") * 5000
    raw = _header(data=b"payload").SerializeToString() + pad
    assert not _one(raw) and _same(raw)
    few = _header(data=b"payload").SerializeToString() + (varint(30 << 3) + b"\x01") * (MAX_SCANNED_FIELDS - 20)
    assert _one(few) and _same(few)
