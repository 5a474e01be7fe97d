"""The broker's array matching chooses exactly what core.exchange.select_sources chooses."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from graft_fed.broker.matching import select_sources_fast
from graft_fed.core.exchange import select_sources


def _round(rng: random.Random, n_nodes: int, n_prompts: int, n: int, partial: bool) -> list[dict[str, tuple[int, int]]]:
    kn = []
    for _ in range(n_nodes):
        per = {}
        for p in range(n_prompts):
            if partial and rng.random() < 0.2:
                continue  # a node that did not publish every prompt
            u = rng.random()
            # few distinct k so that ties (SelectWithTies, source_rank) are everywhere
            k = 0 if u < 0.35 else (n if u < 0.5 else rng.choice([1, n - 1, n // 2]))
            per[f"p{p:03d}"] = (k, n)
        kn.append(per)
    return kn


def _compat(rng: random.Random, n_nodes: int) -> dict[tuple[int, int], float]:
    out = {}
    for s in range(n_nodes):
        for r in range(n_nodes):
            if s != r and rng.random() < 0.5:
                out[(s, r)] = rng.choice([0.5, 0.9, 1.0, float("inf")])  # repeated values: ties on compat
    return out


@pytest.mark.parametrize("seed", range(40))
def test_fast_path_equals_select_sources(seed: int) -> None:
    rng = random.Random(seed)
    n_nodes = rng.choice([1, 2, 2, 3, 4, 7, 12])
    kn = _round(rng, n_nodes, rng.choice([1, 5, 40, 120]), rng.choice([2, 4, 8]), partial=seed % 3 == 0)
    compat = _compat(rng, n_nodes) if seed % 2 else {}
    can = [rng.random() > 0.2 for _ in range(n_nodes)] if seed % 4 == 1 else None
    for balance in (True, False):
        for cap in (None, 0, 1, 3, 50):
            want = select_sources(kn, balance, compat, can, cap=cap)
            got = select_sources_fast(kn, balance, compat, can, cap=cap)
            assert got == want, (seed, balance, cap)


def test_every_way_to_a_winner_chooses_the_same(monkeypatch) -> None:
    """Receivers whose best-ranked sources are distinct try them in rank order
    (_walk_ranked, TOP_SOURCES of them); the others try their best rank's sources in each
    prompt's order of k_S (_walk_prompts, PROMPT_TRIES of them) where many sources share
    it, or are scored over a few best-ranked sources where few do (_best_of_few); what none
    of them settles is scored over every source (_score_all, SCORES_PER_BLOCK scores at a
    time). The choices are still select_sources', whatever the number tried and the block,
    and with the thresholds' masks multiplied one by one (MASK_BYTES) and scores in int64
    (INT32_SCORES_BELOW). Estimates drawn
    from many values (few ties) and from few (many), with every pair explored, most, few or
    none (+inf: the best rank shared); every way is taken."""
    from graft_fed.broker import matching

    ways = {"ranked": 0, "prompts": 0, "few": 0, "scored": 0}

    def counted(name, real):
        def call(pending, *args):
            ways[name] += pending.size
            return real(pending, *args)
        return call
    for name, fn in (("ranked", "_walk_ranked"), ("prompts", "_walk_prompts"), ("few", "_best_of_few"),
                     ("scored", "_score_all")):
        monkeypatch.setattr(matching, fn, counted(name, getattr(matching, fn)))
    for seed in range(16):
        rng = random.Random(300 + seed)
        n_nodes = rng.choice([5, 9, 16, 21])
        kn = _round(rng, n_nodes, rng.choice([30, 90]), rng.choice([4, 8]), partial=seed % 3 == 0)
        values = [rng.random() for _ in range(40)] if seed % 2 else [0.5, 0.9, 1.0]
        known = (1.0, 0.9, 0.1, 0.0)[seed % 4]  # every pair explored, most, few or none (+inf)
        compat = {(s, r): rng.choice(values) for s in range(n_nodes) for r in range(n_nodes)
                  if s != r and rng.random() < known}
        can = [rng.random() > 0.2 for _ in range(n_nodes)] if seed % 5 == 1 else None
        for top, tries, block, masks in ((1, 1, 3 * n_nodes, 1), (2, 2, 1 << 20, 32 << 20), (3, 5, 7 * n_nodes, 1),
                                         (8, 64, 1, 32 << 20)):
            monkeypatch.setattr(matching, "MASK_BYTES", masks)  # 1: one k_S >= j mask at a time
            monkeypatch.setattr(matching, "INT32_SCORES_BELOW", 0 if masks == 1 else 2**31)  # 0: int64 scores
            monkeypatch.setattr(matching, "TOP_SOURCES", top)
            monkeypatch.setattr(matching, "PROMPT_TRIES", tries)
            monkeypatch.setattr(matching, "SCORES_PER_BLOCK", block)
            for balance in (True, False):
                for cap in (None, 2):
                    want = select_sources(kn, balance, compat, can, cap=cap)
                    got = select_sources_fast(kn, balance, compat, can, cap=cap)
                    assert got == want, (seed, top, tries, block, masks, balance, cap)
    assert all(ways.values()), ways


@pytest.mark.parametrize("seed", range(3))
def test_a_larger_federation_chooses_the_same(seed: int) -> None:
    """60 nodes with few, half or most pairs explored, as in a federation's first rounds
    and later ones: the choices are select_sources'."""
    rng = random.Random(900 + seed)
    n_nodes = 60
    kn = _round(rng, n_nodes, 40, 8, partial=False)
    known = (0.1, 0.5, 0.95)[seed]
    compat = {(s, r): rng.random() for s in range(n_nodes) for r in range(n_nodes) if s != r and rng.random() < known}
    for balance in (True, False):
        assert select_sources_fast(kn, balance, compat) == select_sources(kn, balance, compat), (seed, balance)


