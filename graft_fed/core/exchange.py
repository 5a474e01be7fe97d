"""GRAFT's exchange as pure functions (docs/algorithm.md steps 5-10 and 13, and "N models").

Nothing here touches a model or a tokenizer: the caller computes mean log-likelihoods
and hands in plain numbers; these functions decide which groups move, which responses
are admitted and with what weight, and in which order minibatches are trained.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Literal, Mapping, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

# torch is imported where a function needs it, not here: the broker uses this module's
# selection rules and must not load torch (2 s at start, 180,000 objects that every full
# garbage collection walks while holding the GIL; issue 13, fourth pass)

K = TypeVar("K", bound=Hashable)

GroupKind = Literal["all_fail", "informative", "all_pass"]


def classify(k: int, n: int) -> GroupKind:
    """Eq. 4's test, on the binary outcome k (successes) out of n -- never on a shaped score's std."""
    if not 0 <= k <= n:
        raise ValueError(f"successes k={k} must be in [0, n={n}]")
    if k == 0:
        return "all_fail"
    return "all_pass" if k == n else "informative"


def candidates(receiver: Mapping[K, tuple[int, int]], source: Mapping[K, tuple[int, int]]) -> list[tuple[K, int]]:
    """C_{S->R} (Eq. 4): prompts the receiver failed entirely and the source group is informative.

    receiver, source: prompt id -> (k, n). Returns [(prompt id, k_S)] in the receiver's order.
    """
    out = []
    for pid, (k_r, n_r) in receiver.items():
        if classify(k_r, n_r) != "all_fail" or pid not in source:
            continue
        k_s, n_s = source[pid]
        if classify(k_s, n_s) == "informative":
            out.append((pid, k_s))
    return out


def complementarity(receiver: Mapping[K, tuple[int, int]], peers: Iterable[tuple[K, int, int]]) -> tuple[int, int]:
    """(candidates, solved) of the receiver's all-fail prompts: how many have an informative
    peer group, and how many some peer solved at least once (the paper's complementarity:
    47.9% / 18.7% of all-fail prompts). receiver: prompt id -> (k, n); peers: (prompt id,
    k_S, n_S) of the peers' groups."""
    fails = {pid for pid, (k, n) in receiver.items() if classify(k, n) == "all_fail"}
    informative, solved = set(), set()
    for pid, k, n in peers:
        if pid not in fails:
            continue
        if k >= 1:
            solved.add(pid)
        if classify(k, n) == "informative":
            informative.add(pid)
    return len(informative), len(solved)


def select_with_ties(cands: Sequence[tuple[K, int]], m: int) -> list[K]:
    """SelectWithTies: rank by k_S descending, keep the first m plus every candidate tied
    with the m-th. m = 0 keeps nothing. Stable: equal k keep their input order."""
    if m <= 0 or not cands:
        return []
    ranked = sorted(cands, key=lambda c: -c[1])
    if m >= len(ranked):
        return [pid for pid, _ in ranked]
    threshold = ranked[m - 1][1]
    return [pid for i, (pid, k) in enumerate(ranked) if i < m or k == threshold]


def balanced_pair(c_ab: Sequence[tuple[K, int]], c_ba: Sequence[tuple[K, int]],
                  balance: bool = True) -> tuple[list[K], list[K]]:
    """The paper's two-model selection (step 6): m = min(|C_AB|, |C_BA|) in each direction,
    with ties; m = 0 means no exchange in either direction. balance=False keeps every
    candidate (the "no balancing" ablation, and the stored mode's one direction)."""
    if not balance:
        return [p for p, _ in c_ab], [p for p, _ in c_ba]
    m = min(len(c_ab), len(c_ba))
    return select_with_ties(c_ab, m), select_with_ties(c_ba, m)


@dataclass(frozen=True)
class SourceGroup:
    """One informative group a source could give a receiver for one prompt."""

    source: Hashable
    k: int  # the source's successes out of n
    round: int = 0  # when the source sampled it (freshness)
    order: int = 0  # the source's place among the candidates (the last tie-breaker)


