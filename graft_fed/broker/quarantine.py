"""Which sources are quarantined, from the durable compatibility counts (so the verdict
survives a restart). See Context.quarantined (broker/context.py) for the rule."""

from __future__ import annotations

from typing import Callable, Iterable

from graft_fed.broker.state import CompatRow


def quarantined_sources(compat: Iterable[CompatRow], rate: float, min_reports: int, min_receivers: int,
                        trusted: Callable[[str], bool] = lambda _: False) -> set[str]:
    """Sources with at least `min_reports` reported groups, at least `min_receivers`
    receivers that each rejected at least `rate` of the groups they reported on, and a mean
    of the receivers' rejection rates (each receiver weighing the same) of at least `rate`;
    a `trusted` source never is."""
    per_source: dict[str, list[tuple[int, int]]] = {}
    for c in compat:
        reported = c.groups + c.rejected
        if reported:
            per_source.setdefault(c.source, []).append((c.rejected, reported))
    out = set()
    for source, pairs in per_source.items():
        total = sum(n for _, n in pairs)
        rates = [r / n for r, n in pairs]
        accusers = sum(1 for x in rates if x >= rate)
        if total >= min_reports and accusers >= min_receivers and sum(rates) / len(rates) >= rate:
            if not trusted(source):
                out.add(source)
    return out
