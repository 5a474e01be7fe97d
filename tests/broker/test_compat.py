"""The compatibility counts in memory (broker/compat.py) hold exactly what the state holds,
through reports folded in any order, as nodes join past the matrices' capacity and after a
restart; what matching, single-receiver matching and quarantine read from them is what they
read from the state's rows before; the vectorised quarantine rule is the rule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from graft_fed.broker.compat import CompatTable
from graft_fed.broker.matching import select_sources_arrays
from graft_fed.broker.quarantine import quarantined_sources
from graft_fed.broker.state import CompatRow, ReportRow
from graft_fed.broker.state_memory import InMemoryState
from graft_fed.broker.state_sqlite import SqliteState


@pytest.fixture(params=["memory", "sqlite"])
def state(request, tmp_path):
    s = InMemoryState() if request.param == "memory" else SqliteState(tmp_path / "broker.db")
    yield s
    s.close()


def random_reports(rng: random.Random, names: list[str], round_: int, count: int) -> list[ReportRow]:
    """One receiver's report: up to `count` groups of other nodes, some rejected, some undelivered."""
    receiver = rng.choice(names)
    rows = {}
    for _ in range(count):
        source = rng.choice([x for x in names if x != receiver])
        pid = f"p{rng.randrange(40)}"
        kind = rng.random()
        rejected, undelivered = kind < 0.2, 0.2 <= kind < 0.35
        rows[(source, pid)] = ReportRow(round=round_, receiver=receiver, source=source, prompt_id=pid,
                                        mean_s=0.0 if rejected or undelivered else rng.uniform(0, 3),
                                        admitted_fraction=0.0 if undelivered else rng.random(), rejected=rejected,
                                        undelivered=undelivered)
    return list(rows.values())


def old_estimates(rows: list[CompatRow], nodes: list[str]) -> dict[tuple[int, int], float]:
    """What the matcher built from the state's rows before the table (its `_compat_index`)."""
    pos = {n: i for i, n in enumerate(nodes)}
    return {(pos[c.source], pos[c.receiver]): c.mean_s for c in rows
            if c.source in pos and c.receiver in pos and c.groups > 0}


def old_quarantine(rows, rate, min_reports, min_receivers) -> set[str]:
    """The rule as it read the state's rows before (a loop over CompatRow), the groups reported
    undelivered left out of the rate."""
    per: dict[str, list[tuple[int, int]]] = {}
    for c in rows:
        received = c.groups - c.undelivered + c.rejected
        if received:
            per.setdefault(c.source, []).append((c.rejected, received))
    out = set()
    for source, pairs in per.items():
        rates = [r / n for r, n in pairs]
        if (sum(n for _, n in pairs) >= min_reports and sum(x >= rate for x in rates) >= min_receivers
                and math.fsum(rates) / len(rates) >= rate):
            out.add(source)
    return out


def test_the_table_holds_what_the_state_holds(state):
    rng = random.Random(3)
    everyone = [f"node-{i:03d}" for i in range(40)]  # past the first capacities (16, 32)
    table = CompatTable(state.compat)
    assert table.rows() == [] and table.rejected_total() == 0  # loaded (empty) before the first report
    for round_ in range(60):
        names = everyone[: 4 + round_ // 2]
        rows = random_reports(rng, names, round_ % 7, rng.randrange(1, 12))  # rounds repeat: some duplicates
        state.put_reports(rows)
        table.update(state.compat(pairs={(r.source, r.receiver) for r in rows}))
        if round_ % 10 == 9:
            rows_now = state.compat()
            assert table.rows() == rows_now
            assert table.rejected_total() == sum(c.rejected for c in rows_now)
            nodes = rng.sample(everyone, 30)  # some never reported on, in any order
            want = np.full((30, 30), math.inf)
            for (i, j), v in old_estimates(rows_now, nodes).items():
                want[i, j] = -math.inf if math.isnan(v) else v
            assert np.array_equal(table.estimates(nodes), want)
            receiver = rng.choice(names)
            assert table.of_receiver(receiver) == {c.source: c.mean_s for c in rows_now
                                                   if c.receiver == receiver and c.groups > 0}
            some = set(rng.sample(everyone, 20))
            assert table.rows(among=some) == [c for c in rows_now if c.source in some and c.receiver in some]
            for rate, min_reports, min_receivers in [(0.2, 3, 1), (0.15, 5, 2), (0.5, 1, 1)]:
                assert table.quarantined(rate, min_reports, min_receivers) == old_quarantine(
                    rows_now, rate, min_reports, min_receivers)
    # a restarted broker's table reads the rows once, on first use
    again = CompatTable(state.compat)
    assert again.rows() == state.compat() and again.rejected_total() == table.rejected_total()
    assert table.of_receiver("nobody") == {} and np.all(table.estimates(["x", "y"]) == math.inf)


def test_quarantine_is_recomputed_when_the_counts_change_and_trust_applies_on_every_call(state):
    table = CompatTable(state.compat)
    assert table.quarantined(0.5, 2, 2) == set()
    state.put_reports([ReportRow(0, receiver, "liar", f"p{i}", 0.0, 0.0, True)
                       for receiver in ("a", "b") for i in range(2)])
    assert table.quarantined(0.5, 2, 2) == set()  # not yet told: the copy is what it was given
    table.update(state.compat(pairs=[("liar", "a"), ("liar", "b")]))
    assert table.quarantined(0.5, 2, 2) == {"liar"}
    assert table.quarantined(0.5, 2, 3) == set()  # another setting, another verdict
    assert table.quarantined(0.5, 2, 2, trusted=lambda n: n == "liar") == set()
    assert table.quarantined(0.5, 2, 2) == {"liar"}


def test_the_vectorised_rule_weighs_each_receiver_the_same():
    names = ["s", "t"]
    # s: receiver 0 rejected 9 of 10, receivers 1 and 2 none of 1: mean rate 0.3 < 0.5
    reported = np.array([[10, 1, 1], [0, 0, 0]])
    rejected = np.array([[9, 0, 0], [0, 0, 0]])
    assert quarantined_sources(names + ["u"], reported, rejected, 0.5, 3, 1) == set()
    rejected[0] = [9, 1, 0]  # mean of (0.9, 1.0, 0.0) = 0.633 with two accusers
    assert quarantined_sources(names + ["u"], reported, rejected, 0.5, 3, 2) == {"s"}
    assert quarantined_sources(names + ["u"], reported, rejected, 0.5, 13, 2) == set()  # 12 reports
    assert quarantined_sources(names + ["u"], reported, rejected, 0.5, 3, 2, trusted=lambda n: n == "s") == set()
    # the mean at the boundary, exactly: rates 1/3 (three times) and 0 of four receivers... is 0.25
    reported = np.array([[3, 3, 3, 1]])
    rejected = np.array([[1, 1, 1, 0]])
    assert quarantined_sources(["s", "a", "b", "c"], reported, rejected, 0.25, 1, 3) == {"s"}


def test_matching_on_the_estimate_matrix_chooses_what_it_chose_on_the_pairs():
    rng = np.random.default_rng(5)
    n_nodes, n_prompts, n = 12, 50, 8
    k = rng.integers(0, n + 1, size=(n_nodes, n_prompts))
    k[rng.random(k.shape) < 0.1] = -1  # MISSING: no group
    pairs = {(int(a), int(b)): float(rng.uniform(0, 2)) for a, b in rng.integers(0, n_nodes, size=(40, 2)) if a != b}
    pairs[(0, 1)] = math.nan
    est = np.full((n_nodes, n_nodes), math.inf)
    for (a, b), v in pairs.items():
        est[a, b] = -math.inf if math.isnan(v) else v
    for balance in (True, False):
        for cap in (None, 3):
            got = select_sources_arrays(k, n, balance, est, None, cap)
            want = select_sources_arrays(k, n, balance, pairs, None, cap)
            assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, want))
    uniform = np.full((n_nodes, n_nodes), math.inf)
    got = select_sources_arrays(k, n, True, uniform)
    want = select_sources_arrays(k, n, True, {})
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="shape"):
        select_sources_arrays(k, n, True, np.zeros((3, 3)))


