"""Protobuf's wire format, the one piece graft-fed writes by hand: a varint. Used where
messages are assembled from bytes rather than built as objects (federation/codec.py's cached
answers, the front's chunks of a bundle file: broker/front.py)."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """A non-negative integer as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
