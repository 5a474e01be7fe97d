import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_fed.core.advantages import group_advantages
from graft_fed.core.exchange import (balanced_pair, candidates, classify, compatibility, gate_weights,
                                     mean_token_logprob, order_groups, plan_transfer, select_with_ties,
                                     split_minibatches)


def test_classify_on_binary_outcome():
    assert classify(0, 8) == "all_fail" and classify(3, 8) == "informative" and classify(8, 8) == "all_pass"
    with pytest.raises(ValueError):
        classify(9, 8)


def test_candidates_follow_eq4():
    recv = {"a": (0, 8), "b": (0, 8), "c": (2, 8), "d": (0, 8)}
    src = {"a": (3, 8), "b": (8, 8), "c": (1, 8), "d": (0, 8)}
    assert candidates(recv, src) == [("a", 3)]


def test_select_with_ties_keeps_ties_with_the_mth():
    cands = [("p1", 2), ("p2", 5), ("p3", 2), ("p4", 7), ("p5", 1)]
    assert select_with_ties(cands, 2) == ["p4", "p2"]
    assert select_with_ties(cands, 3) == ["p4", "p2", "p1", "p3"]  # p3 ties with the 3rd
    assert select_with_ties(cands, 0) == []
    assert select_with_ties(cands, 10) == ["p4", "p2", "p1", "p3", "p5"]


def test_balanced_pair_m_zero_means_no_exchange():
    assert balanced_pair([("a", 3)], []) == ([], [])
    assert balanced_pair([("a", 3), ("b", 1)], [("c", 4)]) == (["a"], ["c"])
    assert balanced_pair([("a", 3), ("b", 1)], [("c", 4)], balance=False) == (["a", "b"], ["c"])


group_st = st.dictionaries(st.integers(0, 30), st.integers(0, 8), min_size=0, max_size=20)


@settings(max_examples=150, deadline=None)
@given(group_st, group_st)
def test_selection_properties(ka, kb):
    n = 8
    a = {p: (k, n) for p, k in ka.items()}
    b = {p: (k, n) for p, k in kb.items()}
    c_ab, c_ba = candidates(b, a), candidates(a, b)  # A -> B: receiver B
    s_ab, s_ba = balanced_pair(c_ab, c_ba)
    m = min(len(c_ab), len(c_ba))
    # a receiver never gets a group for a prompt it did not fail entirely, from an informative source
    assert all(b[p][0] == 0 and 1 <= a[p][0] < n for p in s_ab)
    assert all(a[p][0] == 0 and 1 <= b[p][0] < n for p in s_ba)
    if m == 0:
        assert s_ab == [] and s_ba == []
    for sel, cands in ((s_ab, c_ab), (s_ba, c_ba)):
        if m:
            assert len(sel) >= m
            kth = sorted((k for _, k in cands), reverse=True)[m - 1]
            # everything strictly better than the m-th is in, everything worse is out, ties are in
            assert {p for p, k in cands if k >= kth} == set(sel)


def test_compatibility_and_gate():
    s = compatibility(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -1.0]))
    torch.testing.assert_close(s, torch.tensor([1.0, math.exp(-1.0), math.exp(0.5)]))
    w = gate_weights(torch.tensor([0.8, 0.81, 1.0, 1.7, 0.2]), delta=0.8)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.81, 1.0, 1.0, 0.0]))  # s <= delta dropped, min(s, 1)
    assert torch.equal(gate_weights(torch.tensor([0.1, 3.0]), gate=False), torch.ones(2))
    assert torch.equal(gate_weights(torch.tensor([0.01, 0.5]), delta=0.0), torch.tensor([0.01, 0.5]))


