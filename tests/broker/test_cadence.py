"""The heartbeat cadence grows with the federation (broker/registry.py::Cadence): all nodes
together stay under `max_heartbeats_per_s`, the offline silence grows in proportion, a
shrinking federation keeps the longer silence until every node has heard the shorter
interval, and nodes learn the interval from Join and from every heartbeat answer."""

from __future__ import annotations

import time

import pytest

from graft_fed.broker.handlers import Federation
from graft_fed.broker.registry import MAX_INTERVAL_S, Cadence
from graft_fed.broker.state_memory import InMemoryState
from graft_fed.errors import ConfigError
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.node.client import BrokerClient
from tests.broker.test_wakeups import Clock
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import manifest


def test_the_interval_stays_as_configured_while_the_nodes_stay_under_the_rate():
    c = Cadence(2.0, 15.0, max_per_s=100.0)
    for online in (0, 1, 64, 200):  # 200 nodes every 2 s: exactly 100 a second
        assert c.factor_for(online) == 1.0
    c.update(200)
    assert (c.interval_s, c.offline_after_s) == (2.0, 15.0)


def test_a_thousand_nodes_are_asked_for_a_tenth_of_the_heartbeats_each_and_given_as_many_missed():
    c = Cadence(2.0, 15.0, max_per_s=100.0)
    c.update(1000)
    assert (c.interval_s, c.offline_after_s) == (10.0, 75.0)
    assert 1000 / c.interval_s <= 100.0
    c.update(201)  # just over the rate: the next quarter step, not a jump
    assert c.interval_s == 2.5


def test_a_fixed_cadence_and_the_longest_interval():
    fixed = Cadence(2.0, 15.0, max_per_s=0.0)
    fixed.update(10**6)
    assert (fixed.interval_s, fixed.offline_after_s) == (2.0, 15.0)
    huge = Cadence(2.0, 15.0, max_per_s=1.0)
    huge.update(10**9)  # the interval fits the wire's uint32 milliseconds, and a node still beats
    assert huge.interval_s == MAX_INTERVAL_S and int(huge.interval_s * 1000) < 2**32


def test_a_shrinking_federation_keeps_the_longer_silence_until_nodes_heard_the_shorter_interval():
    clock = Clock()
    c = Cadence(2.0, 15.0, max_per_s=100.0, clock=clock)
    c.update(1000)
    assert c.offline_after_s == 75.0
    c.update(100)  # most nodes left: the interval shrinks at once ...
    assert c.interval_s == 2.0
    assert c.offline_after_s == 75.0  # ... but a node on the 10 s interval is not offline yet
    clock.t += 74.0
    assert c.offline_after_s == 75.0
    clock.t += 2.0
    assert c.offline_after_s == 15.0
    c.update(1000)
    c.update(600)  # shrinking twice within the hold keeps the longest
    c.update(100)
    assert c.offline_after_s == 75.0


def test_liveness_follows_the_cadence(prompt_file):
    clock = Clock()
    cfg = broker_config(prompt_file, heartbeat_interval_s=2.0, offline_after_s=15.0, max_heartbeats_per_s=1.0)
    fed = Federation(cfg, InMemoryState(), clock=clock)
    prompts = load_prompts(DataConfig(source=str(prompt_file)))
    sessions = {name: fed.join(name, name, "tok", manifest(prompts), "share_all", 0)[0] for name in "abcd"}
    fed.registry.online_count(max_age_s=0.0)
    fed.rescale_heartbeats()  # four nodes at one heartbeat a second in all: every 4 s each
    assert fed.heartbeat_interval_s() == 4.0
    clock.t += 20.0  # beyond the configured 15 s, within the scaled 30 s
    fed.heartbeat("a", sessions["a"], 0)
    assert [n.node_id for n in fed.online_nodes()] == ["a", "b", "c", "d"]
    assert fed.node_state(fed.registry.get("b")) == "online"
    clock.t += 11.0  # b, c and d silent for 31 s
    assert [n.node_id for n in fed.online_nodes()] == ["a"]
    assert fed.node_state(fed.registry.get("b")) == "offline"


