"""The proto codec: federation messages (graft_fed/federation/messages.py) <-> wire messages.

Only this module, the broker's servicer and the node's client touch graft_fed.proto.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    import numpy as np

from graft_fed.core.advantages import PAPER_ADVANTAGE
from graft_fed.federation.manifest import Manifest
from graft_fed.federation.messages import MatchResult, Offer, Privacy, ReportColumns, ReportEntry, SummaryRow
from graft_fed.federation.errors import InvalidArgument
from graft_fed.federation.limits import INT64_MAX, MAX_REPEATED, MAX_STRING_LEN, check_string
from graft_fed.federation.protowire import read_shortest_varint, read_varint, varint as _varint
from graft_fed.federation.summaryblock import SummaryBlock, facts_of, intern_ids
from graft_fed.proto import broker_pb2 as pb
from graft_fed.proto import views_pb2

MODES = {pb.MODE_SYNC: "sync", pb.MODE_ASYNC: "async"}
MODE_CODES = {v: k for k, v in MODES.items()}
PRIVACY = {pb.PRIVACY_SHARE_ALL: Privacy.SHARE_ALL.value, pb.PRIVACY_MATCHED_ONLY: Privacy.MATCHED_ONLY.value,
           pb.PRIVACY_SUMMARIES_ONLY: Privacy.SUMMARIES_ONLY.value}
PRIVACY_CODES = {v: k for k, v in PRIVACY.items()}


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    return pb.Manifest(federation_id=m.federation_id, protocol_version=m.protocol_version, dataset_id=m.dataset_id,
                       dataset_hash=m.dataset_hash, seed=m.seed, n=m.n, prompts_per_round=m.prompts_per_round,
                       mode=MODE_CODES.get(m.mode, pb.MODE_UNSPECIFIED), verifier_name=m.verifier_name,
                       verifier_version=m.verifier_version, staleness_rounds=m.staleness_rounds,
                       advantage=m.advantage)


def manifest_from_pb(m: pb.Manifest) -> Manifest:
    return Manifest(federation_id=m.federation_id, protocol_version=m.protocol_version, dataset_id=m.dataset_id,
                    dataset_hash=m.dataset_hash, seed=m.seed, n=m.n, prompts_per_round=m.prompts_per_round,
                    mode=MODES.get(m.mode, ""), verifier_name=m.verifier_name, verifier_version=m.verifier_version,
                    staleness_rounds=m.staleness_rounds, advantage=m.advantage or PAPER_ADVANTAGE)


def privacy_from_pb(code: int) -> str:
    """The privacy level's name; "" for a code this version does not know (the broker refuses it)."""
    return PRIVACY.get(code, "")


def summary_to_pb(s: SummaryRow) -> pb.GroupSummary:
    return pb.GroupSummary(prompt_id=s.prompt_id, round=s.round, policy_version=s.policy_version, n=s.n, k=s.k,
                           reward_mean=s.reward_mean, reward_std=s.reward_std, lengths=s.lengths,
                           mean_logprobs=s.mean_logprobs, bundle_digest=s.bundle_digest)


def summaries_from_pb(request: pb.PublishRequest) -> list[SummaryRow]:
    return [SummaryRow(node_id=request.node_id, round=s.round, prompt_id=s.prompt_id,
                       policy_version=s.policy_version, n=s.n, k=s.k, reward_mean=s.reward_mean,
                       reward_std=s.reward_std, lengths=list(s.lengths), mean_logprobs=list(s.mean_logprobs),
                       bundle_digest=s.bundle_digest)
            for s in request.summaries]