def test_dense_ranks_are_np_uniques() -> None:
    """Per receiver, np.unique's ranks of its estimates with NaN read as -inf and its own
    pair (the diagonal) lowest."""
    from graft_fed.broker.matching import _dense_ranks

    rng = np.random.default_rng(5)
    assert _dense_ranks(np.zeros((0, 0))).shape == (0, 0)
    for n_nodes in (1, 2, 7, 30):
        est = rng.choice([0.5, 1.0, 2.0, math.inf, -math.inf, math.nan], size=(n_nodes, n_nodes))
        if n_nodes > 2:
            est[:, 0] = rng.random(n_nodes)
        want_est = np.where(np.isnan(est), -math.inf, est)
        np.fill_diagonal(want_est, -math.inf)
        want = np.stack([np.searchsorted(np.unique(want_est[:, r]), want_est[:, r]) for r in range(n_nodes)], axis=1)
        assert (_dense_ranks(est) == want).all()


def test_nan_estimates_never_win() -> None:
    """A NaN estimate passed in the matrix ranks as -inf, as the mapping form's NaN does."""
    from graft_fed.broker.matching import select_sources_arrays

    est = np.full((3, 3), math.inf)
    est[0, 2] = est[1, 2] = math.nan
    k = np.array([[1], [1], [0]])
    mapped = np.where(np.isnan(est), -math.inf, est)
    assert [c.tolist() for c in select_sources_arrays(k, 4, False, est)[2]] == \
        [c.tolist() for c in select_sources_arrays(k, 4, False, mapped)[2]] == [[0], [0]]


def test_empty_and_unshared() -> None:
    from graft_fed.broker.matching import select_sources_arrays

    assert select_sources_fast([], True, {}) == select_sources([], True, {}) == []
    assert select_sources_arrays(np.zeros((0, 3), dtype=np.int16), 4, True, {}) == []  # no nodes
    assert [c.size for c, _ in select_sources_arrays(np.zeros((2, 0), dtype=np.int16), 4, True, {})] == [0, 0]
    kn = [{"a": (0, 4)}, {"a": (2, 4)}]
    assert select_sources_fast(kn, True, {}, [True, False]) == select_sources(kn, True, {}, [True, False])
    assert select_sources_fast(kn, False, {}) == select_sources(kn, False, {}) == [{"a": 1}, {}]


def test_a_digest_written_across_a_clear_is_read_back_from_the_state() -> None:
    """RoundIndex.set_digest(since=...): an upload whose attachment spans a clear (retention)
    does not write its digest into the books: the round's book is read again from the state,
    which holds the digest when it survived (even if a book was rebuilt between the clear and
    the write) and not when retention dropped it; a write with no clear since, or without
    `since`, goes into the book."""
    from graft_fed.broker.roundindex import RoundIndex
    from graft_fed.broker.state import SummaryHead

    state = {"p0": ""}  # what the state holds attached to node a's summaries of any round
    index = RoundIndex(4, lambda r: [SummaryHead("a", r, p, 4, 2, d) for p, d in state.items()], keep=4)
    before = index.generation
    index.book(3)
    index.clear()  # retention ran
    assert index.book(3).digests == {}  # rebuilt before the upload's attachment committed
    state["p0"] = "d" * 64  # the attachment commits: the digest survived
    version = index.book(3).digest_version
    index.set_digest(3, "a", "p0", "d" * 64, since=before)
    assert index.book(3).digests == {"a": {"p0": "d" * 64}}  # read back from the state
    assert index.book(3).digest_version > version  # answers cached on the book read before are stale
    before = index.generation
    index.clear()
    state["p0"] = ""  # this time retention dropped the bundle after the attachment
    index.set_digest(4, "a", "p0", "e" * 64, since=before)
    assert index.book(4).digests == {}  # not given back
    index.set_digest(4, "a", "p0", "f" * 64, since=index.generation)
    assert index.book(4).digests == {"a": {"p0": "f" * 64}}
    index.set_digest(4, "a", "p0", "0" * 64)
    assert index.book(4).digests == {"a": {"p0": "0" * 64}}