def test_nodes_learn_the_interval_from_join_and_from_heartbeat_answers(prompt_file):
    # three nodes at 5 heartbeats a second in all, configured every 0.2 s: 15 a second, so
    # each is asked to beat every 0.6 s once the broker has counted them
    broker = start_broker(broker_config(prompt_file, heartbeat_interval_s=0.2, max_heartbeats_per_s=5.0))
    clients = [BrokerClient(broker.address, f"n{i}", rpc_timeout_s=5) for i in range(3)]
    try:
        prompts = load_prompts(DataConfig(source=str(prompt_file)))
        intervals = [c.join(f"m{i}", "tok", manifest(prompts), "share_all", 0)[2] for i, c in enumerate(clients)]
        assert intervals[0] == pytest.approx(0.2)  # alone when it joined
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(c.heartbeat_interval_s != pytest.approx(0.6) for c in clients):
            time.sleep(0.1)
        assert [c.heartbeat_interval_s for c in clients] == [pytest.approx(0.6)] * 3
        late = BrokerClient(broker.address, "n3", rpc_timeout_s=5)
        clients.append(late)
        assert late.join("m3", "tok", manifest(prompts), "share_all", 0)[2] == pytest.approx(0.6)
    finally:
        for c in clients:
            c.close()
        broker.stop(0)


def test_the_rate_is_checked(prompt_file):
    with pytest.raises(ConfigError, match="max_heartbeats_per_s"):
        broker_config(prompt_file, max_heartbeats_per_s=0.5)


def _calls_for(seconds: float, call, until=None, max_s: float = 20.0) -> int:
    """Call `call` every 0.05 s for `seconds`, and on (up to `max_s` in all) until `until()`
    holds; returns how many gaps between calls' ends (from the start on) exceeded 0.45 s: a
    loaded machine's stalls, in which a node rightly heartbeats."""
    start = last = time.monotonic()
    stalls = 0
    while True:
        now = time.monotonic()
        if now - start >= max_s or (now - start >= seconds and (until is None or until())):
            return stalls
        call()
        now = time.monotonic()
        stalls += now - last > 0.45
        last = now
        time.sleep(0.05)


def test_a_node_busy_with_calls_sends_no_heartbeats_and_stays_online(prompt_file):
    # every call the broker marks the node alive for stands in for a heartbeat: a node busy
    # with them for over two offline windows sends (almost) none and is never seen offline;
    # calls that do not mark it (GetStatus) do not stand in; once quiet it heartbeats again.
    # (Without the stand-in it would send 7 heartbeats in the first phase.)
    broker = start_broker(broker_config(prompt_file, heartbeat_interval_s=0.5, offline_after_s=1.5))
    c = BrokerClient(broker.address, "busy", rpc_timeout_s=5)
    try:
        prompts = load_prompts(DataConfig(source=str(prompt_file)))
        c.join("m", "tok", manifest(prompts), "share_all", 0)
        fed = broker.fed
        seen: list[str] = []
        stalls = _calls_for(3.5, lambda: (c.has_bundles(["0" * 64]),
                                          seen.append(fed.node_state(fed.registry.get("busy")))))
        # one heartbeat at most, and one more per call that stalled past the interval
        assert c.heartbeats_sent <= 1 + stalls and c.heartbeats_skipped >= 5, (c.heartbeats_sent, stalls)
        assert set(seen) == {"online"}
        sent = c.heartbeats_sent
        # GetStatus does not mark it alive: the heartbeats did (4 due in 2 s; on until 2 were sent)
        _calls_for(2.0, lambda: (c.status(), seen.append(fed.node_state(fed.registry.get("busy")))),
                   until=lambda: c.heartbeats_sent >= sent + 2)
        assert c.heartbeats_sent >= sent + 2
        assert set(seen) == {"online"}
        sent = c.heartbeats_sent
        deadline = time.monotonic() + 20  # quiet: a heartbeat every interval (3 due in 1.6 s)
        while c.heartbeats_sent < sent + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.heartbeats_sent >= sent + 2
        assert fed.node_state(fed.registry.get("busy")) == "online"
    finally:
        c.close()
        broker.stop(0)