def test_mean_not_sum():
    lp = torch.tensor([[-1.0, -3.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(mean_token_logprob(lp, mask), torch.tensor([-2.0, -2.0]))


def test_orders_and_minibatches():
    peer = [False, True, False, True, False]
    assert order_groups(peer, "peer_last") == [0, 2, 4, 1, 3]
    assert order_groups(peer, "peer_first") == [1, 3, 0, 2, 4]
    assert sorted(order_groups(peer, "shuffled", seed=3)) == list(range(5))
    assert [list(r) for r in split_minibatches(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_minibatches(2, 4)] == [[0], [1]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(1, 8))
def test_peer_last_puts_every_peer_minibatch_after_all_own_ones(peer, nmb):
    order = order_groups(peer, "peer_last")
    mbs = [[order[i] for i in r] for r in split_minibatches(len(peer), nmb)]
    has_peer = [any(peer[g] for g in mb) for mb in mbs]
    first_peer = has_peer.index(True) if True in has_peer else len(mbs)
    assert not any(has_peer[:first_peer]) and all(has_peer[first_peer:])


def test_transfer_plans():
    rewards = [1.0, 0.0, 0.0, 1.0]
    adv = group_advantages(torch.tensor([rewards]))[0].tolist()
    whole = plan_transfer(rewards, adv, "group")
    assert whole.peer_index == (0, 1, 2, 3) and whole.advantages == tuple(adv)
    succ = plan_transfer(rewards, adv, "success_only")
    assert succ.peer_index == (0, 3) and succ.advantages == (adv[0], adv[3])
    pooled = plan_transfer(rewards, adv, "pooled", own_rewards=[0.0] * 4)
    assert pooled.peer_index == (None,) * 4 + (0, 1, 2, 3)
    expected = group_advantages(torch.tensor([[0.0] * 4 + rewards]))[0].tolist()
    assert list(pooled.advantages) == pytest.approx(expected)


# ----- one source-selection rule, one compatibility estimate ----------------------------------

from graft_fed.core.exchange import (CompatEstimate, SourceGroup, best_source, complementarity,  # noqa: E402
                                     select_for_receiver, select_sources)


def test_source_rank_compatibility_then_k_then_freshness_then_first():
    a, b, c = SourceGroup("a", k=3, round=1, order=0), SourceGroup("b", k=1, round=2, order=1), \
        SourceGroup("c", k=1, round=3, order=2)
    assert best_source([a, b], {"a": 0.9, "b": 0.95}).source == "b"  # most compatible, despite a's k
    assert best_source([a, b], {"a": 0.9}).source == "b"  # b untried: explored first (+inf)
    assert best_source([a, b], {}).source == "a"  # both untried: the higher k
    assert best_source([b, c], {}).source == "c"  # equal k: the fresher group
    assert best_source([SourceGroup("x", 1, order=0), SourceGroup("y", 1, order=1)], {}).source == "x"


def test_one_direction_selection_takes_every_all_fail_prompt_with_an_informative_group():
    receiver = {"p0": (0, 4), "p1": (0, 4), "p2": (2, 4), "p3": (0, 4)}
    offers = {"p0": [(SourceGroup("a", 4), 4), (SourceGroup("b", 1), 4)],  # a's group is all-pass
              "p1": [(SourceGroup("a", 0), 4)],  # all-fail too: nothing to learn
              "p2": [(SourceGroup("a", 2), 4)],  # the receiver did not fail p2
              "p3": [(SourceGroup("a", 2), 4), (SourceGroup("b", 3), 4)]}
    got = select_for_receiver(receiver, offers, {"a": 0.99, "b": 0.5})
    assert {pid: g.source for pid, g in got.items()} == {"p0": "b", "p3": "a"}


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from([f"p{i}" for i in range(6)]), st.integers(0, 4), min_size=6, max_size=6),
       st.dictionaries(st.sampled_from([f"p{i}" for i in range(6)]), st.integers(0, 4), min_size=6, max_size=6))
def test_two_models_one_direction_selection_agrees_with_the_unbalanced_pair_rule(ka, kb):
    kn = [{p: (k, 4) for p, k in ka.items()}, {p: (k, 4) for p, k in kb.items()}]
    synchronous = select_sources(kn, False, {})[0]
    one_way = select_for_receiver(kn[0], {p: [(SourceGroup(1, k, order=1), n)] for p, (k, n) in kn[1].items()}, {})
    assert synchronous == {p: g.source for p, g in one_way.items()}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.floats(0, 1), st.booleans()), min_size=1, max_size=20),
       st.randoms(use_true_random=False))
def test_the_compatibility_estimate_does_not_depend_on_report_order(reports, rnd):
    def fold(rs):
        est = CompatEstimate()
        for r in rs:
            est = est.add(*r)
        return est

    shuffled = list(reports)
    rnd.shuffle(shuffled)
    a, b = fold(reports), fold(shuffled)
    assert (a.groups, a.rejected) == (b.groups, b.rejected) == (sum(not r[2] for r in reports),
                                                                sum(r[2] for r in reports))
    assert a.mean_s == pytest.approx(b.mean_s, abs=1e-9) and a.known == (a.groups > 0)
    kept = [r[0] for r in reports if not r[2]]
    assert a.mean_s == pytest.approx(sum(kept) / len(kept) if kept else 0.0, abs=1e-9)


def test_complementarity_counts_the_receivers_all_fail_prompts_peers_can_fill():
    receiver = {"p0": (0, 4), "p1": (0, 4), "p2": (0, 4), "p3": (1, 4)}
    peers = [("p0", 2, 4), ("p0", 4, 4), ("p1", 4, 4), ("p3", 2, 4), ("p9", 2, 4)]
    assert complementarity(receiver, peers) == (1, 2)  # p0 informative; p0 and p1 solved


# ----- the random-peer ablation (graft.source_choice: random; issue 15) ----------------------

def test_random_source_choice_is_a_pure_keyed_draw_that_moves_only_what_the_drawn_peer_has():
    from graft_fed.core.exchange import random_peer, select_sources

    # receiver 0 fails 200 prompts; peer 1 is informative on all, peer 2 on none
    kn = [{f"p{i}": (0, 8) for i in range(200)}, {f"p{i}": (3, 8) for i in range(200)},
          {f"p{i}": (0, 8) for i in range(200)}]
    best = select_sources(kn, False, {}, choice="compatibility")
    assert len(best[0]) == 200 and set(best[0].values()) == {1}
    rand = select_sources(kn, False, {}, choice="random", key="7|3")
    assert rand == select_sources(kn, False, {}, choice="random", key="7|3")  # pure: same key, same draw
    assert rand != select_sources(kn, False, {}, choice="random", key="7|4")
    # a prompt moves only when the drawn peer is the one with a group: about half of them
    assert set(rand[0].values()) == {1} and 70 < len(rand[0]) < 130
    assert set(rand[0]) == {f"p{i}" for i in range(200) if random_peer("7|3", 0, f"p{i}", 3) == 1}


def test_random_source_choice_with_two_models_is_the_paper_s_rule():
    from graft_fed.core.exchange import select_sources

    kn = [{"a": (0, 8), "b": (2, 8)}, {"a": (5, 8), "b": (0, 8)}]
    assert select_sources(kn, True, {}, choice="random", key=1) == select_sources(kn, True, {})


def test_an_unknown_source_choice_is_refused():
    import pytest

    from graft_fed.core.exchange import select_sources

    with pytest.raises(ValueError, match="unknown source choice"):
        select_sources([{}, {}], True, {}, choice="nearest")
