"""Reward plugins used by tests (loaded by the verifier as 'tests.plugins:NAME')."""


def odd_char_sum(response: str, answer: str) -> float:
    """A reward a randomly initialised model earns about half the time, deterministically
    from its text, so tests get mixed groups without a trained model."""
    return float(sum(map(ord, response)) % 2)