def source_rank(group: SourceGroup, compat: float | None) -> tuple[float, int, int, int]:
    """THE rule that picks one source for a prompt, wherever a choice is made (co-training,
    synchronous and asynchronous federation rounds, late joiners, stored peers): the larger
    key wins. Highest compatibility estimate with this receiver first (a pair with no
    history yet counts as +inf, so every pair gets tried: explicit exploration), then the
    highest k_S, then the freshest group, then the first candidate."""
    return (math.inf if compat is None else compat, group.k, group.round, -group.order)


def best_source(groups: Sequence[SourceGroup], compat: Mapping[Hashable, float]) -> SourceGroup:
    """The winner of `source_rank` among one prompt's candidate groups (`compat`: source ->
    its estimate with this receiver)."""
    return max(groups, key=lambda g: source_rank(g, compat.get(g.source)))


def select_for_receiver(receiver: Mapping[K, tuple[int, int]], offers: Mapping[K, Sequence[tuple[SourceGroup, int]]],
                        compat: Mapping[Hashable, float]) -> dict[K, SourceGroup]:
    """One direction, every candidate (stored peers, asynchronous rounds, late joiners): for
    each prompt the receiver failed entirely, the best of the sources' informative groups.

    receiver: prompt id -> (k, n); offers: prompt id -> [(source group, n_S)]."""
    out: dict[K, SourceGroup] = {}
    for pid, (k_r, n_r) in receiver.items():
        if classify(k_r, n_r) != "all_fail":
            continue
        usable = [g for g, n_s in offers.get(pid, ()) if classify(g.k, n_s) == "informative"]
        if usable:
            out[pid] = best_source(usable, compat)
    return out


def random_peer(key: Hashable, receiver: int, prompt_id: Hashable, n_models: int) -> int:
    """The "random peer per prompt" ablation's draw: one of the receiver's N - 1 peers,
    uniformly, from a stream keyed by (key, receiver, prompt id) alone, so the draw is a pure
    function of its arguments (reproducible, and the same wherever it is made)."""
    peers = [m for m in range(n_models) if m != receiver]
    return random.Random(f"random-peer|{key}|{receiver}|{prompt_id}").choice(peers)


def select_sources(kn: Sequence[Mapping[K, tuple[int, int]]], balance: bool,
                   compat: Mapping[tuple[int, int], float],
                   can_source: Sequence[bool] | None = None, cap: int | None = None,
                   choice: str = "compatibility", key: Hashable = 0) -> list[dict[K, int]]:
    """For every receiver r: prompt id -> source index (co-training and synchronous rounds).

    N = 2 is exactly the paper's rule (balanced_pair). For N > 2 each ordered pair is
    first selected as the paper does for two models (pairwise-balanced, or all candidates
    when balance is off); a prompt that several sources could serve goes to the winner of
    `source_rank` (compatibility with this receiver, then k_S, then the lowest index). A
    model with can_source False (it shares no trajectories) offers no candidates;
    balancing then sees its direction as empty. `cap` (the per-receiver-cap policy) keeps
    at most that many prompts per receiver, those with the most compatible source first,
    then the highest k_S (ties with the last kept k_S are kept, as in SelectWithTies).

    choice="random" is an ablation, not the method (graft.source_choice): for each prompt the
    receiver failed entirely, one of its N - 1 peers is drawn uniformly (`random_peer`, keyed by
    `key`), as swarm systems that share rollouts with random peers do; the prompt moves only if
    that peer is among the prompt's selected sources, otherwise nothing moves for it. For N = 2
    it is the same as "compatibility"."""
    if choice not in ("compatibility", "random"):
        raise ValueError(f"unknown source choice {choice!r}; use compatibility or random")
    n_models = len(kn)
    chosen: list[dict[K, list[int]]] = [dict() for _ in range(n_models)]
    for a in range(n_models):
        for b in range(a + 1, n_models):
            c_ab = candidates(kn[b], kn[a]) if can_source is None or can_source[a] else []  # a -> b
            c_ba = candidates(kn[a], kn[b]) if can_source is None or can_source[b] else []  # b -> a
            s_ab, s_ba = balanced_pair(c_ab, c_ba, balance)
            for pid in s_ab:
                chosen[b].setdefault(pid, []).append(a)
            for pid in s_ba:
                chosen[a].setdefault(pid, []).append(b)
    out: list[dict[K, int]] = []
    for r, per_prompt in enumerate(chosen):
        mine = {s: v for (s, rr), v in compat.items() if rr == r}
        if choice == "random":
            drawn = {pid: random_peer(key, r, pid, n_models) for pid in per_prompt}
            per_prompt = {pid: [d] for pid, d in drawn.items() if d in per_prompt[pid]}
        best: dict[K, int] = {
            pid: int(best_source([SourceGroup(source=s, k=kn[s][pid][0], order=s) for s in srcs], mine).source)
            for pid, srcs in per_prompt.items()}
        if cap is not None and len(best) > cap:
            ranked = sorted(best.items(), key=lambda kv: (-compat.get((kv[1], r), math.inf), -kn[kv[1]][kv[0]][0]))
            keep = select_with_ties([(pid, kn[s][pid][0]) for pid, s in ranked], cap)
            best = {pid: best[pid] for pid in keep}
        out.append(best)
    return out


