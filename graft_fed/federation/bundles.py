"""Trajectory bundles: a group record as canonical bytes, addressed by its sha256.

Canonical JSON (sorted keys, no spaces, floats as Python's shortest round-trip repr) so
the same group always has the same digest, and every double survives bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

from graft_fed.core.records import GroupRecord, RecordError

#: Bounds of the safe decoder (bundles come from peers, through a broker that may be hostile,
#: and a broker decodes what nodes upload): nesting depth and digits of an integer.
MAX_JSON_DEPTH = 8
MAX_INT_DIGITS = 20
MAX_CONTAINERS = 1024


def encode_bundle(record: GroupRecord) -> bytes:
    return json.dumps(record.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise RecordError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise RecordError(f"a number out of the double range ({text[:24]})")
    return value


def _parse_constant(text: str) -> float:
    raise RecordError(f"{text} is not JSON (non-finite numbers are refused)")


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _max_depth(data: bytes) -> int:
    """Nesting depth of a JSON text (brackets outside strings), without recursion, so a
    pathological nesting is refused before the parser sees it. More than MAX_CONTAINERS
    arrays and objects count as too deep (a group record holds about ten)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * MAX_CONTAINERS:
        return MAX_JSON_DEPTH + 1
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in (0x5B, 0x7B) else -1
        deepest = max(deepest, depth)
    return deepest


def loads_bounded(data: bytes, what: str = "bundle") -> object:
    """json.loads for bytes from a peer: UTF-8, nesting at most MAX_JSON_DEPTH, integers of
    at most MAX_INT_DIGITS digits, finite numbers only (no NaN, Infinity or 1e999). Raises
    RecordError, never RecursionError, ValueError or OverflowError."""
    # Cheap bounds first. Brackets counted anywhere (inside strings too) bound the containers
    # from above: with few of them the text parses into at most that many lists and dicts
    # whatever it holds, and nesting is checked on the parsed value (a walk over at most
    # 2 * MAX_CONTAINERS containers). Only a text with many brackets (long texts full of
    # them) is scanned outside its strings before parsing (_max_depth: a regex pass over the
    # whole text, some 30 ms for 16 MiB).
    brackets = data.count(b"[") + data.count(b"{")
    scanned = brackets > 2 * MAX_CONTAINERS
    if scanned and _max_depth(data) > MAX_JSON_DEPTH:
        raise RecordError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(data.decode("utf-8"), parse_int=_parse_int, parse_float=_parse_float,
                           parse_constant=_parse_constant)
    except RecordError as exc:
        raise RecordError(f"{what} refused: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError, OverflowError) as exc:
        raise RecordError(f"{what} is not UTF-8 JSON: {type(exc).__name__}: {str(exc)[:120]}") from None
    if not scanned and brackets > MAX_JSON_DEPTH and _parsed_depth(value) > MAX_JSON_DEPTH:
        raise RecordError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _parsed_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (what _max_depth finds in the text), iteratively.
    More than MAX_CONTAINERS lists and dicts count as too deep, as there."""
    deepest, seen = 0, 0
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_CONTAINERS:
            return MAX_JSON_DEPTH + 1
        deepest = max(deepest, depth)
        for child in (item.values() if isinstance(item, dict) else item):
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))
    return deepest


def decode_bundle(data: bytes, expected_digest: str, digest_checked: bool = False) -> GroupRecord:
    """Check the digest (unless the caller hashed these very bytes already, as the broker does
    while they arrive), parse (bounded, see loads_bounded), validate. Raises RecordError on
    any mismatch and on any pathological input."""
    actual = expected_digest if digest_checked else digest_of(data)
    if actual != expected_digest:
        raise RecordError(f"bundle digest mismatch: expected {expected_digest[:64]}, got {actual}")
    payload = loads_bounded(data, f"bundle {expected_digest[:12]}")
    if not isinstance(payload, dict):
        raise RecordError(f"bundle {expected_digest[:12]} is not a JSON object")
    return GroupRecord.from_dict(payload)


def is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
