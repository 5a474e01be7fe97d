"""Trajectory bundles: a group record as canonical bytes, addressed by its sha256.

Canonical JSON (sorted keys, no spaces, floats as Python's shortest round-trip repr) so
the same group always has the same digest, and every double survives bit for bit.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import re
from json.decoder import scanstring

from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.federation.limits import MAX_ID_LEN

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


#: A string of the bundle longer than this many characters (decoded) is checked where it
#: arrives and stands in the structure parsed at the end (BundleStream.finish) as a string of
#: SHORT_STRING + 1 characters: every field a check compares (a prompt id is at most
#: MAX_ID_LEN, a finish reason "stop" or "length") compares unequal to it, as to the string.
SHORT_STRING = MAX_ID_LEN
#: The most characters a bundle may hold outside its long strings (its structure: keys,
#: numbers, short strings): a group record of MAX_GROUP_N responses needs under 2 MiB.
MAX_STRUCTURE = 4 * 2**20
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")


def _backslashes_before(s: str, lo: int, end: int) -> int:
    """How many backslashes immediately precede s[end], not counting any before s[lo]."""
    n, width = 0, 16
    while True:
        start = max(lo, end - n - width)
        seg = s[start:end - n]
        kept = seg.rstrip("\\")
        n += len(seg) - len(kept)
        if kept or start == lo:
            return n
        width *= 2


def _plain(buf: bytes) -> bool:
    """Whether every byte of buf is printable ASCII (0x20-0x7f) and none is a backslash: then
    a JSON string's body inside buf is valid exactly as it stands (no escape, no control
    character, no multi-byte character) and its value is those bytes. Three scans in C, about
    a twentieth of what json's scanner takes over the same bytes (BundleStream.feed)."""
    import numpy as np

    return buf.isascii() and b"\\" not in buf and (not buf or int(np.frombuffer(buf, np.uint8).min()) >= 0x20)


def _safe_cut(s: str, lo: int) -> int:
    """The last index <= len(s) where the body of a JSON string that starts at s[lo] (at the
    start of a character or escape) and runs past the end of s can be cut: not inside an
    escape, nor between the halves of a surrogate pair (both at most 12 characters back)."""
    end = len(s)
    first = s.find("\\", max(lo, end - 12), end)
    if first < 0:
        return end
    cut = first - _backslashes_before(s, lo, first) % 2  # the escape that backslash is part of
    if (cut - 6 >= lo and _HIGH_SURROGATE.match(s, cut - 6, cut)
            and _backslashes_before(s, lo, cut - 6) % 2 == 0):
        cut -= 6  # an escaped high surrogate goes with the low one that follows it
    return cut