class SummariesInBulk:
    """A PublishRequest's summaries read in bulk (`summaries_in_bulk`): the block, and what the
    uniform bounds of federation/limits.py need to know about the summaries."""

    __slots__ = ("block", "rounds", "policy_versions")

    def __init__(self, block: SummaryBlock, rounds: "np.ndarray | None", policy_versions: "np.ndarray") -> None:
        # rounds: each summary's round, None where they have none of their own (columns: the request's)
        self.block, self.rounds, self.policy_versions = block, rounds, policy_versions

    def rounds_are(self, round: int) -> bool:
        """Every summary is of `round`."""
        return self.rounds is None or not (self.rounds != round).any()

    def within_bounds(self) -> bool:
        """What check_message would find for the summaries: integers fit int64, strings and
        lists within their bounds."""
        b = self.block
        return bool((not len(b) or ((self.rounds is None or int(self.rounds.max()) <= INT64_MAX)
                                    and int(self.policy_versions.max()) <= INT64_MAX
                                    and int(b.n_lengths.max()) <= MAX_REPEATED
                                    and int(b.n_logprobs.max()) <= MAX_REPEATED
                                    and _longest(b.prompt_ids) <= MAX_STRING_LEN))
                    and (b.digests is None or max(map(len, b.digests)) <= MAX_STRING_LEN))


def _longest(pids: list[str]) -> int:
    """The length of the longest prompt id (memoised for an interned list)."""
    facts = facts_of(pids)
    if facts is None:
        return max(map(len, pids), default=0)
    got = facts.get("longest")
    if got is None:
        got = facts["longest"] = max(map(len, pids), default=0)
    return got


def _varints(raw: bytes) -> "np.ndarray | None":
    """Packed uint32 varints as int64 (truncated to 32 bits as protobuf does); None when the
    bytes do not end a varint or one is longer than 10 bytes."""
    import numpy as np

    b = np.frombuffer(raw, dtype=np.uint8)
    last = b < 0x80  # the last byte of each varint
    if last.all():
        return b.astype(np.int64)
    if not last[-1]:
        return None
    ends = np.flatnonzero(last)
    starts = np.concatenate([[0], ends[:-1] + 1])
    if int((ends - starts).max()) >= 10:
        return None
    group = np.repeat(np.arange(ends.size), ends - starts + 1)  # which varint each byte belongs to
    shift = (np.arange(b.size) - starts[group]) * 7
    parts = (b & 0x7F).astype(np.uint64) << np.minimum(shift, 63).astype(np.uint64)
    parts[shift > 63] = 0
    vals = np.add.reduceat(parts, starts)  # the 7-bit groups do not overlap: their sum is their OR
    return (vals & np.uint64(0xFFFFFFFF)).astype(np.int64)


def summaries_in_bulk(request: pb.PublishRequest, raw: bytes) -> SummariesInBulk | None:
    """The request's summaries as one SummaryBlock, reading the per-response lists as raw
    packed bytes (graft_fed.v1 views.proto) rather than one Python number at a time. `raw`
    are the bytes `request` was parsed from. None when some list is not packed (a legal but
    unusual encoding): then read the summaries one by one (`summaries_from_pb`)."""
    import numpy as np

    summaries = request.summaries
    if not summaries:
        return SummariesInBulk(SummaryBlock.from_columns(request.node_id, request.round, [], *([[]] * 9)),
                               np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64))
    cols = [(s.prompt_id, s.round, s.policy_version, s.n, s.k, s.reward_mean, s.reward_std, len(s.lengths),
             len(s.mean_logprobs), s.bundle_digest) for s in summaries]
    pids, rounds, versions, n, k, rmean, rstd, n_len, n_lp, digests = zip(*cols)
    lists = views_pb2.SummaryListsView.FromString(b"".join(views_pb2.PublishSummariesView.FromString(raw).summaries))
    n_len_a, n_lp_a = np.array(n_len, dtype=np.int64), np.array(n_lp, dtype=np.int64)
    lp_raw = b"".join(lists.mean_logprobs)
    if len(lp_raw) != 8 * int(n_lp_a.sum()):
        return None
    lengths = _varints(b"".join(lists.lengths))
    if lengths is None or lengths.size != int(n_len_a.sum()):
        return None
    rounds_a, versions_a = np.array(rounds, dtype=np.uint64), np.array(versions, dtype=np.uint64)
    block = SummaryBlock(request.node_id, request.round, list(pids), versions_a.astype(np.int64),
                         np.array(n, dtype=np.int64), np.array(k, dtype=np.int64), np.array(rmean, dtype=np.float64),
                         np.array(rstd, dtype=np.float64), n_len_a, n_lp_a, lengths,
                         np.frombuffer(lp_raw, dtype="<f8").astype(np.float64), list(digests) if any(digests) else None)
    return SummariesInBulk(block, rounds_a, versions_a)


