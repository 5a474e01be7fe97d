"""Protobuf's wire format, the one piece graft-fed handles by hand: a varint. Written where
messages are assembled from bytes rather than built as objects (federation/codec.py's cached
answers, the front's chunks of a bundle file: broker/front.py); read where a publish's prompt
ids are recognised in its bytes (federation/codec.py)."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """A non-negative integer as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """(the varint at `pos`, the position after it); IndexError when `raw` ends inside it,
    ValueError when it runs past 64 bits."""
    value = shift = 0
    while True:
        b = raw[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def read_shortest_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """`read_varint`, for a varint in its shortest encoding (what every serializer writes);
    ValueError for any longer one (protobuf's parsers differ on those: upb refuses a tag or
    length over 5 bytes, the pure-Python parser reads an over-long tag as another field)."""
    value, end = read_varint(raw, pos)
    if end - pos > 1 and raw[end - 1] == 0:
        raise ValueError("varint not in its shortest encoding")
    return value, end
