"""core.exchange.select_sources on arrays: the same choices, without Python loops over
pairs and prompts.

`select_sources` walks every ordered pair of nodes and, for each, every prompt: N^2 x P
steps of Python, which at 64 nodes x 4,096 prompts took the broker a minute per round
(issue 13). The rule only needs, per ordered pair (a, b), how many of b's all-fail prompts
a has an informative group for at each k (SelectWithTies keeps every candidate whose k_S
reaches the m-th largest, so a histogram of k per pair fixes the threshold), and then, per
receiver and prompt, the `source_rank` winner among the sources that passed their pair's
threshold. Both are array operations: one (n - 1)-term sum of (N x P) @ (P x N) products,
then one masked arg-max per receiver over (N x its failed prompts).

`select_sources_arrays` returns exactly what `select_sources` returns for the same input
(tests/broker/test_matching.py compares them on random rounds with ties, N > 2, balance on
and off, sources that may not share, compatibility known and unknown, and a cap).
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping, Sequence

import numpy as np

MISSING = -1  # k of a prompt the node did not publish

INT32_SCORES_BELOW = 2**31  # scores (and flat table indices) from this on are computed in int64


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


def _thresholds(k: np.ndarray, n: np.ndarray, fail: np.ndarray, inf_src: np.ndarray, balance: bool) -> np.ndarray:
    """t[a, b]: the smallest k_S of a's groups that SelectWithTies keeps in direction a -> b
    (every candidate with k_S >= t is kept); kmax + 1 when the pair exchanges nothing."""
    n_nodes = k.shape[0]
    kmax = int(n[inf_src].max()) - 1 if inf_src.any() else 1
    failT = fail.T.astype(np.float32)  # (P, N)
    hist = []  # hist[j - 1][a, b]: a's informative groups with k_S = j on prompts b failed entirely
    for j in range(1, kmax + 1):
        a_j = (inf_src & (k == j)).astype(np.float32)
        hist.append(a_j @ failT if a_j.any() else np.zeros((n_nodes, n_nodes), dtype=np.float32))
    total = np.sum(hist, axis=0) if hist else np.zeros((n_nodes, n_nodes), dtype=np.float32)
    m = np.minimum(total, total.T) if balance else total  # how many each direction keeps before ties
    t = np.full((n_nodes, n_nodes), kmax + 1, dtype=np.int64)
    ranked = np.zeros((n_nodes, n_nodes), dtype=np.float32)  # candidates with k_S >= j
    for j in range(kmax, 0, -1):
        ranked += hist[j - 1]
        t = np.where((t == kmax + 1) & (m > 0) & (ranked >= m), j, t)
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
    n_nodes = k.shape[0]
    n = np.broadcast_to(np.asarray(n), k.shape)
    published = k != MISSING
    fail = published & (k == 0)
    inf = published & (k > 0) & (k < n)
    ok = np.ones(n_nodes, dtype=bool) if can_source is None else np.asarray(can_source, dtype=bool)
    inf_src = inf & ok[:, None]  # a node that may not share offers nothing, in either pair direction's count
    t = _thresholds(k, n, fail, inf_src, balance)
    order = np.arange(n_nodes)
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
    kkT = np.ascontiguousarray(np.where(inf_src, k, -1).T, dtype=np.int32)
    kspan = int(kkT.max()) + 2  # k_S + 1 in [0, kspan)
    # source_rank for receiver r is one integer per (source, k_S): ((compatibility rank) x
    # kspan + k_S) x N + (N - 1 - source), higher is better, -1 where the pair's threshold
    # rejects that k_S. So each receiver needs a (N, kspan) table, and a prompt's candidates
    # are that table gathered at flat[p, s] = s x kspan + k_S + 1: one gather and one arg-max.
    flat = None
    ks_of = np.arange(kspan) - 1  # the k_S of each table column
    tie = (n_nodes - 1 - order)[:, None]  # the lower index wins a tie
    wide = (n_nodes * kspan + kspan) * n_nodes >= INT32_SCORES_BELOW
    score_dtype = np.int64 if wide else np.int32

    def table(r: int, rank: np.ndarray | int) -> np.ndarray:
        score = (rank * kspan + ks_of[None, :]) * n_nodes + tie
        return np.where(ks_of[None, :] >= t[:, r][:, None], score, -1).astype(score_dtype).ravel()

    # Without compatibility estimates the score of a (source, prompt) does not depend on the
    # receiver: the best-scored source of each prompt (highest k_S, then lowest index: the
    # first arg-max) wins wherever it passes its pair's threshold, which it usually does;
    # only the other prompts need the table.
    top = kkT.argmax(axis=1) if uniform else None  # (P,)
    top_k = kkT[np.arange(kkT.shape[0]), top] if uniform else None
    # With estimates: the compatibility rank of each source for each receiver (equal
    # estimates tie), and the receivers whose best-ranked sources are chosen in one batch
    ranks = None if uniform else _dense_ranks(est_all)
    batched = {} if uniform else _ranked_choices(kkT, t, ranks, fail, kspan)
    out = []
    for r in range(n_nodes):
        if r in batched:
            cols, src = batched[r]
            out.append(_capped(cols, src, kkT, cap))
            continue
        cols = np.flatnonzero(fail[r])
        if not cols.size:
            out.append((cols, cols.copy()))
            continue
        if uniform:
            src = top[cols]
            done = top_k[cols] >= t[src, r]
            if done.all():
                out.append(_capped(cols, src, kkT, cap))
                continue
            rest = cols[~done]
            if flat is None:
                flat = kkT + 1 + (order * kspan).astype(np.int32)[None, :]
            cand = table(r, 0)[flat[rest]]  # (C, N)
            best = cand.argmax(axis=1)
            src = src.copy()
            src[~done] = best
            has = np.ones(cols.size, dtype=bool)
            has[~done] = cand[np.arange(rest.size), best] >= 0
        else:
            if flat is None:
                flat = kkT + 1 + (order * kspan).astype(np.int32)[None, :]
            # compatibility first (unknown = +inf); equal estimates tie
            rank = ranks[:, r]
            src, has = _best_ranked(table(r, rank[:, None]), flat, cols, rank)
        if not has.all():
            cols, src = cols[has], src[has]
        out.append(_capped(cols, src, kkT, cap))
    return out


TOP_SOURCES = 8  # a receiver's best-ranked sources tried first (_best_ranked)


SCORES_PER_BLOCK = 1 << 20  # (pair, source) scores computed at once over every source (_ranked_choices): 8 MiB each


def _dense_ranks(est: np.ndarray) -> np.ndarray:
    """ranks[s, r]: the rank of est[s, r] among receiver r's estimates (column r), 0 the
    lowest, equal estimates one rank: -inf lowest, +inf highest, NaN as -inf (never wins,
    as select_sources_arrays reads it). A receiver's own pair (the diagonal, never a
    source: it failed the prompt) ranks lowest, so that its best-ranked sources are real."""
    if not est.size:
        return np.zeros(est.shape, dtype=np.int64)
    est = np.where(np.isnan(est), -np.inf, est)
    np.fill_diagonal(est, -np.inf)
    by = np.argsort(est, axis=0, kind="stable")
    ordered = np.take_along_axis(est, by, axis=0)
    step = np.ones(est.shape, dtype=np.int64)
    step[0] = 0
    step[1:] = ordered[1:] != ordered[:-1]
    ranks = np.empty(est.shape, dtype=np.int64)
    np.put_along_axis(ranks, by, np.cumsum(step, axis=0), axis=0)
    return ranks


def _ranked_choices(kkT: np.ndarray, t: np.ndarray, ranks: np.ndarray, fail: np.ndarray,
                    kspan: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """receiver -> (failed prompt columns with a winner, the winners), for every receiver
    whose TOP_SOURCES best-ranked sources each have a rank of their own, above every other
    source's (with estimates that differ, all of them), in one batch. The rank leads the
    score, so a (receiver, prompt) pair's winner is then the first of those sources, best
    first, whose group passes the pair's threshold: the pairs are tried on the best source,
    those left on the next, and so on (a few 1-D gathers over fewer and fewer pairs); the
    pairs none of them passes are scored over every source, SCORES_PER_BLOCK scores at a time, with
    the table's score ((rank x kspan + k_S) x N + N - 1 - source; -1 where the pair's
    threshold rejects k_S)."""
    n_nodes = ranks.shape[0]
    m = min(TOP_SOURCES, n_nodes)
    if not m:
        return {}
    source = np.arange(n_nodes)
    # a receiver whose best rank is shared (say, many pairs still unexplored, +inf) cannot
    # qualify: only the others are sorted
    maybe = np.flatnonzero((ranks == ranks.max(axis=0)).sum(axis=0) == 1)
    if not maybe.size:
        return {}
    key = -ranks[:, maybe] * n_nodes + source[:, None]  # ascending: best rank first, then the lower index
    top = min(m + 1, n_nodes)
    if top < n_nodes:  # each receiver's top + 1 sources only, then those in order
        part = np.argpartition(key, top - 1, axis=0)[:top]
        by = np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, axis=0), axis=0), axis=0)
    else:
        by = np.argsort(key, axis=0)
    # by[i, j]: receiver maybe[j]'s i-th best source (the keys are distinct)
    ranked = np.take_along_axis(ranks[:, maybe], by, axis=0)  # (m or m + 1, len(maybe)), best first
    ok = (np.diff(ranked, axis=0) < 0).all(axis=0)  # no tie among the top or across the cut
    receivers, by = maybe[ok], by[:, ok]
    if not receivers.size:
        return {}
    first = np.full(n_nodes, -1, dtype=np.int64)  # a receiver's column in `by`
    first[receivers] = np.arange(receivers.size)
    rr, pp = np.nonzero(fail[receivers])  # pairs, receiver-major, prompts ascending
    rr = receivers[rr]
    k_flat, t_flat = kkT.ravel(), t.ravel()
    src = np.zeros(rr.size, dtype=np.int64)
    has = np.zeros(rr.size, dtype=bool)
    pending = np.arange(rr.size)
    for i in range(m):
        r = rr[pending]
        s = by[i][first[r]]
        passed = k_flat[pp[pending] * n_nodes + s] >= t_flat[s * n_nodes + r]
        won = pending[passed]
        src[won], has[won] = s[passed], True
        pending = pending[~passed]
        if not pending.size:
            break
    if m < n_nodes:  # the rest, over every source
        block = max(1, SCORES_PER_BLOCK // n_nodes)
        tie = n_nodes - 1 - source  # the lower index wins a tie
        for lo in range(0, pending.size, block):
            i = pending[lo:lo + block]
            r = rr[i]
            k_s = kkT[pp[i]].astype(np.int64)  # (F', N)
            cand = np.where(k_s >= t[:, r].T, (ranks[:, r].T * kspan + k_s) * n_nodes + tie, -1)
            best = cand.argmax(axis=1)
            src[i] = best
            has[i] = cand[np.arange(i.size), best] >= 0
    bounds = np.searchsorted(rr, receivers, side="left").tolist() + [rr.size]
    out = {}
    for j, r in enumerate(receivers.tolist()):
        sl = slice(bounds[j], bounds[j + 1])
        keep = has[sl]
        out[r] = (pp[sl][keep], src[sl][keep])
    return out


def _best_ranked(tab: np.ndarray, flat: np.ndarray, cols: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, found) per failed prompt `cols` of one receiver: the arg-max of its score
    table `tab` gathered at flat[cols] (-1: the pair's threshold rejects it), computed on
    its TOP_SOURCES best-ranked sources first (with every source tied with the last of
    them). The compatibility rank leads the score, so a prompt that one of those passes has
    its winner among them; only the other prompts are gathered over every source. With
    estimates that differ, a receiver's failed prompts are then a (C x 8) gather, not a
    (C x N) one (at 64 x 4,096, most of a round's matching once reports came in)."""
    n_nodes = rank.size
    top = None
    if TOP_SOURCES < n_nodes:  # the sources ranked at least as high as the TOP_SOURCES-th best (no sort)
        top = np.flatnonzero(rank >= np.partition(rank, n_nodes - TOP_SOURCES)[n_nodes - TOP_SOURCES])
    if top is None or 2 * top.size > n_nodes:  # (a gather of whole rows is faster than one of half their columns)
        cand = tab[flat[cols]]  # (C, N)
        src = cand.argmax(axis=1)
        return src, cand[np.arange(cols.size), src] >= 0
    cand = tab[flat[np.ix_(cols, top)]]  # (C, m)
    best = cand.argmax(axis=1)
    src = top[best]
    has = cand[np.arange(cols.size), best] >= 0
    if not has.all():
        rest = np.flatnonzero(~has)
        cand = tab[flat[cols[rest]]]  # (C', N)
        best = cand.argmax(axis=1)
        src[rest] = best
        has[rest] = cand[np.arange(rest.size), best] >= 0
    return src, has


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