def test_an_opened_round_starts_empty_and_keeps_a_book_it_has() -> None:
    """RoundIndex.open: a round whose row was just written holds nothing (no read of the
    state); a round with a book keeps it."""
    import numpy as np

    from graft_fed.broker.roundindex import RoundIndex
    from graft_fed.broker.state import SummaryHead

    loads: list[int] = []

    def load(r: int):
        loads.append(r)
        return [SummaryHead("a", r, "p0", 4, 2, "")]

    index = RoundIndex(4, load, keep=2)
    index.open(5)
    assert index.published(5) == set() and loads == []
    index.add_columns(5, "b", ["p0", "p1"], np.array([1, 0]))
    assert index.published(5) == {"b"}
    index.open(5)  # already there: kept
    assert index.published(5) == {"b"} and loads == []
    assert index.published(6) == {"a"} and loads == [6]  # not opened: read from the state
    index.open(7)
    index.open(8)  # keep=2: round 5 evicted, read back when asked for
    assert index.published(5) == {"a"} and loads == [6, 5]


@pytest.mark.parametrize("seed", range(12))
def test_a_rounds_complementarity_for_every_receiver_at_once_is_core_exchanges(seed: int) -> None:
    """RoundIndex.complementarity within one round (synchronous mode) counts every receiver
    at once on the round's k matrix, cached until the next publish; after each publish of a
    round built node by node, each receiver's counts are core.exchange.complementarity's
    over the other nodes' groups (nodes that left some prompts out, k of every class, and a
    receiver that has not published: (0, 0))."""
    import numpy as np

    from graft_fed.broker.roundindex import RoundIndex
    from graft_fed.core.exchange import complementarity

    rng = random.Random(seed)
    n = rng.choice([2, 4, 8])
    kn = _round(rng, rng.randint(2, 6), rng.randint(1, 30), n, partial=True)
    index = RoundIndex(n, lambda r: [], keep=4)
    index.open(3)
    names = [f"node{i}" for i in range(len(kn))]
    for i, per in enumerate(kn):
        pids = list(per)
        rng.shuffle(pids)
        index.add_columns(3, names[i], pids, np.array([per[p][0] for p in pids]))
        for r, receiver in enumerate(names):
            peers = [(p, k, kn_n) for j in range(i + 1) if j != r for p, (k, kn_n) in kn[j].items()]
            expected = complementarity(kn[r], peers) if r <= i else (0, 0)
            assert index.complementarity(receiver, 3, 3) == expected, (i, receiver)


