"""core.exchange.select_sources on arrays: the same choices, without Python loops over
pairs and prompts.

`select_sources` walks every ordered pair of nodes and, for each, every prompt: N^2 x P
steps of Python, which at 64 nodes x 4,096 prompts took the broker a minute per round
(issue 13). The rule only needs, per ordered pair (a, b), how many of b's all-fail prompts
a has an informative group for at each k (SelectWithTies keeps every candidate whose k_S
reaches the m-th largest, so a histogram of k per pair fixes the threshold), and then, per
receiver and prompt, the `source_rank` winner among the sources that passed their pair's
threshold. Both are array operations: (N x P) @ (P x N) products of the masks k_S >= j
(_thresholds), then, for every receiver at once, walks that try each (receiver, prompt)
pair's likeliest winners first, and an arg-max over every source for the few pairs they do
not settle (_ranked_choices).

`select_sources_arrays` returns exactly what `select_sources` returns for the same input
(tests/broker/test_matching.py compares them on random rounds with ties, N > 2, balance on
and off, sources that may not share, compatibility known and unknown, and a cap), where no
estimate is NaN: here a NaN estimate never wins, while `select_sources`' max() keeps a NaN
candidate it meets first. The broker maps NaN to -inf before either.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Hashable, Iterator, Mapping, Sequence

import numpy as np

MISSING = -1  # k of a prompt the node did not publish


def kn_arrays(kn: Sequence[Mapping[Hashable, tuple[int, int]]]) -> tuple[list[Hashable], np.ndarray, np.ndarray]:
    """(prompt ids, k, n) from select_sources' input: k and n are (N, P) int arrays, k
    MISSING where a node has no group for the prompt."""
    pids: dict[Hashable, int] = {}
    for per in kn:
        for pid in per:
            pids.setdefault(pid, len(pids))
    k = np.full((len(kn), len(pids)), MISSING, dtype=np.int64)
    n = np.ones((len(kn), len(pids)), dtype=np.int64)
    for i, per in enumerate(kn):
        if per:
            cols = np.fromiter((pids[p] for p in per), dtype=np.int64, count=len(per))
            vals = np.array(list(per.values()), dtype=np.int64).reshape(-1, 2)
            k[i, cols] = vals[:, 0]
            n[i, cols] = vals[:, 1]
    return list(pids), k, n


#: _thresholds' float32 masks (N x P) of k_S >= j made at once, at most (one at least): below
#: the broker's mmap threshold (broker/heap.py: 4 MiB with 1 MiB chunks), above which each is
#: mapped and faulted in afresh (7 masks at 64 x 4,096 at once took 1.3 ms there, against 0.2)
MASK_BYTES = 2 << 20
PRODUCT_BYTES = 32 << 20  # and their float32 products (N x N) at once, at most (one at least)


class _Scratch:
    """A round's (N, P) and (N, N) arrays (the masks, their float32 copies and products that
    _thresholds makes, the thresholds, the offers' k_S by prompt), in buffers kept from
    one round to the next. Made afresh each round, these arrays of 0.1-2 MiB were the
    allocations that grew the broker's heap after its warm-up: other threads' small
    allocations settle in the holes they leave, so the next round's no longer fit and
    glibc extends the heap (perf on brk: every extension under 256 nodes x 256 prompts
    after the first minutes was one of the matcher's arrays; RSS rose about 1 MiB/min;
    issue 13, docs/performance.md, "forty-fourth pass"). A set is taken for one call and
    given back; as many sets exist as calls ever ran at once (the broker's work slots: 2)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A C-contiguous array of `shape` over this set's `name` buffer, grown (never
        shrunk) to fit; its values are whatever the last call left."""
        size = math.prod(shape) * np.dtype(dtype).itemsize
        buf = self.buffers.get(name)
        if buf is None or buf.size < size:
            buf = self.buffers[name] = np.empty(size, dtype=np.uint8)
        return buf[:size].view(dtype).reshape(shape)


_scratch_free: list[_Scratch] = []
_scratch_lock = threading.Lock()


@contextlib.contextmanager
def _scratch() -> Iterator[_Scratch]:
    with _scratch_lock:
        taken = _scratch_free.pop() if _scratch_free else _Scratch()
    try:
        yield taken
    finally:
        with _scratch_lock:
            _scratch_free.append(taken)


def _thresholds(k: np.ndarray, n: np.ndarray, fail: np.ndarray, inf_src: np.ndarray, balance: bool,
                scratch: _Scratch) -> np.ndarray:
    """t[a, b]: the smallest k_S of a's groups that SelectWithTies keeps in direction a -> b
    (every candidate with k_S >= t is kept); kmax + 1 when the pair exchanges nothing. In
    `scratch`'s buffers, t included."""
    n_nodes = k.shape[0]
    if not inf_src.any():
        kmax = 1
    elif not any(n.strides):  # one group size for every node (broadcast): no reduction over (N, P)
        kmax = int(n.flat[0]) - 1
    else:
        kmax = int(n.max(where=inf_src, initial=0)) - 1
    # ranked_j[a, b]: a's informative groups with k_S >= j on prompts b failed entirely, for
    # j = 1 (the total) up: as few (J N x P) @ (P x N) products as MASK_BYTES of J masks
    # (N x P) and PRODUCT_BYTES of J products (N x N) allow. ranked_j falls as j rises and
    # ranked_1 = total >= m, so the largest j with ranked_j >= m is the count of those j
    # (where m > 0).
    k_inf = np.multiply(k, inf_src, out=scratch.array("k_inf", k.shape, k.dtype))
    # the j compared with k in k's dtype (the matcher's int16: 3x faster than int64) where
    # kmax fits in it
    j_dtype = k.dtype if kmax <= np.iinfo(k.dtype).max else np.int64
    failT = scratch.array("fail32", fail.shape, np.float32)  # (P, N) column-major: a copy without a transpose
    np.copyto(failT, fail)
    failT = failT.T
    per = max(1, min(MASK_BYTES // max(4 * k.size, 1), PRODUCT_BYTES // max(4 * n_nodes * n_nodes, 1)))
    t = scratch.array("t", (n_nodes, n_nodes), np.int32)
    t.fill(0)
    m = scratch.array("m", (n_nodes, n_nodes), np.float32)  # how many each direction keeps before ties
    assert kmax >= 1  # the first chunk sets m
    full = min(per, kmax)
    ge = scratch.array("ge", (full, n_nodes, k.shape[1]), np.bool_)
    masks = scratch.array("masks", (full * n_nodes, k.shape[1]), np.float32)
    products = scratch.array("products", (full * n_nodes, n_nodes), np.float32)
    kept = scratch.array("kept", (n_nodes, n_nodes), np.bool_)
    for lo in range(1, kmax + 1, per):
        js = np.arange(lo, min(lo + per, kmax + 1), dtype=j_dtype)
        rows = js.size * n_nodes
        np.greater_equal(k_inf[None], js[:, None, None], out=ge[:js.size])
        at_least = masks[:rows]
        np.copyto(at_least, ge[:js.size].reshape(rows, k.shape[1]))
        ranked = np.matmul(at_least, failT, out=products[:rows]).reshape(js.size, n_nodes, n_nodes)
        if lo == 1:  # ranked_1: the totals
            if balance:
                np.minimum(ranked[0], ranked[0].T, out=m)
            else:
                np.copyto(m, ranked[0])
        for r in ranked:
            t += np.greater_equal(r, m, out=kept)
    np.copyto(t, kmax + 1, where=np.less_equal(m, 0, out=kept))
    return t


def select_sources_arrays(k: np.ndarray, n: np.ndarray | int, balance: bool,
                          compat: Mapping[tuple[int, int], float] | np.ndarray,
                          can_source: Sequence[bool] | None = None,
                          cap: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """For every receiver r, (prompt columns, source indices) of its chosen groups, in
    column order: core.exchange.select_sources' choice (see the module docstring) for the
    (N, P) arrays k and n (k MISSING where a node has no group). `compat`: the estimate per
    (source index, receiver index) of the pairs that have one (NaN: known, never wins), or
    the (N, N) matrix of them with +inf where a pair has none and -inf for NaN."""
    # row-major (the matcher's is): every (N, P) mask made from a column-major k would be
    # column-major too, and copied on each reshape and ravel (twice the time of the
    # selection at 64 x 4,096)
    k = np.ascontiguousarray(k)
    with _scratch() as scratch:
        return _select(k, np.broadcast_to(np.asarray(n), k.shape), balance, compat, can_source, cap, scratch)


def _select(k: np.ndarray, n: np.ndarray, balance: bool, compat: Mapping[tuple[int, int], float] | np.ndarray,
            can_source: Sequence[bool] | None, cap: int | None, scratch: _Scratch) -> list[tuple[np.ndarray, np.ndarray]]:
    """select_sources_arrays with the round's (N, P) and (N, N) arrays in `scratch`'s buffers."""
    n_nodes = k.shape[0]
    published = np.not_equal(k, MISSING, out=scratch.array("published", k.shape, np.bool_))
    fail = np.equal(k, 0, out=scratch.array("fail", k.shape, np.bool_))
    fail &= published
    # informative groups (0 < k < n) of the nodes that may share: a node that may not offers
    # nothing, in either pair direction's count
    inf_src = np.greater(k, 0, out=scratch.array("inf_src", k.shape, np.bool_))
    inf_src &= published
    inf_src &= np.less(k, n, out=scratch.array("below_n", k.shape, np.bool_))
    if can_source is not None:
        inf_src &= np.asarray(can_source, dtype=bool)[:, None]
    t = _thresholds(k, n, fail, inf_src, balance, scratch)
    # est[s, r]: source_rank's first key (an unexplored pair counts as +inf; NaN never wins a
    # comparison in max(), so it ranks below everything)
    if isinstance(compat, np.ndarray):  # already est_all (broker/compat.py's estimates)
        if compat.shape != (n_nodes, n_nodes):
            raise ValueError(f"compatibility estimates of shape {compat.shape} for {n_nodes} nodes")
        est_all = compat
        uniform = bool((compat == math.inf).all())
    else:
        est_all = np.full((n_nodes, n_nodes), math.inf)
        if compat:
            pairs = np.array(list(compat), dtype=np.int64).reshape(-1, 2)
            vals = np.fromiter(compat.values(), dtype=np.float64, count=len(compat))
            inside = ((pairs >= 0) & (pairs < n_nodes)).all(axis=1)
            est_all[pairs[inside, 0], pairs[inside, 1]] = np.where(np.isnan(vals[inside]), -math.inf, vals[inside])
        uniform = not compat
    # Prompt-major (P, N): per (prompt, source), k_S where the source offers an informative
    # group, else -1. A receiver's failed prompts are then whole rows (a gather of rows is a
    # copy of contiguous memory; one of columns was most of the time at 64 x 4,096).
    kkT = scratch.array("kkT", k.shape[::-1], np.int32)
    kkT.fill(-1)
    np.copyto(kkT, k.T, where=inf_src.T)
    kspan = int(kkT.max()) + 2 if kkT.size else 1  # k_S + 1 in [0, kspan)
    if uniform:  # every pair unexplored: one rank, the receiver's own pair below it
        ranks = np.ones((n_nodes, n_nodes), dtype=np.int32)
        np.fill_diagonal(ranks, 0)
    else:
        ranks = _dense_ranks(est_all)
    return [_capped(cols, src, kkT, cap) for cols, src in _ranked_choices(kkT, t, ranks, fail, kspan)]


TOP_SOURCES = 8  # a receiver's best-ranked sources tried first (_walk_ranked, _few)
PROMPT_TRIES = 64  # a tied receiver's candidates tried per prompt, best k_S first (_ranked_choices)
SCORES_PER_BLOCK = 1 << 20  # (pair, source) scores computed at once (_best_of_few, _score_all)
INT32_SCORES_BELOW = 2**31  # _best_of_few's scores in int32 where every one is below this


def _dense_ranks(est: np.ndarray) -> np.ndarray:
    """ranks[s, r]: the rank of est[s, r] among receiver r's estimates (column r), 0 the
    lowest, equal estimates one rank: -inf lowest, +inf highest, NaN as -inf (never wins,
    as select_sources_arrays reads it). A receiver's own pair (the diagonal, never a
    source: it failed the prompt) ranks lowest, so that its best-ranked sources are real."""
    if not est.size:
        return np.zeros(est.shape, dtype=np.int32)
    # a receiver's estimates as a row: sorts and gathers along contiguous memory (2x faster)
    est = np.ascontiguousarray(np.where(np.isnan(est), -np.inf, est).T)
    np.fill_diagonal(est, -np.inf)
    by = np.argsort(est, axis=1)  # equal estimates take one rank in any order: no stable sort
    ordered = np.take_along_axis(est, by, axis=1)
    step = np.ones(est.shape, dtype=np.int32)
    step[:, 0] = 0
    step[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    del ordered
    ranks = np.empty(est.shape, dtype=np.int32)
    np.put_along_axis(ranks, by, np.cumsum(step, axis=1, dtype=np.int32), axis=1)
    return ranks.T


def _ranked_choices(kkT: np.ndarray, t: np.ndarray, ranks: np.ndarray, fail: np.ndarray,
                    kspan: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per receiver, (failed prompt columns with a winner, the winners), every receiver in
    one batch. The score of a source for a (receiver, prompt) pair is ((rank x kspan + k_S)
    x N + N - 1 - source), -1 where the pair's threshold rejects k_S: the compatibility rank
    leads, so a pair's winner is the best passing source of the highest rank that has one.
    Cheap ways find most winners without scoring every source:
    - a receiver whose TOP_SOURCES best-ranked sources each have a rank of their own, above
      every other source's (estimates that differ): its pairs are tried on its best source,
      those left on the next, and so on (_walk_ranked);
    - a receiver whose best rank is shared by n_top sources, n_top^2 >= 2 N (say, the pairs
      still unexplored, +inf, early in a federation): the winner is the first source
      of that rank, in the prompt's order of k_S (highest first, then the lower index), that
      passes the pair's threshold; each prompt's sources are sorted once for every
      receiver, and its pairs walk them (_walk_prompts): about N / n_top tries a pair;
    - any other receiver (its best rank shared by fewer, say the few pairs still
      unexplored later on): its pairs are scored over the sources of its best rank where
      they are TOP_SOURCES / 2 or more, else over its TOP_SOURCES best-ranked sources and
      those tied with the last of them where those are fewer than a quarter of the sources
      (_few, _best_of_few): at least n_top scores a pair, so the walk costs less from about
      n_top^2 = 2 N on (select alone, bench/broker/results/s49_select_micro.txt).
    The pairs none of them settles are scored over every source, SCORES_PER_BLOCK scores at
    a time (_score_all)."""
    n_nodes = ranks.shape[0]
    # pairs, receiver-major, prompts ascending (np.nonzero is 4x slower)
    rr, pp = np.divmod(np.flatnonzero(fail), fail.shape[1])
    src = np.zeros(rr.size, dtype=np.int64)
    has = np.zeros(rr.size, dtype=bool)
    bounds = np.searchsorted(rr, np.arange(n_nodes + 1), side="left")
    if rr.size:
        at_top = ranks == ranks.max(axis=0)  # (N, N): the sources of each receiver's best rank
        n_top = at_top.sum(axis=0)
        ranked_by = _distinct_best(ranks, n_top)  # (m, N): receiver r's i-th best source, or -1
        way = np.where(ranked_by[0] >= 0, 0, np.where(n_top * n_top >= 2 * n_nodes, 1, 2))
        pair_way = way[rr]
        few = np.flatnonzero(pair_way == 2)
        left = [_walk_ranked(np.flatnonzero(pair_way == 0), rr, pp, ranked_by, kkT, t, src, has),
                _walk_prompts(np.flatnonzero(pair_way == 1), rr, pp, at_top, kkT, t, src, has),
                _best_of_few(few, rr, pp, _few(ranks, at_top, n_top, way == 2) if few.size else at_top, ranks,
                             kkT, t, kspan, src, has)]
        _score_all(np.concatenate(left), rr, pp, ranks, kkT, t, kspan, src, has)
    out = []
    for r in range(n_nodes):
        sl = slice(bounds[r], bounds[r + 1])
        keep = has[sl]
        out.append((pp[sl][keep], src[sl][keep]))
    return out


def _distinct_best(ranks: np.ndarray, n_top: np.ndarray) -> np.ndarray:
    """by[i, r]: receiver r's i-th best-ranked source (i < TOP_SOURCES), for each receiver
    whose TOP_SOURCES best ranks are distinct and above every other source's; -1 in
    column r for any other receiver. n_top: per receiver, how many sources share its best
    rank."""
    n_nodes = ranks.shape[0]
    m = min(TOP_SOURCES, n_nodes)
    out = np.full((max(m, 1), n_nodes), -1, dtype=np.int64)
    # a receiver whose best rank is shared (say, many pairs still unexplored, +inf) cannot
    # qualify: only the others are sorted
    maybe = np.flatnonzero(n_top == 1) if m else np.zeros(0, dtype=np.int64)
    if not maybe.size:
        return out
    source = np.arange(n_nodes)
    rows = ranks.T[maybe]  # receivers as rows (a receiver's sources along contiguous memory)
    key = -rows.astype(np.int64) * n_nodes + source  # ascending: best rank first, then the lower index
    top = min(m + 1, n_nodes)
    if top < n_nodes:  # each receiver's top + 1 sources only, then those in order
        part = np.argpartition(key, top - 1, axis=1)[:, :top]
        by = np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, axis=1), axis=1), axis=1)
    else:
        by = np.argsort(key, axis=1)
    # by[j, i]: receiver maybe[j]'s i-th best source (the keys are distinct)
    ranked = np.take_along_axis(rows, by, axis=1)  # (len(maybe), m or m + 1), best first
    ok = (np.diff(ranked, axis=1) < 0).all(axis=1)  # no tie among the top or across the cut
    out[:, maybe[ok]] = by[ok, :m].T
    return out


def _few(ranks: np.ndarray, at_top: np.ndarray, n_top: np.ndarray, receivers: np.ndarray) -> np.ndarray:
    """few[:, r] for each receiver r marked in `receivers` (its best rank shared by few
    sources): those of its best rank where they are TOP_SOURCES / 2 or more (most pairs have
    a winner among them); else the sources ranked at least as high as its TOP_SOURCES-th
    best, where they are fewer than a quarter of the sources. Every source ranked above the
    lowest of them is one of them. n_top: per receiver, how many sources share its best rank."""
    few = at_top.copy()
    cols = np.flatnonzero(receivers & (2 * n_top < TOP_SOURCES))
    n_nodes = ranks.shape[0]
    m = min(TOP_SOURCES, n_nodes)
    if cols.size and m:
        sub = ranks[:, cols]
        ranked = sub >= np.partition(sub, n_nodes - m, axis=0)[n_nodes - m]
        wider = 4 * ranked.sum(axis=0) < n_nodes
        few[:, cols[wider]] = ranked[:, wider]
    return few


def _walk_ranked(pending: np.ndarray, rr: np.ndarray, pp: np.ndarray, by: np.ndarray, kkT: np.ndarray,
                 t: np.ndarray, src: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Settles the pairs `pending` (indices into rr, pp) whose receiver's best sources `by`
    are distinct: each is won by the first of them, best first, whose group passes the
    pair's threshold. Returns the pairs none of them passes (none when they are every
    source)."""
    n_nodes = t.shape[0]
    k_flat, t_flat = kkT.ravel(), t.ravel()
    for i in range(by.shape[0]):
        if not pending.size:
            break
        r = rr[pending]
        s = by[i][r]
        passed = k_flat[pp[pending] * n_nodes + s] >= t_flat[s * n_nodes + r]
        won = pending[passed]
        src[won], has[won] = s[passed], True
        pending = pending[~passed]
    return pending if by.shape[0] < n_nodes else pending[:0]


def _walk_prompts(pending: np.ndarray, rr: np.ndarray, pp: np.ndarray, at_top: np.ndarray, kkT: np.ndarray,
                  t: np.ndarray, src: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Settles the pairs `pending` by the sources of their receiver's best rank (at_top[:,
    r]): each is won by the first source of that rank, in its prompt's order (k_S highest
    first, then the lower index), whose group passes the pair's threshold. Returns the pairs
    it did not settle: no source of the best rank passes, or none within PROMPT_TRIES of the
    prompt's order."""
    n_nodes = t.shape[0]
    k_flat, t_flat, top_flat = kkT.ravel(), t.ravel(), at_top.ravel()
    tried = []
    order = row = None
    for i in range(min(PROMPT_TRIES, n_nodes)):
        if not pending.size:
            break
        r, p = rr[pending], pp[pending]
        if not i:  # a prompt's first source: its arg-max (the first of the highest k_S), no sort
            s = kkT.argmax(axis=1)[p]
        else:
            if order is None:  # each pending prompt's sources, k_S highest first, then the lower index
                prompts = np.flatnonzero(np.bincount(p, minlength=kkT.shape[0]))  # np.unique(p), ascending
                row = np.zeros(kkT.shape[0], dtype=np.int64)
                row[prompts] = np.arange(prompts.size)
                order = np.argsort(-kkT[prompts], axis=1, kind="stable")[:, :PROMPT_TRIES].copy()  # not the whole sort
            s = order[row[p], i]
        k_s = k_flat[p * n_nodes + s]
        gone = k_s < 0  # no informative group left in the prompt's order
        st = s * n_nodes + r
        passed = ~gone & top_flat[st] & (k_s >= t_flat[st])
        won = pending[passed]
        src[won], has[won] = s[passed], True
        tried.append(pending[gone])
        pending = pending[~(passed | gone)]
    return np.concatenate([*tried, pending])


def _best_of_few(pending: np.ndarray, rr: np.ndarray, pp: np.ndarray, few: np.ndarray, ranks: np.ndarray,
                 kkT: np.ndarray, t: np.ndarray, kspan: int, src: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Settles the pairs `pending` by their score over a few sources of their receiver r
    (few[:, r]: every source ranked above the lowest of them is one of them, so the best of
    them that passes is the pair's winner). Receivers are taken in groups whose number of
    such sources rounds up to the same power of two (a padded (width x pairs) gather each),
    SCORES_PER_BLOCK scores at a time. Returns the pairs none of them passes."""
    if not pending.size:
        return pending
    n_nodes = t.shape[0]
    receivers = np.flatnonzero(np.bincount(rr[pending], minlength=n_nodes))  # np.unique, ascending
    width = 1 << np.ceil(np.log2(few[:, receivers].sum(axis=0))).astype(np.int64)
    row = np.zeros(n_nodes, dtype=np.int64)  # a receiver's row in its group's `members`
    k_flat = kkT.ravel()
    dtype = np.int32 if (kspan + 1) * n_nodes * n_nodes < INT32_SCORES_BELOW else np.int64  # scores
    left = []
    for w in sorted(set(width.tolist())):
        group = receivers[width == w]
        row[group] = np.arange(group.size)
        gi, gs = np.nonzero(few[:, group].T)  # (receiver in group, source), sources ascending
        at = (np.arange(gi.size) - np.searchsorted(gi, gi), gi)
        # (width, group) tables, so that a block's scores are (width, pairs): its maximum over
        # the first axis is element-wise (along a short last axis it is 2x slower)
        members = np.zeros((w, group.size), dtype=np.int64)  # padded with source 0 ...
        members[at] = gs
        t_of = np.full((w, group.size), np.iinfo(np.int32).max, dtype=t.dtype)  # ... that never passes
        t_of[at] = t[gs, group[gi]]
        score_of = np.zeros((w, group.size), dtype=dtype)  # the score less k_S x N
        score_of[at] = ranks[gs, group[gi]].astype(np.int64) * kspan * n_nodes + (n_nodes - 1 - gs)
        member = np.zeros(n_nodes, dtype=bool)
        member[group] = True
        mine = pending[member[rr[pending]]]
        block = max(1, SCORES_PER_BLOCK // w)
        for lo in range(0, mine.size, block):
            i = mine[lo:lo + block]
            g = row[rr[i]]
            k_s = k_flat.take(members.take(g, axis=1) + pp[i] * n_nodes)  # (w, B)
            best = np.where(k_s >= t_of.take(g, axis=1), score_of.take(g, axis=1) + k_s.astype(dtype) * n_nodes,
                            -1).max(axis=0)
            won = best >= 0  # the score's last term is N - 1 - source
            src[i[won]], has[i[won]] = n_nodes - 1 - best[won] % n_nodes, True
            left.append(i[~won])
    return np.concatenate(left) if left else pending[:0]


def _score_all(pending: np.ndarray, rr: np.ndarray, pp: np.ndarray, ranks: np.ndarray, kkT: np.ndarray,
               t: np.ndarray, kspan: int, src: np.ndarray, has: np.ndarray) -> None:
    """Settles the pairs `pending` by their score over every source, SCORES_PER_BLOCK scores
    at a time."""
    if not pending.size:
        return
    n_nodes = t.shape[0]
    block = max(1, SCORES_PER_BLOCK // n_nodes)
    tie = n_nodes - 1 - np.arange(n_nodes)  # the lower index wins a tie
    tT, ranksT = t.T, ranks.T  # a receiver's column as a row
    for lo in range(0, pending.size, block):
        i = pending[lo:lo + block]
        r = rr[i]
        k_s = kkT[pp[i]].astype(np.int64)  # (F', N)
        cand = np.where(k_s >= tT[r], (ranksT[r].astype(np.int64) * kspan + k_s) * n_nodes + tie, -1)
        best = cand.argmax(axis=1)
        src[i] = best
        has[i] = cand[np.arange(i.size), best] >= 0


def _capped(cols: np.ndarray, src: np.ndarray, kkT: np.ndarray, cap: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A receiver's choice with at most `cap` groups: SelectWithTies on k_S."""
    if cap is None or not cols.size:
        return cols, src
    k_chosen = kkT[cols, src]
    if cap <= 0:
        keep = np.zeros(cols.size, dtype=bool)
    elif cols.size > cap:
        keep = k_chosen >= np.sort(k_chosen)[::-1][cap - 1]
    else:
        return cols, src
    return cols[keep], src[keep]


def select_sources_fast(kn: Sequence[Mapping[Hashable, tuple[int, int]]], balance: bool,
                        compat: Mapping[tuple[int, int], float], can_source: Sequence[bool] | None = None,
                        cap: int | None = None) -> list[dict[Hashable, int]]:
    """select_sources' signature and result (prompt id -> source index per receiver)."""
    pids, k, n = kn_arrays(kn)
    if not pids:
        return [{} for _ in kn]
    return [{pids[c]: int(s) for c, s in zip(cols.tolist(), src.tolist())}
            for cols, src in select_sources_arrays(k, n, balance, compat, can_source, cap)]
