"""Which sources are quarantined, from the durable compatibility counts (so the verdict
survives a restart; broker/compat.py holds them in memory). See Context.quarantined
(broker/context.py) for the rule."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np


def quarantined_sources(names: Sequence[str], reported: np.ndarray, rejected: np.ndarray, rate: float,
                        min_reports: int, min_receivers: int,
                        trusted: Callable[[str], bool] = lambda _: False) -> set[str]:
    """Sources with at least `min_reports` reported groups, at least `min_receivers`
    receivers that each rejected at least `rate` of the groups they reported on, and a mean
    of the receivers' rejection rates (each receiver weighing the same) of at least `rate`;
    a `trusted` source never is. `reported[s, r]`: the groups of names[s] that names[r]
    reported on, rejected or not; `rejected[s, r]`: of those, the ones it rejected."""
    reported = np.asarray(reported, dtype=np.int64)
    has = reported > 0
    receivers = has.sum(axis=1)
    rates = np.divide(rejected, reported, out=np.zeros(reported.shape), where=has)
    accusers = ((rates >= rate) & has).sum(axis=1)
    candidates = np.flatnonzero((receivers > 0) & (reported.sum(axis=1) >= min_reports) & (accusers >= min_receivers))
    out = set()
    for s in candidates.tolist():
        # the mean of the receivers' rates, exactly rounded (math.fsum): the verdict at the
        # boundary does not depend on the order the receivers were seen in
        if math.fsum(rates[s, has[s]].tolist()) / int(receivers[s]) >= rate and not trusted(names[s]):
            out.add(names[s])
    return out
