"""A verifier plugin whose import never finishes in time: a worker that cannot start."""

import time

time.sleep(600)


def f(response: str, answer: str) -> float:
    return 1.0