class BundleStream:
    """A bundle checked as its bytes arrive, a chunk at a time, with what `decode_bundle`
    checks of the whole: sha256, UTF-8, JSON, the record's fields. Memory is bounded by
    the chunk, not the bundle: each string of the JSON is checked where it arrives (its
    escapes and characters by json's own scanner, no lone surrogate), and only the
    structure around the long strings is kept, parsed at the end (`finish`) into the
    record, each long string standing in as a string of SHORT_STRING + 1 characters (the
    texts are not kept: the broker stores the bytes, receivers decode them whole).
    Stricter than decode_bundle in two ways, neither of which encode_bundle can produce: a
    lone surrogate is refused in any string (a whole decode refuses it only in the
    record's text fields), and so is more than MAX_STRUCTURE characters outside the long
    strings."""

    def __init__(self, expected_digest: str) -> None:
        self.digest = expected_digest
        self.size = 0
        self._hash = hashlib.sha256()
        self._carry = b""  # bytes not yet consumed: a split UTF-8 sequence or escape
        self._parts: list[str] = []  # the structure: JSON outside long strings
        self._kept = 0
        self._in_string = False
        self._short: list[str] = []  # the current string, decoded, while it is short
        self._length = 0  # characters of the current string so far (decoded)

    def _fail(self, what: str) -> RecordError:
        return RecordError(f"bundle {self.digest[:12]} is not UTF-8 JSON: {what}")

    def _keep(self, text: str) -> None:
        self._kept += len(text)
        if self._kept > MAX_STRUCTURE:
            raise RecordError(f"bundle {self.digest[:12]} holds more than {MAX_STRUCTURE} characters outside its "
                              f"strings of more than {SHORT_STRING}")
        self._parts.append(text)

    def _piece(self, value: str, closed: bool) -> None:
        """The next piece of the current string, decoded."""
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise self._fail("a string holds a lone surrogate") from None
        self._add(len(value), value, closed)

    def _add(self, n: int, value: str, closed: bool) -> None:
        """n more characters of the current string; value, those characters, is read only
        while the string is short (a long one's pieces may pass "")."""
        self._length += n
        if self._length <= SHORT_STRING:
            self._short.append(value)
        if closed:
            self._keep(json.dumps("".join(self._short), ensure_ascii=False) if self._length <= SHORT_STRING
                       else '"' + "~" * (SHORT_STRING + 1) + '"')
            self._in_string, self._short, self._length = False, [], 0

    def _feed_plain(self, buf: bytes) -> None:
        """feed for bytes that are _plain: every quote opens or closes a string, and a
        string's body is valid as it stands, so only the quotes are looked for."""
        pos, end = 0, len(buf)
        while pos < end:
            quote = buf.find(b'"', pos)
            stop = end if quote < 0 else quote
            if self._in_string:
                n = stop - pos
                self._add(n, buf[pos:stop].decode("ascii") if self._length + n <= SHORT_STRING else "", quote >= 0)
            else:
                self._keep(buf[pos:stop].decode("ascii"))
                if quote >= 0:
                    self._in_string = True
            if quote < 0:
                break
            pos = quote + 1
        self._carry = b""

    def feed(self, data: bytes) -> None:
        self._hash.update(data)
        self.size += len(data)
        buf = self._carry + data if self._carry else data
        if not isinstance(buf, bytes):
            buf = bytes(buf)  # a memoryview or bytearray chunk: one copy of the chunk
        if _plain(buf):  # the common case for model outputs: no escape, all ASCII
            self._feed_plain(buf)
            return
        try:
            s, used = codecs.utf_8_decode(buf, "strict", False)
        except UnicodeDecodeError as exc:
            raise self._fail(f"invalid UTF-8 ({exc.reason})") from None
        rest = buf[used:]
        pos = 0
        while pos < len(s):
            if not self._in_string:
                quote = s.find('"', pos)
                self._keep(s[pos:] if quote < 0 else s[pos:quote])
                if quote < 0:
                    pos = len(s)
                    break
                self._in_string, pos = True, quote + 1
                continue
            if s.find('"', pos) >= 0:
                try:  # the common case: the string closes in this chunk
                    value, end = scanstring(s, pos, True)
                except json.JSONDecodeError:
                    pass  # it runs on, or an escape is split at the end: checked up to a cut below
                else:
                    self._piece(value, closed=True)
                    pos = end
                    continue
            cut = _safe_cut(s, pos)
            try:  # the body up to the cut, closed by a quote of ours
                value, _ = scanstring(s[pos:cut] + '"', 0, True)
            except json.JSONDecodeError as exc:
                raise self._fail(exc.msg) from None
            self._piece(value, closed=False)
            rest = s[cut:].encode("utf-8") + rest
            break
        self._carry = rest

    def sha256(self) -> str:
        """The hex digest of the bytes fed so far."""
        return self._hash.hexdigest()

    def finish(self) -> GroupRecord:
        """The record (long strings standing in, see the class) once every byte is in; raises
        RecordError for a digest mismatch, a truncated text or anything decode_bundle refuses."""
        if self.sha256() != self.digest:
            raise RecordError(f"bundle digest mismatch: expected {self.digest[:64]}, got {self.sha256()}")
        if self._in_string or self._carry:
            raise self._fail("it ends inside a string or a character")
        payload = loads_bounded("".join(self._parts).encode("utf-8"), f"bundle {self.digest[:12]}")
        if not isinstance(payload, dict):
            raise RecordError(f"bundle {self.digest[:12]} is not a JSON object")
        return GroupRecord.from_dict(payload)


def is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