def columns_to_pb(summaries: Sequence) -> "pb.SummaryColumns | None":
    """SummaryColumns for SummaryRows or GroupSummary messages; None when they do not fit
    columns (a bundle digest, differing counts of lengths and mean log-probs), which then
    travel as `summaries` so the broker judges exactly what was sent."""
    import numpy as np

    if any(s.bundle_digest or len(s.lengths) != len(s.mean_logprobs) for s in summaries):
        return None
    return pb.SummaryColumns(
        prompt_ids=[s.prompt_id for s in summaries],
        policy_versions=np.array([s.policy_version for s in summaries], dtype="<u8").tobytes(),
        n=np.array([s.n for s in summaries], dtype="<u4").tobytes(),
        k=np.array([s.k for s in summaries], dtype="<u4").tobytes(),
        reward_means=np.array([s.reward_mean for s in summaries], dtype="<f8").tobytes(),
        reward_stds=np.array([s.reward_std for s in summaries], dtype="<f8").tobytes(),
        n_responses=np.array([len(s.lengths) for s in summaries], dtype="<u4").tobytes(),
        lengths=np.array([x for s in summaries for x in s.lengths], dtype="<u4").tobytes(),
        mean_logprobs=np.array([x for s in summaries for x in s.mean_logprobs], dtype="<f8").tobytes())


# ----- a publish read on the wire -----------------------------------------------------------
# Every node of a synchronous round publishes the same prompt ids, and turning 4,096 of them
# into Python strings and interning the list took ~0.3 ms of each publish's ~4 ms under the
# interpreter lock (issue 13). The last few interned lists are kept with their encoding as
# SummaryColumns.prompt_ids (field 1, in order, as a serializer writes them before the other
# fields). `parse_publish` reads a publish whose columns are that encoding followed by the
# array fields, each once and length-delimited, without parsing its columns at all: protobuf
# parsing a 4,096-prompt publish took ~0.18 ms and half a megabyte of fresh memory, in the
# thread that receives every publish (issue 13, thirtieth pass). Anything else (another order
# of fields, another list, one more id, the columns field twice, an array field twice or of
# another wire type, an unknown field) is parsed whole by protobuf as before.
_IDS_TAG = b"\x0a"  # SummaryColumns.prompt_ids: field 1, length-delimited
_COLUMNS_FIELD = 6  # PublishRequest.columns
_WIRE_KEEP = 8
_wire_ids: list[tuple[bytes, list[str]]] = []  # (encoding, interned list), the newest last
_wire_lock = threading.Lock()


def _has_at(raw: bytes, pos: int, part: bytes) -> bool:
    """`raw` holds `part` at `pos` (compared in place: a slice of bytes is a copy, 80 KB of
    prompt ids a publish at 4,096 prompts)."""
    if isinstance(raw, (bytes, bytearray)):
        return raw.startswith(part, pos)
    return bytes(raw[pos:pos + len(part)]) == part


class ColumnsOnWire:
    """A publish's SummaryColumns read in place (`parse_publish`): the interned list of its
    prompt ids and its array fields as views of the request's bytes."""

    __slots__ = ("ids", "arrays")

    def __init__(self, ids: list[str], arrays: dict[str, memoryview]) -> None:
        self.ids, self.arrays = ids, arrays


#: fields `_one_field` scans at most before it leaves a message to protobuf whole: a chunk or
#: a publish with columns has a dozen; a peer padding one with tiny unknown fields would
#: otherwise cost a Python loop per field (0.14 s per MiB, against 1.5 ms for protobuf)
MAX_SCANNED_FIELDS = 64


