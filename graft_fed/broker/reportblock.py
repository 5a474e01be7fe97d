"""One receiver's new reports of a round as one blob: what the SQLite state stores (schema
11, `report_blocks`) instead of a row per group.

A report of 4,096 groups was 4,096 rows of a four-column text key: two B-tree inserts a
group, about 2.8 us each on this machine, a quarter of a second a round at 64 x 4,096 with
every node reporting, and 10 MiB a round on disk (issue 13). The rows are read back only to
find which groups a receiver already reported (a report counts once) and by `reports()`, so
one block per report does: one insert, read back whole.

The block is JSON with the report's columns (the sources as indexes into their distinct
names): Python writes and reads it in C, its floats round-trip exactly (NaN included), and a
damaged one is a clear `ValueError` rather than garbage."""

from __future__ import annotations

import json
from typing import Sequence

#: a reported group as a block holds it: (source, prompt_id, mean_s, admitted_fraction,
#: rejected, undelivered)
BlockEntry = tuple[str, str, float, float, bool, bool]

_VERSION = 1
_COLUMNS = ("source", "prompt_id", "mean_s", "admitted_fraction", "rejected", "undelivered")


def encode_report_block(entries: Sequence[BlockEntry]) -> bytes:
    names = sorted({e[0] for e in entries})
    at = {name: i for i, name in enumerate(names)}
    doc = {"v": _VERSION, "sources": names, "source": [at[e[0]] for e in entries],
           "prompt_id": [e[1] for e in entries], "mean_s": [e[2] for e in entries],
           "admitted_fraction": [e[3] for e in entries], "rejected": [int(e[4]) for e in entries],
           "undelivered": [int(e[5]) for e in entries]}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_report_block(data: bytes) -> list[BlockEntry]:
    """The block's entries, in the order stored; ValueError when it is not one this code wrote."""
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a report block that is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("v") != _VERSION:
        raise ValueError("a report block of an unknown version")
    names, cols = doc.get("sources"), [doc.get(c) for c in _COLUMNS]
    if not isinstance(names, list) or not all(isinstance(c, list) for c in cols) \
            or len({len(c) for c in cols}) != 1:
        raise ValueError("a report block whose columns are missing or differ in length")
    sources, prompts, mean_s, admitted, rejected, undelivered = cols
    if not all(type(s) is int and 0 <= s < len(names) for s in sources):
        raise ValueError("a report block naming a source it does not hold")
    try:
        out = [(names[s], p, float(m), float(a), bool(r), bool(u))
               for s, p, m, a, r, u in zip(sources, prompts, mean_s, admitted, rejected, undelivered)]
    except (IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"a report block with a malformed entry ({exc})") from None
    if not all(isinstance(e[0], str) and isinstance(e[1], str) for e in out):
        raise ValueError("a report block with a source or prompt id that is not a string")
    return out