# ----- compatibility (Eq. 6-8) -------------------------------------------------------------

@dataclass(frozen=True)
class CompatEstimate:
    """What receivers have learnt about one (source, receiver) pair: the running mean, over
    every group received, of the group's mean s and of its admitted fraction, and how many
    groups were rejected by re-verification. The one estimate every source choice uses.

    A plain running mean rather than an exponential one: it does not depend on the order in
    which reports arrive (a federation receives them late, retried, after restarts, from a
    node's backlog), so a broker's durable table and an in-process co-trainer reach the same
    number from the same reports, and it needs no smoothing constant to tune."""

    groups: int = 0
    mean_s: float = 0.0
    admitted_fraction: float = 0.0
    rejected: int = 0

    def add(self, mean_s: float, admitted_fraction: float, rejected: bool) -> "CompatEstimate":
        """The estimate after one more group report. A rejected group counts only as rejected."""
        return self.add_many(((mean_s, admitted_fraction, rejected),))

    def add_many(self, reports: Iterable[tuple[float, float, bool]]) -> "CompatEstimate":
        """The estimate after each of `reports` (mean_s, admitted_fraction, rejected), in
        order: `add` one at a time, without an estimate per report (a broker folds a
        thousand at once)."""
        g, mean, admitted, rejections = self.groups, self.mean_s, self.admitted_fraction, self.rejected
        for mean_s, admitted_fraction, rejected in reports:
            if rejected:
                rejections += 1
                continue
            g += 1
            mean = mean + (mean_s - mean) / g
            admitted = admitted + (admitted_fraction - admitted) / g
        return CompatEstimate(g, mean, admitted, rejections)

    @property
    def known(self) -> bool:
        """At least one group was received and scored (otherwise the pair is unexplored)."""
        return self.groups > 0