def _one_field(raw: bytes, number: int) -> tuple[int, int, int] | None:
    """(where field `number`'s tag starts, where its payload starts, where it ends) in
    `raw`, when the message's fields are well formed and the field occurs exactly once,
    length-delimited, its tag and length in their shortest encoding; else None (it is
    absent, repeated, of another wire type, or written otherwise: the caller then lets
    protobuf parse the whole message)."""
    pos, end, found, fields = 0, len(raw), None, 0
    try:
        while pos < end:
            fields += 1
            if fields > MAX_SCANNED_FIELDS:
                return None
            start = pos
            key, pos = read_varint(raw, pos)
            wire_type = key & 7
            if key >> 3 == number and (wire_type != 2 or found is not None or pos - start != 1):
                return None  # twice, of another wire type, or its tag in more than a byte
            if wire_type == 0:
                _, pos = read_varint(raw, pos)
            elif wire_type == 2:
                if key >> 3 == number:
                    size, pos = read_shortest_varint(raw, pos)
                    found = (start, pos, pos + size)
                else:
                    size, pos = read_varint(raw, pos)  # (the bytes around the field: protobuf parses them)
                pos += size
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:
                return None
    except (IndexError, ValueError):
        return None
    return found if pos == end and found is not None else None


def _columns_on_wire(raw: bytes, start: int, end: int) -> ColumnsOnWire | None:
    """The columns at raw[start:end] read in place, when they are one of the last few
    interned lists' encoding followed by the plain array fields (see above); None otherwise."""
    with _wire_lock:
        known = list(_wire_ids)
    for wire, ids in reversed(known):
        if start + len(wire) <= end and _has_at(raw, start, wire) and facts_of(ids) is not None:
            # (still interned: its memos, validity and length, are there) one more id, or
            # anything but the array fields, after the list: None from _array_spans
            arrays = _array_spans(raw, start + len(wire), end)
            if arrays is not None:
                return ColumnsOnWire(ids, arrays)
    return None


def parse_publish(data: bytes) -> tuple[pb.PublishRequest, ColumnsOnWire | None]:
    """A PublishRequest from its bytes, as `PublishRequest.FromString` reads it, and its
    columns read in place when they are a known list in the plain layout (see above): the
    message then has no `columns` (the other fields are parsed from the bytes around them,
    and are what the whole message holds: the columns field occurs once, so nothing merges
    with it). Raises what FromString raises for bytes that do not parse."""
    found = _one_field(data, _COLUMNS_FIELD)
    if found is not None:
        on_wire = _columns_on_wire(data, found[1], found[2])
        if on_wire is not None:
            try:
                return pb.PublishRequest.FromString(data[:found[0]] + data[found[2]:]), on_wire
            except Exception:  # noqa: BLE001 - the whole message, parsed below, raises protobuf's own error
                pass
    return pb.PublishRequest.FromString(data), None


_DATA_FIELD = pb.BundleChunk.DESCRIPTOR.fields_by_name["data"].number


def parse_chunk(raw: bytes) -> tuple[pb.BundleChunk, bytes]:
    """A BundleChunk from its bytes, as `BundleChunk.FromString` reads it, with its `data`
    apart: (the message without data, data). protobuf copies a bytes field into the message
    when it parses it and again at each access (a mebibyte a chunk, several times over in a
    handler); here, when the data field occurs once in its shortest encoding, only the bytes
    around it are parsed and the data is one slice of `raw` (issue 13). Anything else is
    parsed whole and the data taken out once. Raises what FromString raises for bytes that
    do not parse."""
    found = _one_field(raw, _DATA_FIELD)
    if found is not None:
        try:
            return pb.BundleChunk.FromString(raw[:found[0]] + raw[found[2]:]), raw[found[1]:found[2]]
        except Exception:  # noqa: BLE001 - the whole message, parsed below, raises protobuf's own error
            pass
    message = pb.BundleChunk.FromString(raw)
    data = message.data
    message.ClearField("data")
    return message, data


