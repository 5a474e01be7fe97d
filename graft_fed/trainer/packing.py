"""How a minibatch's responses are cut into micro-batches and shared among processes.

Both are memory / speed decisions only: the loss of a minibatch is a sum over its tokens
divided by one normaliser computed for the whole minibatch (core/losses.py), so any split
gives the same gradient up to float summation order.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def token_budget_batches(prompt_lens: Sequence[int], resp_lens: Sequence[int], rows: Iterable[int],
                         budget: int, max_rows: int) -> list[list[int]]:
    """Pack `rows` into micro-batches of at most `budget` padded tokens and `max_rows` rows.

    A micro-batch is padded to its longest prompt plus its longest response
    (graft_fed.modeling.pack), so its cost is rows x (max prompt + max response). Rows go
    longest first (ties by index) into the current micro-batch until the next one would
    pass the budget or the row cap; a row longer than the budget alone gets a micro-batch of
    its own. Each micro-batch lists its rows in increasing order. Deterministic.
    """
    if budget < 1 or max_rows < 1:
        raise ValueError(f"budget ({budget}) and max_rows ({max_rows}) must be >= 1")
    order = sorted(rows, key=lambda i: (-(prompt_lens[i] + max(1, resp_lens[i])), i))
    out: list[list[int]] = []
    cur: list[int] = []
    width_p = width_r = 0
    for i in order:
        p, r = max(width_p, prompt_lens[i]), max(width_r, max(1, resp_lens[i]))
        if cur and ((len(cur) + 1) * (p + r) > budget or len(cur) == max_rows):
            out.append(sorted(cur))
            cur, p, r = [], prompt_lens[i], max(1, resp_lens[i])
        cur.append(i)
        width_p, width_r = p, r
    if cur:
        out.append(sorted(cur))
    return out


def balance_shards(costs: Sequence[float], shards: int) -> list[list[int]]:
    """Split rows 0..len(costs)-1 among `shards` processes, largest cost first to the least
    loaded (ties to the lowest shard): every process computes the same split."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    load = [0.0] * shards
    out: list[list[int]] = [[] for _ in range(shards)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        s = min(range(shards), key=lambda k: (load[k], k))
        out[s].append(i)
        load[s] += costs[i]
    return [sorted(rows) for rows in out]
