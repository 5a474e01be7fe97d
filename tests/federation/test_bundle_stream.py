"""BundleStream (the broker's check of a bundle as its chunks arrive) against decode_bundle
(the check of the whole): the same verdict on valid and mutated bundles however the bytes
are cut, the same record fields but the long strings, and memory bounded by the chunk."""

from __future__ import annotations

import gc
import json
import tracemalloc
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.federation import bundles
from graft_fed.federation.bundles import SHORT_STRING, BundleStream, decode_bundle, digest_of, encode_bundle

# texts that exercise the scanner: escapes, quotes, backslashes, multi-byte and astral
# characters (a surrogate pair when escaped), long runs of any of them
pieces = st.sampled_from(['"', "\\", "\\\\", "\n", "\t", "\x01", "é", "€", "😀", "\\u", "\"\\\"", "a", " ",
                          "x" * 300, "\\" * 33, "😀" * 20])
texts = st.lists(pieces, max_size=40).map("".join)


def record(ts: list[str], prompt_id: str = "p1", meta: dict | None = None) -> GroupRecord:
    n = len(ts)
    return GroupRecord(prompt_id=prompt_id, step=3, model_id="m", tokenizer_id="t", problem="2+2?", answer="4",
                       rewards=tuple(1.0 if i == 0 else 0.0 for i in range(n)),
                       advantages=tuple(1.0 if i == 0 else -1.0 for i in range(n)) if n > 1 else (0.0,),
                       texts=tuple(ts), finish_reasons=("stop",) * n, lengths=tuple(range(1, n + 1)),
                       mean_logprobs=tuple(-0.5 - i for i in range(n)), meta=meta or {})


def stream(data: bytes, cuts: list[int], digest: str | None = None) -> GroupRecord:
    check = BundleStream(digest or digest_of(data))
    last = 0
    for c in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
        check.feed(data[last:c])
        last = c
    return check.finish()


def same_but_long_strings(a: GroupRecord, b: GroupRecord) -> None:
    for name in ("prompt_id", "step", "rewards", "advantages", "lengths", "mean_logprobs", "finish_reasons"):
        assert getattr(a, name) == getattr(b, name), name
    for x, y in zip((a.problem, a.answer, *a.texts), (b.problem, b.answer, *b.texts)):
        assert x == y if len(x) <= SHORT_STRING else len(y) == SHORT_STRING + 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.lists(texts, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_valid_bundles_pass_however_cut(ts, cuts):
    data = encode_bundle(record(ts))
    same_but_long_strings(decode_bundle(data, digest_of(data)), stream(data, cuts))


def _verdict(f):
    try:
        f()
        return True
    except RecordError:
        return False


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.lists(texts, min_size=1, max_size=3), cuts=st.lists(st.integers(0, 10**6), max_size=20),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3),
                                st.sampled_from([b'"', b"\\", b"\\u", b"\\ud83d", b"\\ude00", b"\x00", b"\xff",
                                                 b"\xc3", b"\xe2\x82", b"}", b"{", b"[", b"]", b",", b":", b"1",
                                                 b"e", b"-", b"nul", b" ", b"\n"])),
                      min_size=1, max_size=3))
def test_mutated_bundles_get_the_same_verdict(ts, cuts, edits):
    data = bytearray(encode_bundle(record(ts)))
    for at, drop, insert in edits:
        at %= len(data) + 1
        data[at:at + drop] = insert
    data = bytes(data)
    whole = _verdict(lambda: decode_bundle(data, digest_of(data)))
    streamed = _verdict(lambda: stream(data, cuts))
    if whole and not streamed:  # stricter in one way only: a lone surrogate anywhere
        payload = json.loads(data)
        assert any(not _encodable(x) for x in _strings(payload)), data
    else:
        assert whole == streamed, data


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# texts with no escape in JSON (printable ASCII but quote and backslash): chunks of such a
# bundle take BundleStream's plain path, unless an edit puts a byte there that it must not
plain_texts = st.lists(st.sampled_from(["a", " ", "x" * 300, "{", "}", "[1, 2]", ":", ",", "~", "\x7f", "u"]),
                       max_size=40).map("".join)


def _outcome(data: bytes, cuts: list[int], plain_path: bool):
    """What a BundleStream makes of data cut at cuts: its verdict (the record or the error's
    words) and the structure it kept, with the plain path allowed or not."""
    check = BundleStream(digest_of(data))
    last = 0
    with mock.patch.object(bundles, "_plain", bundles._plain if plain_path else (lambda buf: False)):
        try:
            for c in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
                check.feed(data[last:c])
                last = c
            verdict = check.finish()
        except RecordError as exc:
            verdict = str(exc)
    return verdict, "".join(check._parts), check._in_string, check._length


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.lists(plain_texts, min_size=1, max_size=3), cuts=st.lists(st.integers(0, 10**6), max_size=20),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3),
                                st.sampled_from([b'"', b"\\", b"\\n", b"\x00", b"\x1f", b"\xff", b"\xc3\xa9",
                                                 b"}", b"{", b",", b" ", b"\n"])),
                      max_size=3))