def chunk_bytes(header: pb.BundleChunk, data: bytes | memoryview) -> bytes:
    """A BundleChunk's wire bytes: `header` (a chunk without data) with `data` as its data
    field, in one copy of the data (building the message and serialising it copies it
    twice). protobuf reads fields in any order, so the data follows the header's fields."""
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint(len(data)), data))


_DATA_TAG = _varint(_DATA_FIELD << 3 | 2)


def wire_bytes(message: Any) -> bytes:
    """A message's wire bytes; bytes (a message encoded already) pass as they are. The
    serializer where a call takes either (an upload's chunks, a GetMatches answer)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


# SummaryColumns' fields after its prompt ids, all `bytes`: field number -> name
_ARRAY_FIELDS = {f.number: f.name for f in pb.SummaryColumns.DESCRIPTOR.fields if f.name != "prompt_ids"}


def _array_spans(raw: bytes, start: int, end: int) -> dict[str, memoryview] | None:
    """The array fields of SummaryColumns in `raw[start:end]` (the columns after their prompt
    ids) as views of `raw`, read without copying them (protobuf hands out a new copy of a
    bytes field at each access: 0.6 MB a publish at 4,096 prompts, issue 13). Only for the
    plain case: every field at most once, each length-delimited, no prompt id or other field
    among them, each tag one byte and each length in its shortest encoding; None for anything
    else, which the parsed message then answers."""
    view = memoryview(raw)
    out: dict[str, memoryview] = {}
    pos = start
    try:
        while pos < end:
            key = raw[pos]  # fields 2-9, length-delimited: one byte (a longer tag's first byte names no field here)
            pos += 1
            name = _ARRAY_FIELDS.get(key >> 3)
            if name is None or key & 7 != 2 or name in out:
                return None
            size, pos = read_shortest_varint(raw, pos)
            if pos + size > end:
                return None
            out[name] = view[pos:pos + size]
            pos += size
    except (IndexError, ValueError):
        return None
    if pos != end:
        return None
    for name in _ARRAY_FIELDS.values():
        out.setdefault(name, view[0:0])  # absent: empty, as protobuf reads it
    return out


def _learn_ids(raw: bytes, span: tuple[int, int], pids: list[str]) -> None:
    """Remember an interned list's encoding once a second publish brought it, when `raw`
    encodes it as this module expects (first in the columns at `span`, in order)."""
    facts = facts_of(pids)
    if facts is None or "wire" in facts:
        return
    facts["seen"] = seen = facts.get("seen", 0) + 1
    if seen < 2:
        return
    wire = b"".join(_IDS_TAG + _varint(len(e)) + e for e in (p.encode() for p in pids))
    facts["wire"] = ok = _has_at(raw, span[0], wire)
    if ok:
        with _wire_lock:
            _wire_ids[:] = [(w, i) for w, i in _wire_ids if i is not pids][-(_WIRE_KEEP - 1):] + [(wire, pids)]


def summaries_from_columns(request: pb.PublishRequest, raw: bytes | None = None,
                           on_wire: ColumnsOnWire | None = None) -> SummariesInBulk:
    """The request's SummaryColumns as a block (`on_wire`'s, when `parse_publish` read them
    in place); InvalidArgument when an array's size does not fit the number of prompt ids,
    or the prompt ids break the uniform bounds of federation/limits.py (the servicer's
    check_message leaves the columns to this function, with the same messages). The prompt
    ids are interned (federation/summaryblock.py); with `raw`, the bytes `request` was
    parsed from, a list's encoding is learnt there from its second sighting (above)."""
    import numpy as np

    if on_wire is not None:
        pids, arrays = on_wire.ids, on_wire.arrays
        count = len(pids)
    else:
        c = request.columns
        count = len(c.prompt_ids)
        if count > MAX_REPEATED:
            raise InvalidArgument(f"columns.prompt_ids has {count} entries; at most {MAX_REPEATED}")
        pids = intern_ids(list(c.prompt_ids))
        found = _one_field(raw, _COLUMNS_FIELD) if raw is not None and count else None
        if found is not None:
            _learn_ids(raw, found[1:], pids)
        arrays = {name: getattr(c, name) for name in _ARRAY_FIELDS.values()}  # each read once: each access copies
    if _longest(pids) > MAX_STRING_LEN:
        check_string("columns.prompt_ids", next(p for p in pids if len(p) > MAX_STRING_LEN))
    for name, width in (("policy_versions", 8), ("n", 4), ("k", 4), ("reward_means", 8), ("reward_stds", 8),
                        ("n_responses", 4)):
        size = len(arrays[name])
        if size != width * count:
            raise InvalidArgument(f"columns.{name} holds {size} bytes; {count} groups need {width * count}")
    per = np.frombuffer(arrays["n_responses"], dtype="<u4")
    total = int(per.sum(dtype=np.int64))
    for name, width in (("lengths", 4), ("mean_logprobs", 8)):
        size = len(arrays[name])
        if size != width * total:
            raise InvalidArgument(f"columns.{name} holds {size} bytes; n_responses say {total} values of {width}")
    versions = np.frombuffer(arrays["policy_versions"], dtype="<u8")
    # read-only views of the request's bytes, the unsigned columns as they came (the block
    # takes any integer type int64 holds; its encoding narrows them): a copy each, and one
    # to int64 each, was about a third of a publish's decoding at 4,096 prompts
    block = SummaryBlock(request.node_id, request.round, pids, versions.astype(np.int64),
                         np.frombuffer(arrays["n"], dtype="<u4"), np.frombuffer(arrays["k"], dtype="<u4"),
                         np.frombuffer(arrays["reward_means"], dtype="<f8").astype(np.float64, copy=False),
                         np.frombuffer(arrays["reward_stds"], dtype="<f8").astype(np.float64, copy=False), per, per,
                         np.frombuffer(arrays["lengths"], dtype="<u4"),
                         np.frombuffer(arrays["mean_logprobs"], dtype="<f8").astype(np.float64, copy=False))
    return SummariesInBulk(block, None, versions)  # columns carry no round of their own: the request's


