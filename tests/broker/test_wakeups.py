"""Long-polls wait on an event per round (broker/wakeups.py), not on the broker's lock: what
wakes a round's waiters (the publish that completes it, a node leaving, housekeeping after a
node went offline, the round's bundles), and the per-registry-change caches of answers."""

from __future__ import annotations

import threading

import pytest

from graft_fed.broker.handlers import Federation
from graft_fed.broker.state_memory import InMemoryState
from graft_fed.broker.wakeups import Wakeups
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.federation.codec import OfferEncoder, offers_wire, summaries_from_pb, upload_requests_wire
from tests.federation.helpers import broker_config
from tests.federation.test_broker_rpc import manifest, record, summary
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.proto import broker_pb2 as pb


def test_an_event_taken_before_a_wake_is_set_and_the_next_waiters_get_a_fresh_one():
    w = Wakeups()
    first = w.event("k")
    assert w.event("k") is first and w.keys() == ["k"]
    w.wake("k")
    assert first.is_set()
    assert w.keys() == []
    second = w.event("k")
    assert second is not first and not second.is_set()  # a woken waiter that waits again does not spin
    w.wake("other")  # nobody waits on it: nothing happens
    assert not second.is_set()


def test_a_wake_runs_its_callbacks_once_when_set_and_at_once_when_already_set():
    from graft_fed.broker.wakeups import Wake

    wake, ran = Wake(), []
    wake.when_set(lambda: ran.append("a"))
    dropped = lambda: ran.append("dropped")  # noqa: E731 - a waiter that gave up first
    wake.when_set(dropped)
    wake.forget(dropped)
    assert ran == [] and not wake.wait(0.01)
    wake.set()
    assert ran == ["a"] and wake.is_set() and wake.wait(0)
    wake.set()  # a second wake-up runs nothing twice
    wake.when_set(lambda: ran.append("late"))  # came after: runs at once
    assert ran == ["a", "late"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def three(prompt_file):
    clock = Clock()
    fed = Federation(broker_config(prompt_file), InMemoryState(), clock=clock)
    prompts = load_prompts(DataConfig(source=str(prompt_file)))
    sessions = {name: fed.join(name, name, "tok", manifest(prompts), "share_all", 0)[0] for name in "abc"}
    return fed, clock, prompts, sessions


def _publish(fed, sessions, prompts, name, ks):
    req = pb.PublishRequest(node_id=name, session_id=sessions[name], round=0,
                            summaries=[summary(p, k) for p, k in zip(prompts, ks)])
    return fed.publish(name, sessions[name], 0, summaries_from_pb(req))


def test_the_publish_that_completes_a_round_wakes_its_waiters_and_the_others_do_not(three):
    fed, _, prompts, sessions = three
    waiting = fed.wakeups.event(("round", 0))  # taken as a waiting GetMatches takes it
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    assert not waiting.is_set()  # c has not published: not ready
    _publish(fed, sessions, prompts, "c", [1, 1])
    assert waiting.is_set()


def test_a_node_leaving_wakes_the_round_that_waited_for_it(three):
    fed, _, prompts, sessions = three
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    waiting = fed.wakeups.event(("round", 0))
    fed.leave("c", sessions["c"])
    assert waiting.is_set()
    assert fed.get_matches("a", sessions["a"], 0, 0.0).ready


def test_housekeeping_wakes_a_round_whose_last_node_went_offline(three):
    fed, clock, prompts, sessions = three
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    waiting = fed.wakeups.event(("round", 0))
    fed.wake_ready_rounds()
    assert not waiting.is_set()  # c is online and has not published
    clock.t += fed.cfg.offline_after_s + 1  # c falls silent; a and b keep beating
    fed.heartbeat("a", sessions["a"], 0)
    fed.heartbeat("b", sessions["b"], 0)
    fed.rounds.forget_readiness()  # what a quarter second of real time does
    fed.wake_ready_rounds()
    assert waiting.is_set()


def test_a_waiting_get_matches_returns_when_the_last_node_publishes(three):
    fed, _, prompts, sessions = three
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    got = {}
    waiter = threading.Thread(target=lambda: got.update(r=fed.get_matches("a", sessions["a"], 0, 120.0)))
    waiter.start()
    _publish(fed, sessions, prompts, "c", [1, 1])
    waiter.join(timeout=60)  # woken by the publish; without the wake-up it would wait 120 s
    assert not waiter.is_alive() and got["r"].ready
    assert [o.prompt_id for o in got["r"].offers] == [prompts[0].id]  # a failed only p0


def test_a_parked_get_matches_resumes_where_it_waited_and_keeps_its_place_until_it_ends(three):
    """With `park` (the front's link) a wait raises Parked instead of sleeping: for the
    round, then for its bundles; each resume goes on, and the call counts against
    max_long_polls until it answers or is released."""
    from graft_fed.broker.wakeups import Parked

    fed, _, prompts, sessions = three
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    with pytest.raises(Parked) as parked:
        fed.get_matches("a", sessions["a"], 0, 30.0, wait_for_bundles=True, park=True)
    assert 0 < parked.value.timeout_s <= 30 and fed.answers.long_polls() == 1
    with pytest.raises(Parked) as again:  # not woken: it parks again on the same wake-up
        parked.value.resume()
    assert again.value.wake is parked.value.wake and fed.answers.long_polls() == 1
    _publish(fed, sessions, prompts, "c", [1, 1])
    assert again.value.wake.is_set()
    with pytest.raises(Parked) as bundles:  # matched; now b's bundle for p0 is awaited
        again.value.resume()
    assert bundles.value.wake is not again.value.wake and fed.answers.long_polls() == 1
    data = encode_bundle(record(prompts[0], 1, model="b"))
    fed.put_bundle("b", sessions["b"], prompts[0].id, 0, digest_of(data), data)
    assert bundles.value.wake.is_set()
    answer = bundles.value.resume()
    assert answer.ready and [o.prompt_id for o in answer.offers] == [prompts[0].id]
    assert fed.answers.long_polls() == 0
    # one released (its client went) gives its place back without an answer
    with pytest.raises(Parked) as dropped:  # b failed p1: it waits for a's bundle, never uploaded
        fed.get_matches("b", sessions["b"], 0, 30.0, wait_for_bundles=True, park=True)
    assert fed.answers.long_polls() == 1
    dropped.value.release()
    assert fed.answers.long_polls() == 0


def test_an_upload_wakes_the_receivers_waiting_for_the_rounds_bundles(three):
    fed, _, prompts, sessions = three
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    _publish(fed, sessions, prompts, "c", [0, 0])
    assert fed.get_matches("a", sessions["a"], 0, 0.0).ready
    waiting = fed.wakeups.event(("bundles", 0))
    data = encode_bundle(record(prompts[0], 1, model="b"))
    digest = digest_of(data)
    fed.put_bundle("b", sessions["b"], prompts[0].id, 0, digest, data)
    assert waiting.is_set()


def test_an_answer_names_the_model_a_source_joined_with_last(three):
    """The sources' models are cached per change of the registry: a rejoin with another
    model must show in the next answer."""
    fed, _, prompts, sessions = three
    _publish(fed, sessions, prompts, "a", [0, 1])
    _publish(fed, sessions, prompts, "b", [1, 0])
    _publish(fed, sessions, prompts, "c", [0, 0])
    before = fed.get_matches("a", sessions["a"], 0, 0.0)
    assert [(o.source_node, o.source_model) for o in before.offers] == [("b", "b")]
    sessions["b"] = fed.join("b", "b-v2", "tok", manifest(prompts), "share_all", 0)[0]
    after = fed.get_matches("a", sessions["a"], 0, 0.0)
    assert [(o.source_node, o.source_model) for o in after.offers] == [("b", "b-v2")]


def test_the_per_round_caches_keep_a_window_of_rounds_however_many_are_matched(three):
    """Each cache of matched rounds holds at most the index's window of rounds (issue 13:
    the sources' models were kept for 64 rounds, each entry holding its round's match set)."""
    fed, clock, prompts, sessions = three
    encode = (OfferEncoder, upload_requests_wire, offers_wire)
    rounds = fed.index.keep + 20
    for r in range(rounds):
        for name, ks in zip("abc", ([0] * 8, [1] * 8, [2] * 8)):
            req = pb.PublishRequest(node_id=name, session_id=sessions[name], round=r,
                                    summaries=[summary(p, k, round=r) for p, k in zip(prompts, ks)])
            fed.publish(name, sessions[name], r, summaries_from_pb(req))
        for name in "abc":
            assert fed.get_matches(name, sessions[name], r, 0.0, encode=encode).ready
        clock.t += 1.0
    assert fed.counters["rounds_matched"] == rounds
    assert len(fed.answers._models) <= fed.index.keep and max(fed.answers._models) == rounds - 1
    assert len(fed.matcher._sets) <= fed.index.keep
    assert len(fed.index._books) <= fed.index.keep
    assert len(fed.answers._answers) <= 4 * 64  # (round, receiver) entries: bounded by count


def test_the_call_that_matches_a_round_encodes_every_receivers_answer_and_each_is_what_it_would_encode(three):
    """The GetMatches that matches a round encodes every receiver's offers into the answer
    cache in one go (the answers then only read them); each cached answer is the same bytes
    as the receiver's offers encoded afresh, and what each receiver is answered."""
    fed, _, prompts, sessions = three
    encode = (OfferEncoder, upload_requests_wire, offers_wire)
    n = len(prompts)
    for name, ks in (("a", [i % 2 for i in range(n)]), ("b", [(i + 1) % 2 for i in range(n)]),
                     ("c", [i // 2 % 2 for i in range(n)])):
        _publish(fed, sessions, prompts, name, ks)
    assert fed.get_matches("c", sessions["c"], 0, 0.0, encode=encode).ready  # matches the round
    ms = fed.matcher.match_set(0)
    assert {key for key in fed.answers._answers if key[0] == 0} == {(0, name) for name in ms.nodes}
    warm = {name: fed.answers._answers[(0, name)] for name in ms.nodes}
    assert all(warm[name][2] for name in "abc")  # each failed prompts another solved: offered some
    fed.answers._answers.clear()
    for name in ms.nodes:
        fresh = fed.answers._set_answer(ms, name, OfferEncoder)
        assert fresh == warm[name], name
        assert fed.get_matches(name, sessions[name], 0, 0.0, encode=encode).offers_wire == fresh[2], name


def test_a_match_set_stored_before_the_rounds_row_wins_and_the_round_reads_as_matched(three):
    """A broker that crashed after storing a round's match set and before its round row (as
    brokers before 7e98030 could, writing them in two transactions) left a set behind; the next
    match of that round answers with it rather than matching again."""
    import numpy as np

    from graft_fed.broker.matchset import MatchSet
    fed, _, prompts, sessions = three
    for name, ks in (("a", [0, 2]), ("b", [1, 0]), ("c", [1, 1])):
        _publish(fed, sessions, prompts, name, ks)
    # the set an earlier broker stored: a takes prompt 0 from c, b nothing (matching now would give b prompt 1 from c)
    pids = [prompts[0].id, prompts[1].id]
    k = np.array([[0, 2], [1, 0], [1, 1]], dtype=np.int16)
    stored = MatchSet.from_choice(0, ["a", "b", "c"], pids, k,
                                  [(np.array([0]), np.array([2])), (np.array([], dtype=np.int64), np.array([], dtype=np.int64)),
                                   (np.array([], dtype=np.int64), np.array([], dtype=np.int64))])
    assert fed.state.put_match_set(0, stored.to_bytes())
    res = fed.get_matches("a", sessions["a"], 0, 1.0)
    assert res.ready and [(o.prompt_id, o.source_node) for o in res.offers] == [(prompts[0].id, "c")]
    assert fed.state.get_round(0).state == "matched" and fed.state.get_round(0).participants == ["a", "b", "c"]
    assert fed.get_matches("b", sessions["b"], 0, 0.0).offers == []


def test_a_match_set_stored_under_another_rounds_number_is_refused(three, caplog):
    """A damaged row whose set says it is another round's is refused, and is not remembered
    under that other round (whose answers it would replace): the log says what was wrong,
    the caller is told the storage failed (UNAVAILABLE, retried) and not an INTERNAL."""
    import numpy as np

    from graft_fed.broker.matchset import MatchSet, MatchSetError
    from graft_fed.federation.errors import Unavailable
    fed, _, prompts, sessions = three
    k = np.array([[0, 2], [1, 0], [1, 1]], dtype=np.int16)
    other = MatchSet.from_choice(5, ["a", "b", "c"], [prompts[0].id, prompts[1].id], k,
                                 [(np.array([0]), np.array([2]))] + [(np.array([], dtype=np.int64),) * 2] * 2)
    assert fed.state.put_match_set(0, other.to_bytes())
    with caplog.at_level("ERROR", logger="graft_fed.broker"), \
            pytest.raises(Unavailable, match="storage failed reading round 0's matches: retry later") as got:
        fed.matcher.match_set(0)
    assert isinstance(got.value.__cause__, MatchSetError)
    assert "stored for round 0 is damaged" in caplog.text and "says it is round 5's" in caplog.text
    assert fed.state.match_set(5) is None and fed.matcher.match_set(5) is None
    # a node asking for its matches gets the same answer; nothing was cached meanwhile
    for name, ks in (("a", [0, 2]), ("b", [1, 0]), ("c", [1, 1])):
        _publish(fed, sessions, prompts, name, ks)
    with pytest.raises(Unavailable, match="round 0's matches"):
        fed.get_matches("a", sessions["a"], 0, 0.0)


def test_a_stored_match_set_that_does_not_decode_is_unavailable_not_internal(three):
    from graft_fed.federation.errors import Unavailable
    fed, _, prompts, sessions = three
    for name, ks in (("a", [0, 2]), ("b", [1, 0]), ("c", [1, 1])):
        _publish(fed, sessions, prompts, name, ks)
    assert fed.state.put_match_set(0, b"GFM2 not a match set")  # a broker before this one stored it
    with pytest.raises(Unavailable, match="storage failed reading round 0's matches"):
        fed.get_matches("b", sessions["b"], 0, 0.0)


def test_a_node_that_joins_during_a_round_is_waited_for_at_once(prompt_file):
    # readiness lists the nodes near a round for a quarter second (rounds.py::_waiting); a
    # join drops that list, so the publish right after it does not close the round without
    # the newcomer
    fed = Federation(broker_config(prompt_file), InMemoryState(), clock=Clock())
    prompts = load_prompts(DataConfig(source=str(prompt_file)))
    sessions = {name: fed.join(name, name, "tok", manifest(prompts), "share_all", 0)[0] for name in "ab"}
    _publish(fed, sessions, prompts, "a", [0, 1])
    assert not fed.rounds.ready(0)  # b has not published
    sessions["d"] = fed.join("d", "d", "tok", manifest(prompts), "share_all", 0)[0]
    _publish(fed, sessions, prompts, "b", [1, 0])
    assert not fed.rounds.ready(0)  # d, at round 0 and online, has not published
    _publish(fed, sessions, prompts, "d", [1, 1])
    assert fed.rounds.ready(0)
