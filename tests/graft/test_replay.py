"""The replay-buffer baseline (graft/replay.py): the model's own earlier informative group for
the same prompt, from its own trajectory store, for its all-fail prompts only."""

from types import SimpleNamespace

from graft_fed.core.records import GroupRecord
from graft_fed.graft.replay import replay_offers
from graft_fed.store import TrajectoryStore


def _rec(pid, step, rewards, run_id="me-seed0"):
    n = len(rewards)
    mean = sum(rewards) / n
    sd = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5
    adv = tuple((r - mean) / (sd + 1e-6) for r in rewards)
    return GroupRecord(prompt_id=pid, step=step, model_id="me", tokenizer_id="tok", problem="q", answer="1",
                       rewards=tuple(float(r) for r in rewards), advantages=adv, texts=("x",) * n,
                       finish_reasons=("stop",) * n, lengths=(1,) * n, mean_logprobs=(-0.5,) * n, run_id=run_id)


def _group(pid, k):
    return SimpleNamespace(prompt=SimpleNamespace(id=pid), k=k, n=4)


def test_replay_offers_the_latest_earlier_informative_group_for_all_fail_prompts_only(tmp_path):
    with TrajectoryStore(tmp_path / "t.sqlite") as store:
        store.record([_rec("a", 0, [1, 0, 0, 0]), _rec("b", 0, [1, 1, 1, 1]), _rec("c", 0, [0, 0, 0, 0])])
        store.record([_rec("a", 1, [1, 1, 0, 0]), _rec("d", 1, [1, 0, 0, 0])])
        store.record([_rec("a", 2, [0, 0, 0, 0]), _rec("e", 2, [1, 0, 0, 0])])  # this step's own groups
        store.record([_rec("f", 1, [1, 0, 0, 0], run_id="someone-else")])
        groups = [_group("a", 0), _group("b", 0), _group("c", 0), _group("d", 2), _group("e", 0), _group("f", 0)]
        offers = replay_offers(store, "me-seed0", 2, groups)
    # a: the step-1 group (latest before this step), not this step's own all-fail one;
    # b: all-pass earlier, c: all-fail earlier -> nothing; d: not all-fail now; e: only this
    # step's group exists; f: another run's group is never replayed.
    assert set(offers.records) == {"a"}
    assert offers.records["a"].step == 1 and offers.records["a"].k == 2
    assert offers.metrics["graft/all_fail"] == 5.0 and offers.metrics["graft/selected"] == 1.0


def test_replay_offers_nothing_at_the_first_step(tmp_path):
    with TrajectoryStore(tmp_path / "t.sqlite") as store:
        store.record([_rec("a", 0, [1, 0, 0, 0])])
        assert replay_offers(store, "me-seed0", 0, [_group("a", 0)]).records == {}
