"""Groups matched per (source, receiver) (broker/exchange.py): the dense matrix counts what a
Counter of every match would, across match sets that each list their own nodes in their own
order, as nodes join past the matrix's capacity; /metrics reads it, leaving the N^2 pair
series out past `max_pairs_shown` and saying so; the Status RPC and the live page show the
pairs and nodes that exchanged most, and how many there are."""

from __future__ import annotations

import json
import random
import urllib.request
from collections import Counter

import numpy as np

from graft_fed.broker import live
from graft_fed.broker.exchange import Exchange
from graft_fed.cli import main
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.node.client import BrokerClient
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import manifest, summary


def test_the_matrix_counts_what_a_counter_of_every_match_counts():
    rng = random.Random(7)
    everyone = [f"node-{i:03d}" for i in range(70)]  # past the first capacities (16, 32, 64)
    ex, want = Exchange(), Counter()
    for round_ in range(40):
        nodes = rng.sample(everyone[: 10 + round_ * 2], k=min(len(everyone), 6 + round_))
        m = rng.randrange(0, 200)
        src = np.array([rng.randrange(len(nodes)) for _ in range(m)], dtype=np.int32)
        dst = np.array([rng.randrange(len(nodes)) for _ in range(m)], dtype=np.int32)
        ex.add_positions(nodes, src, dst)
        want.update((nodes[s], nodes[d]) for s, d in zip(src.tolist(), dst.tolist()))
        if round_ % 5 == 0:
            pairs = [(rng.choice(everyone), rng.choice(everyone)) for _ in range(rng.randrange(5))]
            ex.add_pairs(pairs)
            want.update(pairs)
    view = ex.view()
    assert view.as_dict() == dict(want)
    assert [key for key, _ in view.items()] == sorted(want)  # by source, then receiver
    assert len(view) == len(want)
    given, received = Counter(), Counter()
    for (s, d), g in want.items():
        given[s] += g
        received[d] += g
    assert view.given() == dict(given) and view.received() == dict(received)
    some = set(rng.sample(everyone, 25))
    assert view.among(some) == {k: g for k, g in want.items() if k[0] in some and k[1] in some}


def test_a_round_added_twice_counts_once():
    # a count built from the state can already hold the round that matching adds as it
    # finishes (the state stores the round's set before matching adds it)
    ex = Exchange()
    nodes, src, dst = ["a", "b", "c"], np.array([0, 1, 2]), np.array([1, 2, 0])
    ex.add_set(7, nodes, src, dst)
    ex.add_set(7, nodes, src, dst)
    ex.add_set(8, nodes, src[:1], dst[:1])
    assert ex.view().as_dict() == {("a", "b"): 2, ("b", "c"): 1, ("c", "a"): 1}


def test_an_empty_exchange_and_a_set_without_matches():
    ex = Exchange()
    ex.add_positions(["a", "b"], np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32))
    ex.add_pairs([])
    view = ex.view()
    assert len(view) == 0 and view.as_dict() == {} and view.given() == {} and view.received() == {}
    ex.add_pairs([("b", "a")])
    view = ex.view()
    assert view.as_dict() == {("b", "a"): 1} and view.names == ["a", "b"]


