"""Trajectory bundles: a group record as canonical bytes, addressed by its sha256.

Canonical JSON (sorted keys, no spaces, floats as Python's shortest round-trip repr) so
the same group always has the same digest, and every double survives bit for bit.
"""

from __future__ import annotations

import hashlib
import json

from graft_fed.core.records import GroupRecord, RecordError


def encode_bundle(record: GroupRecord) -> bytes:
    return json.dumps(record.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_bundle(data: bytes, expected_digest: str) -> GroupRecord:
    """Check the digest, parse, validate. Raises RecordError on any mismatch."""
    actual = digest_of(data)
    if actual != expected_digest:
        raise RecordError(f"bundle digest mismatch: expected {expected_digest}, got {actual}")
    try:
        payload = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"bundle {expected_digest[:12]} is not UTF-8 JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise RecordError(f"bundle {expected_digest[:12]} is not a JSON object")
    return GroupRecord.from_dict(payload)


def is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
