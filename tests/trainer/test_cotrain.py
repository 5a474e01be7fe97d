import math

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_fed.core.exchange import balanced_pair, candidates
from graft_fed.core.exchange import select_sources
from graft_fed.graft.cotrain import CoTrainer, load_cotrain_config

ks = st.dictionaries(st.sampled_from([f"p{i}" for i in range(16)]), st.integers(0, 4), min_size=16, max_size=16)


@settings(max_examples=100, deadline=None)
@given(ks, ks, st.booleans())
def test_two_models_select_exactly_the_papers_rule(ka, kb, balance):
    kn = [{p: (k, 4) for p, k in ka.items()}, {p: (k, 4) for p, k in kb.items()}]
    s_ab, s_ba = balanced_pair(candidates(kn[1], kn[0]), candidates(kn[0], kn[1]), balance)
    got = select_sources(kn, balance, {})
    assert got[1] == {p: 0 for p in s_ab} and got[0] == {p: 1 for p in s_ba}


@settings(max_examples=100, deadline=None)
@given(ks, ks, ks)
def test_n_models_one_valid_source_per_prompt(ka, kb, kc):
    kn = [{p: (k, 4) for p, k in d.items()} for d in (ka, kb, kc)]
    for r, chosen in enumerate(select_sources(kn, True, {})):
        for pid, s in chosen.items():
            assert s != r and kn[r][pid][0] == 0 and 1 <= kn[s][pid][0] < 4


def test_untried_pairs_are_explored_before_known_ones():
    kn = [{"p": (0, 4)}, {"p": (3, 4)}, {"p": (1, 4)}]
    # receiver 0: source 1 has the higher k but a known low compatibility; source 2 is untried
    assert select_sources(kn, False, {(1, 0): 0.5})[0] == {"p": 2}
    assert select_sources(kn, False, {(1, 0): 0.9, (2, 0): 0.5})[0] == {"p": 1}


def test_cotrain_two_heterogeneous_models_end_to_end(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    cfg = {
        "run": {"output_dir": str(tmp_path / "co"), "steps": 2, "seed": 3, "device": "cpu", "threads": 1,
                "checkpoint_every": 0},
        "data": {"source": str(prompt_file)},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "verifier": {"name": "tests.plugins:odd_char_sum"},
        "algorithm": {"prompts_per_step": 8, "num_minibatches": 2},
        "optim": {"lr": 1e-3},
        "members": [{"name": "llama", "model": {"path": str(tiny_llama)}},
                    {"name": "gpt2", "model": {"path": str(tiny_gpt2)}, "optim": {"lr": 1e-4}}],
    }
    path = tmp_path / "co.yaml"
    path.write_text(yaml.safe_dump(cfg))
    conf = load_cotrain_config(path)
    assert conf.member_config(1).optim.lr == 1e-4 and conf.member_config(0).optim.lr == 1e-3
    with CoTrainer(conf, quiet=True) as co:
        summaries = co.train(evaluate_before_after=False)
    assert len(summaries) == 2
    replaced = 0
    for name in ("llama", "gpt2"):
        rows = [__import__("json").loads(x) for x in (tmp_path / "co" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["graft/selected"] <= r["graft/candidates"] <= r["graft/all_fail"]
            replaced += r.get("graft/replaced", 0)
            assert math.isnan(r["clip_ratio/peer"] or math.nan) or 0 <= r["clip_ratio/peer"] <= 1
    assert (tmp_path / "co" / "llama" / "trajectories.sqlite").exists()


def test_per_receiver_cap_keeps_the_best_ranked_with_ties():
    kn = [{f"p{i}": (0, 4) for i in range(5)}, {"p0": (3, 4), "p1": (1, 4), "p2": (2, 4), "p3": (2, 4), "p4": (1, 4)}]
    got = select_sources(kn, False, {}, cap=2)
    assert got[0] == {"p0": 1, "p2": 1, "p3": 1}  # k 3, then the tie at k 2 with the cap's last
    assert select_sources(kn, False, {}, cap=10)[0] == {f"p{i}": 1 for i in range(5)}


def test_members_sample_with_seeds_of_their_own_and_share_the_prompt_schedule(tmp_path):
    from graft_fed.trainer.config import member_seed

    cfg = {"run": {"output_dir": str(tmp_path / "co"), "seed": 3},
           "members": [{"name": "llama"}, {"name": "gpt2"}, {"name": "qwen3", "seed": 11}]}
    path = tmp_path / "co.yaml"
    path.write_text(yaml.safe_dump(cfg))
    conf = load_cotrain_config(path)
    runs = [conf.member_config(i).run for i in range(3)]
    assert [r.seed for r in runs] == [member_seed(3, "llama"), member_seed(3, "gpt2"), 11]
    assert len({r.seed for r in runs}) == 3
    assert {r.prompt_schedule_seed for r in runs} == {3}
    assert member_seed(3, "llama") == member_seed(3, "llama") != member_seed(4, "llama")


def test_a_member_that_does_not_share_only_receives():
    """members[i].shares: false (as a node with privacy summaries_only): nobody is offered its
    groups, and it still receives from the others."""
    from types import SimpleNamespace

    from graft_fed.graft.cotrain import CoTrainingPeers

    def learner(name):
        return SimpleNamespace(model_id=name, step=0, cfg=SimpleNamespace(run=SimpleNamespace(prompt_schedule_seed=0)))

    def groups(ks):
        return [SimpleNamespace(prompt=SimpleNamespace(id=p), k=k, n=4) for p, k in ks.items()]

    ks = {"a": {"p": 0, "q": 2}, "b": {"p": 3, "q": 0}, "c": {"p": 2, "q": 0}}
    for shares, expect in (([True, True, True], [{"p": 1}, {"q": 0}, {"q": 0}]),
                           ([True, False, True], [{"p": 2}, {"q": 0}, {"q": 0}]),
                           ([False, True, True], [{"p": 1}, {}, {}])):
        members = [learner(n) for n in ks]
        peers = CoTrainingPeers(members, balance=False, shares=shares)
        for m, name in zip(members, ks):
            peers.publish(m, SimpleNamespace(groups=groups(ks[name])))
        assert peers._select() == expect, shares
