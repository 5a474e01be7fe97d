"""Plugins for the verifier tests, loaded as 'tests.rewards.verifier_plugins:NAME'."""

import math
import os
import time


def exact(response: str, answer: str) -> float:
    """1 when the response equals the answer; sleeps forever on 'hang', dies on 'crash'
    (at once) and on 'die_soon' (after 0.7 s); 'slow:X' is X after 0.5 s."""
    if response == "hang":
        time.sleep(10_000)
    if response == "crash":
        os._exit(3)
    if response == "die_soon":
        time.sleep(0.7)
        os._exit(3)
    if response.startswith("slow:"):
        time.sleep(0.5)
        response = response[len("slow:"):]
    if response == "raise":
        raise RuntimeError("plugin failure")
    return 1.0 if response == answer else 0.0


def bad_value(response: str, answer: str) -> object:
    return {"two": 2.0, "nan": math.nan, "text": "1", "neg": -0.5, "true": True}[response]


def one_argument(response: str) -> float:
    return 1.0


NOT_CALLABLE = 42