def match_result_to_pb(res: MatchResult) -> pb.MatchResponse:
    return pb.MatchResponse(
        ready=res.ready,
        offers=[pb.MatchOffer(prompt_id=o.prompt_id, source_node_id=o.source_node, source_model_id=o.source_model,
                              source_round=o.source_round, source_k=o.k, source_n=o.n, bundle_digest=o.digest)
                for o in res.offers],
        upload_requests=[pb.UploadRequest(prompt_id=p, round=r) for p, r in res.upload_requests],
        candidates=res.candidates, solved_by_peers=res.solved_by_peers)


# ----- MatchResponse written directly on the wire ------------------------------------------
# A round of 64 nodes x 4,096 prompts answers each receiver with ~1,200 offers and its ~1,000
# upload requests; building that many MatchOffer messages per answer took the broker tens of
# milliseconds each (issue 13). The broker encodes a receiver's offers once per round (and
# again only when a bundle digest arrives) with the functions below, from plain tuples, and
# serves the answer as bytes: the fixed fields of MatchResponse followed by the cached
# offers. Protobuf parses fields in any order and appends repeated ones, so the bytes parse
# to the same message (tests/federation/test_match_wire.py).

_SMALL = [bytes((i,)) for i in range(128)]


def _delimited(tag: bytes, payload: bytes) -> bytes:
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else _varint(n)) + payload