def _metrics(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _matched_round(prompt_file, **over):
    """a and b complement each other on round 0: one group moves each way."""
    server = start_broker(broker_config(prompt_file, **over))
    prompts = load_prompts(DataConfig(source=str(prompt_file)))
    a, b = BrokerClient(server.address, "a"), BrokerClient(server.address, "b")
    for name, c in (("a", a), ("b", b)):
        c.join(name, "tok", manifest(prompts), "share_all", 0)
    p0, p1 = prompts[0], prompts[1]
    a.publish(0, [summary(p0, 0), summary(p1, 1)])
    b.publish(0, [summary(p0, 1), summary(p1, 0)])
    assert a.get_matches(0, 5.0).ready
    return server, (a, b)


def test_metrics_carry_the_pairs_and_the_totals(prompt_file):
    server, clients = _matched_round(prompt_file)
    try:
        text = _metrics(server)
        assert 'graft_fed_pair_groups_total{source="b",receiver="a"} 1' in text
        assert 'graft_fed_pair_groups_total{source="a",receiver="b"} 1' in text
        assert 'graft_fed_node_groups_received_total{node="a"} 1' in text
        assert 'graft_fed_node_groups_given_total{node="b"} 1' in text
        assert "graft_fed_pairs 2" in text and "graft_fed_pair_series_omitted 0" in text
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_past_max_pairs_shown_metrics_omit_the_pairs_and_status_and_the_page_show_the_most(
        prompt_file, monkeypatch, capsys):
    monkeypatch.setattr(live, "MATRIX_NODES", 1)
    server, (a, b) = _matched_round(prompt_file, max_pairs_shown=1)
    try:
        text = _metrics(server)
        assert "graft_fed_pair_groups_total" not in text
        assert "graft_fed_pairs 2" in text and "graft_fed_pair_series_omitted 1" in text
        assert 'graft_fed_node_groups_received_total{node="b"} 1' in text  # the totals stay
        st = a.status()  # the Status RPC lists the pair with the most groups and says how many there are
        assert [(p.source, p.receiver, p.groups) for p in st.pairs] == [("a", "b", 1)] and st.pairs_total == 2
        assert main(["status", "--broker", server.address]) == 0
        assert "1 of 2 pairs" in capsys.readouterr().out
        assert main(["status", "--broker", server.address, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["pairs_total"] == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/api/status", timeout=10) as r:
            matrix = json.loads(r.read())["matrix"]
        assert matrix["names"] == ["a"] and matrix["nodes_total"] == 2 and matrix["exchange"] == [[None]]
        monkeypatch.setattr(live, "MATRIX_NODES", 2)  # the matrices count from the exchange, not the listed pairs
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/api/status", timeout=10) as r:
            matrix = json.loads(r.read())["matrix"]
        assert matrix["names"] == ["a", "b"] and matrix["exchange"] == [[None, 1.0], [1.0, None]]
    finally:
        a.close()
        b.close()
        server.stop()


def test_status_metrics_and_the_page_show_what_each_node_holds_and_the_undelivered_groups(prompt_file, capsys):
    """An operator sees a node near its quotas before its publishes or uploads are refused,
    and which receivers report groups they never got (those leave the quarantine rate)."""
    from graft_fed.federation.messages import ReportEntry
    from tests.federation.test_broker_rpc import record

    server, (a, b) = _matched_round(prompt_file, max_node_summaries=64, max_node_bundle_mib=2)
    try:
        prompts = load_prompts(DataConfig(source=str(prompt_file)))
        p0, p1 = prompts[0], prompts[1]
        digest, stored = b.upload(record(p0, 1, "b"), 0)  # b's informative group, matched to a
        assert stored
        size = server.fed.state.bundle_bytes_held("b")
        assert size > 0 and server.fed.state.bundle_bytes_held("a") == 0
        a.report(0, [ReportEntry("b", p0.id, 0.0, 0.0, False, undelivered=True)])  # a never got it
        b.report(0, [ReportEntry("a", p1.id, 0.8, 1.0, False)])
        st = a.status()
        held = {n.node_id: (n.summaries_held, n.bundle_bytes_held) for n in st.nodes}
        assert held == {"a": (2, 0), "b": (2, size)}
        assert (st.max_node_summaries, st.max_node_bundle_bytes) == (64, 2 * 2**20)
        pairs = {(p.source, p.receiver): (p.groups, p.reported, p.undelivered, p.rejected) for p in st.pairs}
        assert pairs == {("b", "a"): (1, 1, 1, 0), ("a", "b"): (1, 1, 0, 0)}
        text = _metrics(server)
        for line in ('graft_fed_node_summaries_held{node="a"} 2', f'graft_fed_node_bundle_bytes_held{{node="b"}} {size}',
                     "graft_fed_max_node_summaries 64", f"graft_fed_max_node_bundle_bytes {2 * 2**20}",
                     "graft_fed_undelivered_groups_total 1",
                     'graft_fed_pair_undelivered_total{source="b",receiver="a"} 1',
                     'graft_fed_pair_undelivered_total{source="a",receiver="b"} 0',
                     'graft_fed_pair_reported_total{source="a",receiver="b"} 1',
                     'graft_fed_pair_rejected_total{source="b",receiver="a"} 0'):
            assert line in text.splitlines(), line
        assert main(["status", "--broker", server.address]) == 0
        out = capsys.readouterr().out
        assert "quotas per node: 64 summaries, 2 MiB of bundles" in out
        assert any(line.startswith("a ") and "2 (3.1%)" in line and "0.0 (0.0%)" in line for line in out.splitlines())
        assert any(line.startswith("b -> a") and line.split()[-3:] == ["1", "0", "1"] for line in out.splitlines())
        assert main(["status", "--broker", server.address, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["max_node_summaries"] == 64 and d["nodes"][0]["summaries_held"] == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/api/status", timeout=10) as r:
            page = json.loads(r.read())
        assert page["federation"]["max_node_summaries"] == 64
        assert {n["node_id"]: n["bundle_bytes_held"] for n in page["nodes"]} == {"a": 0, "b": size}
    finally:
        a.close()
        b.close()
        server.stop()


def test_past_max_pairs_shown_metrics_leave_the_reported_pairs_out_and_say_so_after_retention_too(prompt_file):
    """Retention recounts the exchange over the rounds it keeps; the compatibility counts
    are never pruned, so the reported pairs can outnumber the pairs that exchanged: their
    series are left out by their own count, and a gauge of their own says so."""
    from graft_fed.federation.messages import ReportEntry
    from tests.federation.test_broker_rpc import summary

    server, (a, b) = _matched_round(prompt_file, max_pairs_shown=1, keep_rounds=1)
    try:
        p0, p1 = load_prompts(DataConfig(source=str(prompt_file)))[:2]
        a.report(0, [ReportEntry("b", p0.id, 0.0, 0.0, False, undelivered=True)])
        b.report(0, [ReportEntry("a", p1.id, 0.8, 1.0, False)])
        text = _metrics(server).splitlines()
        assert "graft_fed_pairs 2" in text and "graft_fed_pair_series_omitted 1" in text
        assert "graft_fed_reported_pairs 2" in text and "graft_fed_pair_report_series_omitted 1" in text
        for r in range(1, 5):  # nothing to exchange (both solve both prompts); retention then drops round 0
            a.publish(r, [summary(p0, 1, round=r), summary(p1, 1, round=r)])
            b.publish(r, [summary(p0, 1, round=r), summary(p1, 1, round=r)])
            assert a.get_matches(r, 5.0).ready and b.get_matches(r, 5.0).ready
        assert server.fed.prune() > 0
        text = _metrics(server)
        lines = text.splitlines()
        assert "graft_fed_pairs 0" in lines and "graft_fed_pair_series_omitted 0" in lines
        assert "graft_fed_reported_pairs 2" in lines and "graft_fed_pair_report_series_omitted 1" in lines
        assert "graft_fed_pair_undelivered_total{" not in text and "graft_fed_pair_reported_total{" not in text
        assert "graft_fed_undelivered_groups_total 1" in lines  # the total stays
    finally:
        a.close()
        b.close()
        server.stop()


def test_status_of_a_broker_older_than_the_held_and_reported_fields_says_it_does_not_know():
    """An older broker leaves the new fields out: they must not read as 0 (quotas off,
    nothing held, fewer groups reported than rejected)."""
    from graft_fed.cli import _status_dict, _status_table
    from graft_fed.federation.codec import manifest_to_pb
    from graft_fed.proto import broker_pb2 as pb
    from tests.federation.test_broker_rpc import manifest

    prompts = load_prompts(DataConfig(source="embedded:arith-v1"))
    old = pb.StatusResponse(
        manifest=manifest_to_pb(manifest(prompts)), current_round=12, bundles=3, bundle_bytes=3000,
        nodes=[pb.StatusResponse.Node(node_id="a", model_id="m", state="online", round=12, published=416,
                                      last_seen_s=0.5)],
        pairs=[pb.StatusResponse.Pair(source="b", receiver="a", groups=41, mean_s=0.9, admitted_fraction=0.97,
                                      rejected=3)], pairs_total=1)
    d = _status_dict(pb.StatusResponse.FromString(old.SerializeToString()))  # as it comes off the wire
    assert (d["max_node_summaries"], d["max_node_bundle_bytes"]) == (None, None)
    assert (d["nodes"][0]["summaries_held"], d["pairs"][0]["reported"], d["pairs"][0]["undelivered"]) == \
        (None, None, None)
    table = _status_table(d)
    assert "unlimited" not in table and "quotas per node: not shown by this broker" in table
    node, pair = (next(line for line in table.splitlines() if line.startswith(k)) for k in ("a ", "b -> a"))
    assert node.split()[-2:] == ["?", "?"] and pair.split()[-3:] == ["?", "3", "?"]
    # a quota of 0 the broker sent is off, not unknown
    new = pb.StatusResponse(manifest=old.manifest, max_node_summaries=0, max_node_bundle_bytes=5 * 2**20,
                            nodes=[pb.StatusResponse.Node(node_id="a", summaries_held=0, bundle_bytes_held=2**20)])
    table = _status_table(_status_dict(pb.StatusResponse.FromString(new.SerializeToString())))
    assert "quotas per node: summaries unlimited, 5 MiB of bundles" in table
    assert next(line for line in table.splitlines() if line.startswith("a ")).split()[-3:] == ["0", "1.0", "(20.0%)"]