def test_the_plain_path_agrees_with_the_scanner(ts, cuts, edits):
    """The plain path (no escape, all printable ASCII) reaches the verdict json's scanner
    reaches on the same bytes and cuts, and keeps the same structure, on valid bundles and on
    bundles with bytes put where the plain path must notice them."""
    data = bytearray(encode_bundle(record(ts)))
    for at, drop, insert in edits:
        at %= len(data) + 1
        data[at:at + drop] = insert
    data = bytes(data)
    assert _outcome(data, cuts, plain_path=True) == _outcome(data, cuts, plain_path=False)


def test_chunks_may_be_memoryviews_or_bytearrays():
    data = encode_bundle(record(["plain text " * 100, "é\\n" * 50]))
    want = decode_bundle(data, digest_of(data))
    for wrap in (memoryview, bytearray):
        check = BundleStream(digest_of(data))
        for off in range(0, len(data), 97):
            check.feed(wrap(data[off:off + 97]))
        same_but_long_strings(want, check.finish())


def test_the_plain_path_is_taken_for_plain_chunks_only():
    assert bundles._plain(b'{"texts": ["a b ~\x7f"]}') and bundles._plain(b"")
    for bad in (b"a\\nb", b"a\nb", b"a\x00", b"a\x1fb", "é".encode(), b"\xff"):
        assert not bundles._plain(bad), bad


@pytest.mark.parametrize("bad", [
    b'{"a": "\\ud800"}',  # a lone surrogate (escaped)
    b'{"a": "\\ud83d\\u0041"}',  # a high surrogate without its low half
    b'{"a": "' + b"x" * 1000 + b'\\ude00"}',  # a lone low surrogate in a long string
    b'{"a": "' + b"x" * 1000 + b'\\q"}',  # an invalid escape
    b'{"a": "' + b"x" * 1000 + b'\x01"}',  # a raw control character
    b'{"a": "' + b"x" * 1000 + b'\xed\xa0\x80"}',  # a surrogate encoded in UTF-8
    b'{"a": "' + b"x" * 1000,  # truncated inside a string
    b'{"a": "x"',  # truncated outside
    b'[' * 20 + b']' * 20,  # too deep
])
def test_refused_however_cut(bad):
    for step in (1, 2, 3, 5, 7, 64, len(bad)):
        with pytest.raises(RecordError):
            stream(bad, list(range(0, len(bad), step)))


def test_wrong_digest_and_record_refused():
    data = encode_bundle(record(["a", "b"]))
    with pytest.raises(RecordError, match="digest mismatch"):
        stream(data, [5], digest="0" * 64)
    not_a_record = json.dumps({"prompt_id": "p1", "texts": ["x" * 5000]}).encode()
    with pytest.raises(RecordError, match="malformed group record"):
        stream(not_a_record, [100, 3000])


def test_long_prompt_id_never_matches_a_short_one():
    data = encode_bundle(record(["a"], prompt_id="p" * (SHORT_STRING + 1)))
    rec = stream(data, [10])
    assert len(rec.prompt_id) == SHORT_STRING + 1 and rec.prompt_id != "p" * SHORT_STRING


def test_structure_outside_long_strings_is_bounded():
    data = b'{"meta": [' + b",".join([b'"' + b"s" * 200 + b'"'] * 30000) + b"]}"
    with pytest.raises(RecordError, match="outside its strings"):
        stream(data, list(range(0, len(data), 2**20)))


@pytest.mark.parametrize("text", ["é" + "x\\\"y\n" * (4 * 2**20 - 1), "xy z" * (4 * 2**20 + 1)],
                         ids=["escapes", "plain"])
def test_memory_is_bounded_by_the_chunk(text):
    """A 16 MiB bundle of one 16 MiB text, fed in 256 KiB chunks: the check holds a few
    chunks' worth (the chunk, its decoded text, the checked piece), not the bundle; with
    escapes (json's scanner) and without (the plain path)."""
    chunk = 256 * 1024
    data = encode_bundle(record([text]))
    assert len(data) > 16 * 2**20
    gc.collect()
    tracemalloc.start()
    try:
        check = BundleStream(digest_of(data))
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for off in range(0, len(data), chunk):
            check.feed(data[off:off + chunk])
        rec = check.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rec.texts[0]) == SHORT_STRING + 1
    assert peak - base < 8 * chunk, f"peak {peak - base} bytes for a {len(data)}-byte bundle in {chunk}-byte chunks"
