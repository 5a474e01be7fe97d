"""What the broker keeps of a node's secret (node/secret.py): its SHA-256, as 64 hexadecimal
digits. One definition for the broker's Join (broker/sessions.py), the operator's
`graft-fed broker forget-secret --hold-for` and the node's `graft-fed node
--print-secret-hash`: the hash holds the id, and knowing it does not let anyone join under
it (that takes the secret itself), so a node's operator may send it to the broker's."""

from __future__ import annotations

import hashlib
import string

_HEX = frozenset(string.hexdigits.lower())


def secret_hash(node_secret: str) -> str:
    """The hash the broker keeps of `node_secret` ("" for none: the Join holds nothing)."""
    return hashlib.sha256(node_secret.encode("utf-8", "surrogatepass")).hexdigest() if node_secret else ""


def parse_secret_hash(text: str) -> str:
    """`text` as a secret's hash (64 hexadecimal digits, either case; surrounding blanks
    dropped), lower case; ValueError saying what is wrong and where to get one."""
    value = text.strip().lower() if isinstance(text, str) else ""
    if len(value) != 64 or not _HEX.issuperset(value):
        shown = text[:80] if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{shown!r} is not a node secret's hash (64 hexadecimal digits): the node's operator prints "
                         "it with `graft-fed node --config <its config> --print-secret-hash`")
    return value
