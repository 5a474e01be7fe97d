"""A slow node in a synchronous federation: the round deadline passes without it, the
others are matched among themselves, and when it publishes late it is matched on its own
against the stored groups of that round (the paper's stored mode, served by the broker)."""

import time

import pytest

from graft_fed.data.config import DataConfig, load_prompts
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, summary

DEADLINE_S = 4.0  # well beyond two publishes and a 0.3 s wait on a loaded machine


@pytest.fixture()
def prompts(prompt_file):
    return load_prompts(DataConfig(source=str(prompt_file)))


def test_round_deadline_passes_without_a_slow_node_which_is_matched_late(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, round_deadline_s=DEADLINE_S))
    a, b, c = (client(broker, prompts, name) for name in ("a", "b", "c"))  # c is online (heartbeats) but slow
    try:
        p0, p1 = prompts[0], prompts[1]
        t0 = time.monotonic()
        assert a.publish(0, [summary(p0, 1), summary(p1, 0)]) == (2, 0)
        assert b.publish(0, [summary(p0, 0), summary(p1, 1)]) == (2, 0)
        early = a.get_matches(0, 0.3)
        assert not early.ready  # c is online and near this round: the round waits for it ...
        res_a = a.get_matches(0, 10.0)
        waited = time.monotonic() - t0
        assert res_a.ready and waited >= DEADLINE_S  # ... until its deadline, then goes on without it
        res_b = b.get_matches(0, 0.0)
        assert res_b.ready
        rnd = broker.state.get_round(0)
        assert rnd.state == "matched" and rnd.participants == ["a", "b"]
        assert [(o.prompt_id, o.source_node) for o in res_a.offers] == [(p1.id, "b")]
        assert [(o.prompt_id, o.source_node) for o in res_b.offers] == [(p0.id, "a")]

        # c arrives late: answered at once, matched alone against what a and b stored
        assert c.publish(0, [summary(p0, 0), summary(p1, 0), summary(prompts[2], 0)]) == (3, 0)
        res_c = c.get_matches(0, 0.0)
        assert res_c.ready  # no waiting: the round is already matched
        assert sorted((o.prompt_id, o.source_node) for o in res_c.offers) == sorted([(p0.id, "a"), (p1.id, "b")])
        assert res_c.candidates == 2 and res_c.solved_by_peers == 2
        # the late node changed nothing of the round as matched
        assert broker.state.get_round(0).participants == ["a", "b"]
        assert [(o.prompt_id, o.source_node) for o in a.get_matches(0, 0.0).offers] == [(p1.id, "b")]
        # and as a source it can be matched to later rounds like anyone else
        st = {n["node_id"]: n for n in broker.fed.status()["nodes"]}
        assert st["c"]["published"] == 3 and st["c"]["state"] == "online"
    finally:
        for x in (a, b, c):
            x.close()
        broker.stop()


def test_a_node_that_stops_publishing_goes_offline_and_is_not_waited_for(prompt_file, prompts):
    broker = start_broker(broker_config(prompt_file, round_deadline_s=3600.0, offline_after_s=1.0,
                                        heartbeat_interval_s=0.2))
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    try:
        b.close()  # b dies: no Leave, heartbeats stop
        assert a.publish(0, [summary(prompts[0], 1)]) == (1, 0)
        res = a.get_matches(0, 10.0)
        assert res.ready  # matched once b counts as offline (1 s), not at the (hour-long) deadline
        assert broker.state.get_round(0).participants == ["a"]
    finally:
        a.close()
        broker.stop()


def test_upload_requests_are_for_receivers_still_at_their_round(prompt_file, prompts):
    """A source is asked to upload a matched group only while its receiver still works on the
    round it was matched in (a late joiner at an old round included), not for every match in
    the federation's history."""
    broker = start_broker(broker_config(prompt_file))
    a, b = client(broker, prompts, "a", privacy="matched_only"), client(broker, prompts, "b")
    c = None
    try:
        p0, p1 = prompts[0], prompts[1]
        assert a.publish(0, [summary(p0, 1), summary(p1, 0)]) == (2, 0)
        assert b.publish(0, [summary(p0, 0), summary(p1, 1)]) == (2, 0)
        assert a.get_matches(0, 5.0).upload_requests == [(p0.id, 0)]  # b waits for a's group of p0
        assert b.get_matches(0, 0.0).offers[0].prompt_id == p0.id
        assert b.publish(1, [summary(p0, 1, round=1)]) == (1, 0)  # b has moved on
        assert a.get_matches(0, 0.0).upload_requests == []
        c = client(broker, prompts, "c")  # a late joiner replaying round 0 is matched to a's stored group
        assert c.publish(0, [summary(p0, 0)]) == (1, 0)
        assert [(o.prompt_id, o.source_node) for o in c.get_matches(0, 0.0).offers] == [(p0.id, "a")]
        assert a.get_matches(0, 0.0).upload_requests == [(p0.id, 0)]
    finally:
        for x in (a, b, c):
            if x is not None:
                x.close()
        broker.stop()