def offers_wire(offers: Iterable[tuple[str, str, str, int, int, int, str]]) -> bytes:
    """MatchResponse.offers (field 2) for (prompt id, source node, source model, source round,
    k, n, digest) tuples, in order: bytes to append to a serialised MatchResponse."""
    parts = []
    source_cache: dict[tuple[str, str], bytes] = {}
    tail_cache: dict[tuple[int, int, int], bytes] = {}
    for pid, source, model, rnd, k, n, digest in offers:
        src = source_cache.get((source, model))
        if src is None:
            src = source_cache[(source, model)] = (_delimited(b"\x12", source.encode()) if source else b"") + (
                _delimited(b"\x1a", model.encode()) if model else b"")
        tail = tail_cache.get((rnd, k, n))
        if tail is None:
            tail = tail_cache[(rnd, k, n)] = ((b"\x20" + _varint(rnd) if rnd else b"") + (b"\x28" + _varint(k) if k else b"")
                                              + (b"\x30" + _varint(n) if n else b""))
        body = (_delimited(b"\x0a", pid.encode()) if pid else b"") + src + tail + (
            _delimited(b"\x3a", digest.encode()) if digest else b"")
        parts.append(_delimited(b"\x12", body))
    return b"".join(parts)


class OfferEncoder:
    """MatchResponse.offers of one round's matches, from arrays: every prompt id and every
    source (with its model and each k) is encoded once per round, so that an offer is three
    pieces gathered from tables by numpy and joined in C (a MatchOffer message cost several
    microseconds; the same offers as Python concatenations about 0.4 us each, issue 13)."""

    def __init__(self, pids: Sequence[str], nodes: Sequence[str], models: Sequence[str], round: int, n: int) -> None:
        self.round, self.n = round, n
        self._pids = [_delimited(b"\x0a", p.encode()) if p else b"" for p in pids]
        self._sources = [(_delimited(b"\x12", s.encode()) if s else b"") + (_delimited(b"\x1a", m.encode()) if m else b"")
                         for s, m in zip(nodes, models)]
        self._tables: tuple | None = None  # (k values covered, pid pieces, their sizes, source+tail pieces, sizes)

    def _tail(self, k: int) -> bytes:
        return ((b"\x20" + _varint(self.round) if self.round else b"") + (b"\x28" + _varint(k) if k else b"")
                + (b"\x30" + _varint(self.n) if self.n else b""))

    def _pieces(self, n_k: int) -> tuple:
        """The tables of pieces, for k in 0..n_k - 1 at least (built once per round)."""
        import numpy as np

        if self._tables is None or self._tables[0] < n_k:
            n_k = max(n_k, self.n + 1)
            tails = [self._tail(v) for v in range(n_k)]
            src_k = [s + t for s in self._sources for t in tails]

            def table(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
                arr = np.empty(len(items), dtype=object)
                arr[:] = items
                return arr, np.fromiter(map(len, items), dtype=np.int64, count=len(items))

            self._tables = (n_k, *table(self._pids), *table(src_k))
        return self._tables

    def encode(self, col: np.ndarray, src: np.ndarray, k: np.ndarray, digests: Sequence[str] | None = None) -> bytes:
        """The offers (prompt column, source index, k, digest), each encoded as one
        MatchResponse.offers field, in order: bytes to append to a serialised MatchResponse."""
        import numpy as np

        if not len(col):
            return b""
        n_k, pids, pid_size, src_k, src_k_size = self._pieces(int(k.max()) + 1)
        j = src.astype(np.int64) * n_k + k
        body = pid_size[col] + src_k_size[j]
        if digests is not None and any(digests):
            small = _SMALL
            bodies = [p + sk + (_delimited(b"\x3a", d.encode()) if d else b"")
                      for p, sk, d in zip(pids[col].tolist(), src_k[j].tolist(), digests)]
            return b"".join([b"\x12" + (small[len(b)] if len(b) < 128 else _varint(len(b))) + b for b in bodies])
        sizes, which = np.unique(body, return_inverse=True)
        heads = np.empty(len(sizes), dtype=object)
        heads[:] = [b"\x12" + (_SMALL[b] if b < 128 else _varint(b)) for b in sizes.tolist()]
        pieces = np.empty((len(col), 3), dtype=object)
        pieces[:, 0] = heads[which.reshape(-1)]
        pieces[:, 1] = pids[col]
        pieces[:, 2] = src_k[j]
        return b"".join(pieces.reshape(-1).tolist())


def upload_requests_wire(requests: Iterable[tuple[str, int]]) -> bytes:
    """MatchResponse.upload_requests (field 3) for (prompt id, round) pairs, in order."""
    parts = []
    for pid, rnd in requests:
        body = (_delimited(b"\x0a", pid.encode()) if pid else b"") + (b"\x10" + _varint(rnd) if rnd else b"")
        parts.append(_delimited(b"\x1a", body))
    return b"".join(parts)


def match_result_to_wire(res: MatchResult) -> bytes:
    """The serialised MatchResponse of `res`: its pre-encoded offers (`res.offers_wire`) and
    upload requests (`res.uploads_wire`) when the broker cached them, else encoded here."""
    head = pb.MatchResponse(ready=res.ready, candidates=res.candidates,
                            solved_by_peers=res.solved_by_peers).SerializeToString()
    offers = res.offers_wire if res.offers_wire is not None else offers_wire(
        (o.prompt_id, o.source_node, o.source_model, o.source_round, o.k, o.n, o.digest) for o in res.offers)
    uploads = res.uploads_wire if res.uploads_wire is not None else upload_requests_wire(res.upload_requests)
    return head + offers + uploads


def match_result_from_pb(resp: pb.MatchResponse) -> MatchResult:
    return MatchResult(
        ready=resp.ready,
        offers=[Offer(prompt_id=o.prompt_id, source_node=o.source_node_id, source_model=o.source_model_id,
                      source_round=o.source_round, k=o.source_k, n=o.source_n, digest=o.bundle_digest)
                for o in resp.offers],
        upload_requests=[(u.prompt_id, u.round) for u in resp.upload_requests],
        candidates=resp.candidates, solved_by_peers=resp.solved_by_peers)


def report_entries_to_pb(entries: Sequence[ReportEntry]) -> list[pb.CompatibilityReport.Entry]:
    return [pb.CompatibilityReport.Entry(source_node_id=e.source, prompt_id=e.prompt_id, mean_s=e.mean_s,
                                         admitted_fraction=e.admitted_fraction, rejected=e.rejected,
                                         undelivered=e.undelivered)
            for e in entries]


class PbReportEntries:
    """A CompatibilityReport's entries, read only when asked: the broker reads them inside a
    work slot (not 64 threads at once) and no further than its limit, as columns
    (`columns`), no object per entry. Each string is checked against the uniform bound as it
    is read (InvalidArgument, in check_message's words): the servicer only counted them.
    Iterating gives `ReportEntry`s, checked the same way."""

    __slots__ = ("_entries",)

    def __init__(self, request: pb.CompatibilityReport) -> None:
        self._entries = request.entries

    def columns(self, limit: int) -> ReportColumns:
        """The first `limit + 1` entries at most (more than `limit`: the caller refuses the report)."""
        cols = ReportColumns.empty()
        sources, prompts, mean_s, admitted, rejected, undelivered = (col.append for col in cols)
        for e in itertools.islice(self._entries, limit + 1):
            sources(e.source_node_id)
            prompts(e.prompt_id)
            mean_s(e.mean_s)
            admitted(e.admitted_fraction)
            rejected(e.rejected)
            undelivered(e.undelivered)
        if cols.sources and max(max(map(len, cols.sources)), max(map(len, cols.prompt_ids))) > MAX_STRING_LEN:
            for source, prompt in zip(cols.sources, cols.prompt_ids):  # the first one too long, as read
                check_string("entries.source_node_id", source)
                check_string("entries.prompt_id", prompt)
        return cols

    def __iter__(self) -> Iterator[ReportEntry]:
        for e in self._entries:
            source, prompt = e.source_node_id, e.prompt_id
            check_string("entries.source_node_id", source)
            check_string("entries.prompt_id", prompt)
            yield ReportEntry(source, prompt, e.mean_s, e.admitted_fraction, e.rejected, e.undelivered)


def report_entries_from_pb(request: pb.CompatibilityReport) -> PbReportEntries:
    """The entries of a report, read lazily (`PbReportEntries`)."""
    return PbReportEntries(request)