def mean_token_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """lbar(pi, o) = mean over the response's tokens of log pi(token | prefix) (Eq. 6). (B, T) -> (B,)"""
    return (logprobs * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def compatibility(receiver_lbar: torch.Tensor, source_lbar: torch.Tensor) -> torch.Tensor:
    """s(o) = exp(lbar(pi_old^R, o^R) - lbar(pi_old^S, o^S)) (Eq. 7). (B,) -> (B,)"""
    import torch

    return torch.exp(receiver_lbar - source_lbar)


def gate_weights(s: torch.Tensor, delta: float = 0.8, gate: bool = True) -> torch.Tensor:
    """w(o) = 1[s > delta] * min(s, 1) (Eq. 8). gate=False is the "no gate" ablation (w = 1).
    A weight of exactly 0 drops the response from numerator and denominator."""
    import torch

    if not gate:
        return torch.ones_like(s)
    return torch.where(s > delta, torch.clamp(s, max=1.0), torch.zeros_like(s))


# ----- minibatch order (step 13) ------------------------------------------------------------

Order = Literal["peer_last", "peer_first", "shuffled"]


def order_groups(is_peer: Sequence[bool], order: Order, seed: int = 0) -> list[int]:
    """Indices of the step's groups in training order.

    peer_last (the paper): own groups first, peer groups after them (stable), so after the
    split into minibatches every minibatch holding a peer group comes after all purely-own
    ones. peer_first: the reverse (ablation). shuffled: a seeded random order (ablation).
    """
    idx = list(range(len(is_peer)))
    if order == "peer_last":
        return sorted(idx, key=lambda i: is_peer[i])
    if order == "peer_first":
        return sorted(idx, key=lambda i: not is_peer[i])
    if order == "shuffled":
        random.Random(seed).shuffle(idx)
        return idx
    raise ValueError(f"unknown order {order!r}; use peer_last, peer_first or shuffled")


def split_minibatches(n_groups: int, num_minibatches: int) -> list[range]:
    """Consecutive, near-equal minibatches of whole groups (sizes differ by at most one)."""
    base, extra = divmod(n_groups, num_minibatches)
    out, start = [], 0
    for i in range(num_minibatches):
        size = base + (1 if i < extra else 0)
        if size:
            out.append(range(start, start + size))
        start += size
    return out


def peer_last_is_inert(num_minibatches: int, epochs: int) -> bool:
    """With one minibatch and one epoch every ratio is 1 when peer data is used."""
    return num_minibatches * epochs < 2


@dataclass(frozen=True)
class Quantiles:
    p10: float
    p50: float
    p90: float

    @staticmethod
    def of(values: Sequence[float]) -> "Quantiles":
        if not values:
            return Quantiles(math.nan, math.nan, math.nan)
        import torch

        t = torch.tensor(list(values), dtype=torch.float64)
        q = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
        return Quantiles(*q)


# ----- what moves (step 7 and its ablations) -------------------------------------------------

Transfer = Literal["group", "success_only", "pooled"]


@dataclass(frozen=True)
class TransferPlan:
    """Which responses the receiver trains on for one replaced prompt, and their advantages.

    `peer_index[i]` indexes the source group for a peer response, or is None for one of
    the receiver's own responses (pooled mode only); `advantages[i]` is its advantage.
    """

    peer_index: tuple[int | None, ...]
    advantages: tuple[float, ...]


def plan_transfer(source_rewards: Sequence[float], source_advantages: Sequence[float], mode: Transfer = "group",
                  own_rewards: Sequence[float] = (), scale: str = "group", std: str = "sample") -> TransferPlan:
    """group (the paper): the source's whole group with the SOURCE's advantages, computed on
    its full group before any response is dropped. success_only (ablation): only the
    source's successful responses, with their source advantages. pooled (ablation): the
    receiver's own failed responses and the source's responses as one group of n_R + n_S,
    advantages recomputed on the pooled rewards."""
    from graft_fed.core.advantages import group_advantages

    if len(source_rewards) != len(source_advantages):
        raise ValueError("source rewards and advantages differ in length")
    if mode == "group":
        return TransferPlan(tuple(range(len(source_rewards))), tuple(float(a) for a in source_advantages))
    if mode == "success_only":
        keep = [i for i, r in enumerate(source_rewards) if r > 0.5]
        return TransferPlan(tuple(keep), tuple(float(source_advantages[i]) for i in keep))
    if mode == "pooled":
        import torch

        pooled = torch.tensor([list(own_rewards) + list(source_rewards)], dtype=torch.float32)
        adv = group_advantages(pooled, scale=scale, std=std)[0].tolist()  # type: ignore[arg-type]
        index = [None] * len(own_rewards) + list(range(len(source_rewards)))
        return TransferPlan(tuple(index), tuple(adv))
    raise ValueError(f"unknown transfer mode {mode!r}; use group, success_only or pooled")