@pytest.mark.parametrize("seed", range(6))
def test_match_set_rows_are_in_receiver_then_prompt_id_order(seed: int, monkeypatch) -> None:
    """MatchSet.from_choice lays out any choice (columns in any order, receivers with none)
    as rows sorted by (receiver, prompt id), each with its source's k; prompt lists of the
    same length but another order do not reuse the previous list's order. And the columns
    each source is asked to upload for a set of receivers (columns_by_source)."""
    import numpy as np

    from graft_fed.broker import matchset
    from graft_fed.broker.matchset import MatchSet

    rng = random.Random(seed)
    n_nodes, n_prompts = rng.choice([1, 3, 9]), rng.choice([1, 7, 60])
    k = np.array([[rng.randrange(-1, 9) for _ in range(n_prompts)] for _ in range(n_nodes)], dtype=np.int16)
    for pids, ascending in (([f"q{rng.randrange(10**6):06d}-{i}" for i in range(n_prompts)], False),
                            ([f"p{n_prompts - i:03d}" for i in range(n_prompts)], False),
                            ([f"p{i:03d}" for i in range(n_prompts)], False),  # in id order, columns shuffled
                            ([f"p{i:03d}" for i in range(n_prompts)], True)):  # as the matcher passes them
        chosen = []
        for _ in range(n_nodes):
            cols = rng.sample(range(n_prompts), rng.randrange(n_prompts + 1))
            cols = np.array(sorted(cols) if ascending else cols, dtype=np.int64)
            chosen.append((cols, np.array([rng.randrange(n_nodes) for _ in cols], dtype=np.int64)))
        want = sorted((r, pids[c], s, int(k[s, c])) for r, (cols, srcs) in enumerate(chosen)
                      for c, s in zip(cols.tolist(), srcs.tolist()))
        ms = MatchSet.from_choice(4, [f"n{i}" for i in range(n_nodes)], pids, k, chosen)
        got = [(r, pids[c], s, kk) for r, c, s, kk in zip(ms.receiver.tolist(), ms.col.tolist(), ms.source.tolist(),
                                                           ms.k.tolist())]
        assert got == want
        assert MatchSet.from_bytes(ms.to_bytes()).rows() == ms.rows()
        for name in [f"n{i}" for i in range(n_nodes)] + ["stranger"]:  # a receiver's pairs, as rows has them
            assert ms.offered(name) == {(m.source, m.prompt_id) for m in ms.rows(receiver=name)}
        # each source's distinct columns among the matches of the receivers in a mask
        mask = np.array([rng.random() < 0.6 for _ in range(n_nodes)])
        for cells in (matchset.COLUMN_GRID_CELLS, 0):  # marked on a grid, and sorted
            monkeypatch.setattr(matchset, "COLUMN_GRID_CELLS", cells)
            starts, cols = ms.columns_by_source(mask)
            for j in range(n_nodes):
                want_cols = sorted({c for r, c, s in zip(ms.receiver.tolist(), ms.col.tolist(), ms.source.tolist())
                                    if s == j and mask[r]})
                assert cols[starts[j]:starts[j + 1]].tolist() == want_cols


def test_a_choice_that_gives_a_receiver_one_prompt_twice_is_refused() -> None:
    """from_choice keeps each (receiver, prompt) once or says the choice was wrong (the matcher
    never makes one: each receiver's columns are its failed prompts, once each)."""
    import numpy as np

    from graft_fed.broker.matchset import MatchSet

    k = np.zeros((2, 3), dtype=np.int16)
    for pids in (["p0", "p1", "p2"], ["p2", "p1", "p0"]):
        with pytest.raises(ValueError, match="chosen twice"):
            MatchSet.from_choice(0, ["a", "b"], pids, k, [(np.array([1, 0, 1]), np.array([1, 1, 1])),
                                                           (np.array([], dtype=np.int64),) * 2])


def gfm1_bytes(ms) -> bytes:
    """A match set in the encoding stored before the narrow widths (b"GFM1": all int32)."""
    import json

    head = json.dumps({"round": ms.round, "nodes": ms.nodes, "pids": ms.pids, "count": len(ms)}).encode()
    return b"".join([b"GFM1", len(head).to_bytes(4, "little"), head] +
                    [a.astype("<i4").tobytes() for a in (ms.receiver, ms.col, ms.source, ms.k)])


def _some_match_set(n_nodes: int = 300, n_prompts: int = 40000):
    import numpy as np

    from graft_fed.broker.matchset import MatchSet

    rng = np.random.default_rng(3)
    k = rng.integers(-1, 9, size=(n_nodes, n_prompts)).astype(np.int16)
    chosen = [(np.array([0, n_prompts - 1, 1 + r % (n_prompts - 2)]), np.array([n_nodes - 1, 0, (r + 1) % n_nodes]))
              for r in range(n_nodes)]
    return MatchSet.from_choice(9, [f"n{i}" for i in range(n_nodes)], [f"p{i}" for i in range(n_prompts)], k, chosen)


def test_match_sets_are_stored_narrow_and_old_ones_still_decode() -> None:
    """GFM2 keeps each array in the narrowest width that holds it (here 2 bytes for the
    nodes and 300 nodes' receivers, 4 for 40,000 columns, 1 for k) and reads back exactly;
    a set stored before (GFM1, all int32) decodes to the same."""
    from graft_fed.broker.matchset import MatchSet

    ms = _some_match_set()
    data = ms.to_bytes()
    old = gfm1_bytes(ms)
    body = len(data) - 8 - int.from_bytes(data[4:8], "little")
    assert data[:4] == b"GFM2" and body == len(ms) * (2 + 4 + 2 + 1)
    assert len(old) - 8 - int.from_bytes(old[4:8], "little") == len(ms) * 16
    for blob in (data, gfm1_bytes(ms)):
        back = MatchSet.from_bytes(blob)
        assert back.rows() == ms.rows() and back.k.tolist() == ms.k.tolist()


