"""Bounds on everything a peer sends, shared by broker and node (docs/protocol.md, "Limits").

Every string, list and message the broker accepts has a bound here, every integer is
checked to fit a signed 64-bit integer before it reaches the state layer, and an error
message never echoes more than a short prefix of what the client sent (`clip`).
"""

from __future__ import annotations

from typing import Any

from graft_fed.core.records import MAX_GROUP_N, MIN_MEAN_LOGPROB, max_abs_advantage  # noqa: F401 (re-exported)
from graft_fed.federation.errors import InvalidArgument

INT64_MAX = 2**63 - 1
#: node, model and prompt ids
MAX_ID_LEN = 256
#: tokenizer ids (a hub name or a path)
MAX_TOKENIZER_ID_LEN = 1024
#: any other string field of any request (manifest fields, digests, session ids, ...)
MAX_STRING_LEN = 1024
#: a bundle signature (ECDSA P-256 DER is about 72 bytes) and a relayed certificate
MAX_SIGNATURE_BYTES = 1024
MAX_CERT_BYTES = 16 * 1024
#: entries of any repeated field of one request, before any handler looks at it
MAX_REPEATED = 4096
#: digests in one HasBundles call
MAX_DIGESTS_PER_CALL = 4096
#: a publish, and a report, carry at most this many times prompts_per_round entries
MAX_PER_ROUND_FACTOR = 4
#: the largest mean_s a report entry may carry (a receiver clamps to it: s = exp(lbar_R -
#: lbar_S) reaches exp(20) against a source claiming the lowest log-probs screening admits)
MAX_REPORT_MEAN_S = 1e6
#: a round a node opens may be at most this far past the highest round two nodes have
#: published or past its own; one it claims (heartbeat, join) or reports on, this far past
#: that agreed round or one past what it published (broker/rounds.py: no one node moves the
#: others' bound); a heartbeat or join beyond is clamped to it
MAX_ROUNDS_AHEAD = 1000
#: concurrent GetMatches long-polls per node (a graft-fed node runs one at a time)
MAX_LONG_POLLS_PER_NODE = 2
#: uploads and fetches in flight per node (a graft-fed node runs one at a time)
MAX_UPLOADS_PER_NODE = 2
#: publishes waiting or being stored per node (a graft-fed node publishes one at a time; a
#: retry may overlap the first); each holds a handler thread while the publish queue works
MAX_PUBLISHES_PER_NODE = 2
MAX_FETCHES_PER_NODE = 4
#: every chunk of an upload but the last carries at least this many bytes
MIN_CHUNK_BYTES = 16 * 1024
#: characters of client input an error message may quote
MAX_ECHO = 40
#: longest error message sent back (gRPC carries it in a trailer, whose size is limited)
MAX_ERROR_MESSAGE = 1024
#: bundles (canonical JSON): nesting depth, digits of an integer, responses per group
MAX_JSON_DEPTH = 8
MAX_INT_DIGITS = 20
# MAX_GROUP_N, MIN_MEAN_LOGPROB and max_abs_advantage live with the group record
# (graft_fed/core/records.py), which enforces them wherever a record is validated.


def clip(value: Any, n: int = MAX_ECHO) -> str:
    """A short, printable quotation of client input for an error message."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= n:
        return repr(text)
    return f"{text[:n]!r}... ({len(text)} chars)"


def printable(text: str, n: int = MAX_ERROR_MESSAGE) -> str:
    """What a broker or peer sent, fit for a log line or a terminal: at most `n` characters,
    control, format and other category-C characters (and line or paragraph separators)
    escaped, so a hostile sender cannot drive the reader's terminal (ANSI and C1 escape
    sequences) or forge log lines."""
    import unicodedata

    text = text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"
    if text.isascii() and text.isprintable():
        return text
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp") else c
                   for c in text)


def check_int64(value: int, what: str) -> int:
    if not 0 <= value <= INT64_MAX:
        raise InvalidArgument(f"{what}={clip(str(value), 24)} is out of range [0, 2^63-1]")
    return value


def check_string(name: str, value: str) -> None:
    """InvalidArgument naming the field when `value` is longer than MAX_STRING_LEN: the one
    wording of that bound, wherever a request's strings are checked."""
    if len(value) > MAX_STRING_LEN:
        raise InvalidArgument(f"{name} is {len(value)} characters long; at most {MAX_STRING_LEN}")


def check_message(msg: Any, where: str = "", shallow: tuple[str, ...] = ()) -> None:
    """Uniform bounds on a parsed protobuf request, field by field: integers fit int64,
    strings and bytes are bounded, repeated fields hold at most MAX_REPEATED entries.
    Raises InvalidArgument naming the field (never quoting more than a prefix). Message
    fields named in `shallow` are counted but not entered (their caller checks them in bulk:
    a publish's summaries, see broker/servicer.py)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for field, value in msg.ListFields():
        name = f"{where}{field.name}"
        repeated = field.is_repeated
        values = value if repeated else (value,)
        if repeated and len(values) > MAX_REPEATED:
            raise InvalidArgument(f"{name} has {len(values)} entries; at most {MAX_REPEATED}")
        if field.name in shallow:
            continue
        if field.type in (F.TYPE_UINT64, F.TYPE_FIXED64, F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
            for v in values:
                if not -INT64_MAX - 1 <= v <= INT64_MAX:
                    raise InvalidArgument(f"{name}={clip(str(v), 24)} does not fit a signed 64-bit integer")
        elif field.type == F.TYPE_STRING:
            for v in values:
                check_string(name, v)
        elif field.type == F.TYPE_BYTES and field.name in ("signature", "signer_cert"):
            limit = MAX_SIGNATURE_BYTES if field.name == "signature" else MAX_CERT_BYTES
            for v in values:
                if len(v) > limit:
                    raise InvalidArgument(f"{name} is {len(v)} bytes; at most {limit}")
        elif field.type == F.TYPE_MESSAGE:
            for v in values:
                check_message(v, f"{name}.")