def old_pair_rows(exchange: dict, compat: dict, max_pairs):
    """What the status built before `pair_rows`: a dict per pair, then the largest."""
    import heapq

    keys = set(exchange) | set(compat)
    total = len(keys)
    if max_pairs is not None and total > max_pairs:
        keys = set(heapq.nlargest(max_pairs, sorted(keys), key=lambda k: exchange.get(k, 0)))
    rows = []
    for key in sorted(keys):
        c = compat.get(key)
        rows.append({"source": key[0], "receiver": key[1], "groups": exchange.get(key, 0),
                     "mean_s": c.mean_s if c else math.nan, "admitted_fraction": c.admitted_fraction if c else math.nan,
                     "rejected": c.rejected if c else 0, "reported": c.groups + c.rejected if c else 0,
                     "undelivered": c.undelivered if c else 0})
    return rows, total


def test_the_status_pairs_on_arrays_are_the_pairs_it_listed_before(state):
    from graft_fed.broker.compat import pair_rows
    from graft_fed.broker.exchange import Exchange

    rng = random.Random(9)
    everyone = [f"n{i:02d}" for i in range(30)]
    ex, table = Exchange(), CompatTable(state.compat)
    assert pair_rows(ex.view(), table.view(), 5) == ([], 0)  # nothing yet
    for round_ in range(25):
        nodes = rng.sample(everyone, 12)
        m = rng.randrange(0, 20)
        ex.add_positions(nodes, np.array([rng.randrange(12) for _ in range(m)]),
                         np.array([rng.randrange(12) for _ in range(m)]))
        names = rng.sample(everyone, 8)  # some reports of pairs that never exchanged (as after a prune)
        rows = random_reports(rng, names, round_, rng.randrange(1, 6))
        state.put_reports(rows)
        table.update(state.compat(pairs={(r.source, r.receiver) for r in rows}))
    exchange = ex.view().as_dict()
    compat = {(c.source, c.receiver): c for c in state.compat()}
    # the totals /metrics reads without copying the table: what the rows add up to
    assert table.totals() == (len(compat), sum(c.rejected for c in compat.values()),
                              sum(c.undelivered for c in compat.values()))
    assert CompatTable(state.compat).totals() == table.totals()  # counted whole at load as well
    assert set(compat) - set(exchange) and set(exchange) - set(compat)
    for max_pairs in (None, 0, 1, 7, 50, 10_000):
        got, total = pair_rows(ex.view(), table.view(), max_pairs)
        want, want_total = old_pair_rows(exchange, compat, max_pairs)
        assert total == want_total
        assert [{k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()} for row in got] == \
            [{k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()} for row in want]


def test_a_failed_first_read_is_read_again(state):
    from graft_fed.federation.errors import Unavailable

    state.put_reports([ReportRow(0, "r", "s", "p0", 0.5, 1.0, False)])
    calls = []

    def read_all():
        calls.append(1)
        if len(calls) == 1:
            raise Unavailable("the disk went away (a test)")
        return state.compat()
    table = CompatTable(read_all)
    with pytest.raises(Unavailable):
        table.rows()
    assert table.rows() == state.compat() and table.rejected_total() == 0 and len(calls) == 2
