"""Finding the final \\boxed{} answer of a response."""

from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _argument(text: str, start: int) -> str | None:
    """The argument of a box command whose name ends at `start`, or None if unclosed/absent."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # `\boxed 5`: TeX takes one token; accept a run up to whitespace or `$`.
        if i == start:
            return None
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2  # an escaped brace \{ or \} does not nest
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the LAST \\boxed{...} or \\fbox{...} in `text` (nested braces kept).

    None when there is none, or when the last one is never closed (a truncated
    response): its final answer was not written, and an earlier box is not it.
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    return _argument(text, matches[-1].end())


def normalise_ws(text: str) -> str:
    """Trivial whitespace normalisation used by the exact-match fast path."""
    return " ".join(text.split())