@pytest.mark.parametrize("mangle, why", [
    (lambda h, b: ({**h, "w": [4, 4, 4]}, b), "widths"),
    (lambda h, b: ({**h, "w": [3, 4, 4, 4]}, b), "widths"),
    (lambda h, b: ({**h, "w": "1111"}, b), "widths"),
    (lambda h, b: ({**h, "count": -1}, b), "count -1"),
    (lambda h, b: ({**h, "count": h["count"] + 1}, b), "bytes of arrays"),
    (lambda h, b: ({**h, "count": float("inf")}, b), "count inf"),
    (lambda h, b: ({**h, "count": str(h["count"])}, b), "must be integers"),
    (lambda h, b: ({**h, "round": 9.5}, b), "round 9.5"),
    (lambda h, b: ([h], b), "not an object"),
    (lambda h, b: ({**h, "nodes": "n0"}, b), "node ids are not a list"),
    (lambda h, b: ({**h, "nodes": [0, 1, 2, 3]}, b), "node ids are not a list of strings"),
    (lambda h, b: ({**h, "nodes": ["n0", "n0", "n2", "n3"]}, b), "node ids repeat"),
    (lambda h, b: ({**h, "pids": ["p0"] * len(h["pids"])}, b), "prompt ids repeat"),
    (lambda h, b: ({**h, "nodes": h["nodes"][:2]}, b), "does not hold"),
    (lambda h, b: ({**h, "w": [8, 8, 8, 8]}, "col"), "does not hold"),
    (lambda h, b: ({**h, "w": [8, 8, 8, 8]}, "k"), "a k outside int32"),
    (lambda h, b: (h, "reversed"), r"not in \(receiver, prompt id\) order"),
    (lambda h, b: (h, "twice"), r"not in \(receiver, prompt id\) order"),
    (lambda h, b: ({k: v for k, v in h.items() if k != "w"}, b), "'w'"),
])
def test_a_damaged_match_set_is_a_match_set_error(mangle, why) -> None:
    """Every way a stored set can be damaged is a MatchSetError that says what (never values
    read from the wrong bytes, nor another exception): widths, counts, types, lists, ids
    that repeat, references to nodes or prompts outside the set (an 8-byte column past
    int32), a k past int32, rows out of (receiver, prompt id) order or twice."""
    import json

    import numpy as np

    from graft_fed.broker.matchset import MatchSet, MatchSetError

    ms = _some_match_set(4, 6)
    data = ms.to_bytes()
    size = int.from_bytes(data[4:8], "little")
    head, body = json.loads(data[8:8 + size]), data[8 + size:]
    head, body = mangle(head, body)
    arrays = [a.astype(np.int64) for a in (ms.receiver, ms.col, ms.source, ms.k)]
    if body in ("col", "k"):  # 8-byte columns, the first column number (or k) past int32
        arrays[1 if body == "col" else 3][0] += 2**32
        body = b"".join(a.astype("<i8").tobytes() for a in arrays)
    elif body in ("reversed", "twice"):  # rows out of order, or one row twice
        order = np.arange(len(ms))[::-1] if body == "reversed" else np.r_[0, 0, np.arange(2, len(ms))]
        body = b"".join(a[order].astype(f"<i{w}").tobytes() for a, w in zip(arrays, head["w"]))
    raw = json.dumps(head).encode()
    with pytest.raises(MatchSetError, match=why):
        MatchSet.from_bytes(b"GFM2" + len(raw).to_bytes(4, "little") + raw + body)


def test_a_rounds_arrays_live_in_buffers_kept_between_rounds():
    """A round's (N, P) and (N, N) arrays, the thresholds' masks and products among them,
    are made in buffers kept from one call to the next (made afresh each round they grew
    the broker's heap, broker/matching.py::_Scratch): a second round of the same size, or a
    smaller one, allocates none; a larger one grows them."""
    from graft_fed.broker import matching

    rng = np.random.default_rng(3)
    matching._scratch_free.clear()

    def run(nodes: int, prompts: int) -> dict[str, int]:
        k = rng.integers(0, 5, size=(nodes, prompts)).astype(np.int16)
        matching.select_sources_arrays(k, 4, True, np.full((nodes, nodes), np.inf))
        (kept,) = matching._scratch_free  # one set: one call at a time
        return {name: buf.ctypes.data for name, buf in kept.buffers.items()}

    first = run(16, 64)
    assert {"ge", "masks", "products", "kept", "t", "kkT"} <= set(first)
    assert run(16, 64) == first and run(8, 32) == first
    assert run(32, 128) != first
