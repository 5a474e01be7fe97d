"""One receiver's new reports of a round as one blob: what the SQLite state stores (schema
11, `report_blocks`) instead of a row per group.

A report of 1,229 groups was 1,229 rows of a four-column text key: two B-tree inserts a
group, 78,000 a round at 64 x 4,096 with every node reporting, and 10 MiB a round on disk
(issue 13). The rows are read back only to find which groups a receiver already reported
(a report counts once) and by `reports()`, so one block per receiver and round does: one
write per report, read back whole (a later report of the round rewrites it).

Layout (little-endian): b"GFR1", the entry count n (u32) and the header's length (u32);
the header, JSON: {"sources": the distinct source names, "prompt_ids": n strings}; then
the columns: source (u32 index into "sources", n), mean_s (f64, n), admitted_fraction
(f64, n), rejected (u8, n), undelivered (u8, n). The floats are stored bit for bit (NaN,
-0.0 included; JSON's float text took 0.5 ms a column of 1,229), the strings as JSON (any
valid Unicode). A block that is not one this code wrote is a `ValueError` saying so."""

from __future__ import annotations

import json
import struct
from typing import Sequence

import numpy as np

from graft_fed.federation.messages import ReportColumns

#: a reported group as a block holds it: (source, prompt_id, mean_s, admitted_fraction,
#: rejected, undelivered)
BlockEntry = tuple[str, str, float, float, bool, bool]

_MAGIC = b"GFR1"
_HEAD = struct.Struct("<4sII")


def encode_report_columns(cols: ReportColumns) -> bytes:
    """The block of a receiver's reports given as columns (what the SQLite state holds)."""
    n = len(cols.sources)
    names = sorted(set(cols.sources))
    at = {name: i for i, name in enumerate(names)}
    header = json.dumps({"sources": names, "prompt_ids": list(cols.prompt_ids)}, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(_MAGIC, n, len(header)), header,
                     np.fromiter(map(at.__getitem__, cols.sources), dtype="<u4", count=n).tobytes(),
                     np.asarray(cols.mean_s, dtype="<f8").tobytes(),
                     np.asarray(cols.admitted_fraction, dtype="<f8").tobytes(),
                     bytes(map(bool, cols.rejected)), bytes(map(bool, cols.undelivered))])


def encode_report_block(entries: Sequence[BlockEntry]) -> bytes:
    """The block of entries given one by one."""
    return encode_report_columns(ReportColumns(*(list(c) for c in zip(*entries))) if entries else
                                 ReportColumns.empty())


def decode_report_columns(data: bytes) -> ReportColumns:
    """The block's entries as columns, in the order stored; ValueError when it is not one
    this code wrote (whatever it is: text, a header nested too deep, ...)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"a report block stored as {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) < _HEAD.size or data[:4] != _MAGIC:
        raise ValueError("a report block without its GFR1 header")
    _, n, head_len = _HEAD.unpack_from(data)
    start = _HEAD.size + head_len
    if len(data) != start + n * (4 + 8 + 8 + 1 + 1):
        raise ValueError(f"a report block of {len(data)} bytes, not what its header says ({n} entries)")
    try:
        header = json.loads(data[_HEAD.size:start])
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep
        raise ValueError(f"a report block whose header is not JSON ({type(exc).__name__})") from None
    names = header.get("sources") if isinstance(header, dict) else None
    prompts = header.get("prompt_ids") if isinstance(header, dict) else None
    if not (isinstance(names, list) and isinstance(prompts, list) and len(prompts) == n
            and all(isinstance(x, str) for x in names) and all(isinstance(x, str) for x in prompts)):
        raise ValueError("a report block whose header does not name its sources and prompt ids as strings")
    at = start
    source = np.frombuffer(data, dtype="<u4", count=n, offset=at)
    if n and int(source.max()) >= len(names):
        raise ValueError("a report block naming a source it does not hold")
    at += 4 * n
    mean_s = np.frombuffer(data, dtype="<f8", count=n, offset=at).tolist()
    at += 8 * n
    admitted = np.frombuffer(data, dtype="<f8", count=n, offset=at).tolist()
    at += 8 * n
    flags = data[at:]
    if max(flags, default=0) > 1:
        raise ValueError("a report block whose flags are not 0 or 1")
    return ReportColumns(list(map(names.__getitem__, source.tolist())), prompts, mean_s, admitted,
                         list(map(bool, flags[:n])), list(map(bool, flags[n:])))


def decode_report_block(data: bytes) -> list[BlockEntry]:
    """The block's entries, in the order stored (ValueError as `decode_report_columns`)."""
    return list(zip(*decode_report_columns(data)))
