"""The math-verify item function, run inside pool workers (never in the trainer's process).

Gold and prediction are both given as one ``\\boxed{...}`` and parsed with math-verify's
LaTeX extraction at boxed priority 0 (the boxed-extraction setup), then compared with
``verify(gold, pred)`` -- gold FIRST: math-verify is not symmetric. math-verify's own
signal.alarm timeouts are switched off; the pool's parent enforces the wall clock.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from graft_fed.rewards.boxed import last_boxed

_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class _DropTimeoutDisabledWarning(logging.Filter):
    """We disable math-verify's timeouts on purpose; its warning about that is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def boxed(text: str) -> str:
    return "\\boxed{" + text + "}"


def parse_boxed(text: str) -> list[Any]:
    """math-verify's parse of `\\boxed{text}`: sympy object(s), then the string fallback."""
    return parse(boxed(text), extraction_config=_EXTRACTION, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    parsed = parse_boxed(answer)
    if not parsed:
        raise ValueError("math-verify could not extract anything from the gold answer")
    return parsed


def score(response: str, answer: str) -> float:
    """1.0 if the last boxed answer of `response` is equivalent to gold `answer`, else 0.0."""
    gold = _parse_gold(answer)
    content = last_boxed(response)
    if content is None:
        return 0.0
    pred = parse_boxed(content)
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
