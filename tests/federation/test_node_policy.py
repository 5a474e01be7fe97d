"""The node's side of issue 12 as pure policy (graft_fed/federation/policy.py): a refused
fetch skips one offer, undelivered and refused groups are reported, and matched_only
uploads only what the node can see was matched in the current window."""

from graft_fed.federation.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                                         PermissionDenied, ResourceExhausted, Unavailable)
from graft_fed.federation.messages import Offer, ReportEntry
from graft_fed.federation.policy import (fetch_failure_is_per_offer, offers_to_fetch, refused_record_entry,
                                         undelivered_entries, uploads_to_serve)
from tests.federation.helpers import InformativeStore


def offer(pid, source="s", digest="d" * 64):
    return Offer(prompt_id=pid, source_node=source, source_model="m", source_round=3, k=1, n=2, digest=digest)


def test_a_refused_fetch_skips_that_offer_and_a_lost_broker_is_still_lost():
    for exc in (NotFound("x"), PermissionDenied("x"), InvalidArgument("x"), FailedPrecondition("x")):
        assert fetch_failure_is_per_offer(exc)
    for exc in (Unavailable("x"), DeadlineExceeded("x"), ResourceExhausted("x")):
        assert not fetch_failure_is_per_offer(exc)


def test_undelivered_offers_are_reported_as_unusable_not_rejected():
    offers = [offer("p1"), offer("p2", digest=""), offer("p3", source="t"), offer("p4")]
    got = undelivered_entries(offers, received={"p1"}, already_reported={("s", "p4")})
    # marked undelivered: they weigh in the source's compatibility, not in its quarantine rate
    assert got == [ReportEntry("s", "p2", 0.0, 0.0, False, undelivered=True),
                   ReportEntry("t", "p3", 0.0, 0.0, False, undelivered=True)]
    assert refused_record_entry(offer("p5")) == ReportEntry("s", "p5", 0.0, 0.0, True)
    # and so they go on the wire
    from graft_fed.federation.codec import report_entries_from_pb, report_entries_to_pb
    from graft_fed.proto import broker_pb2 as pb

    wire = pb.CompatibilityReport(entries=report_entries_to_pb(got + [refused_record_entry(offer("p5"))]))
    assert list(report_entries_from_pb(pb.CompatibilityReport.FromString(wire.SerializeToString()))) == \
        got + [refused_record_entry(offer("p5"))]


def test_matched_only_uploads_only_informative_groups_of_the_current_window():
    informative = {5: {"a", "b"}, 4: {"c"}, 1: {"old"}}
    requests = [("a", 5), ("z", 5), ("c", 4), ("old", 1), ("a", 6), ("b", 5)]
    ok, refused = uploads_to_serve(requests, current_round=5, window_rounds=0, informative=informative)
    assert ok == [("a", 5), ("b", 5)]
    assert refused == [("z", 5), ("c", 4), ("old", 1), ("a", 6)]
    ok, _ = uploads_to_serve(requests, current_round=5, window_rounds=2, informative=informative)  # async window
    assert ok == [("a", 5), ("c", 4), ("b", 5)]


def test_a_node_fetching_offers_skips_a_refused_one_reports_it_and_keeps_the_rest():
    """node/peers.py::fetch_offers with the policy wired in: NOT_FOUND for one bundle, or bytes
    that did not arrive as the broker hashed them (DeliveryError: too big for this node, cut
    short, another digest), is that offer's problem (counted, reported as undelivered, never
    against the source), a malformed record is the source's (reported as rejected), and a
    lost broker still ends the exchange."""
    import pytest

    from graft_fed.core.records import GroupRecord, RecordError
    from graft_fed.node.client import DeliveryError, FetchedBundle
    from graft_fed.node.peers import fetch_offers

    def rec(pid):
        return GroupRecord(prompt_id=pid, step=0, model_id="m", tokenizer_id="t", problem="q", answer="1",
                           rewards=(1.0, 0.0), advantages=(0.7071, -0.7071), texts=("1", "2"),
                           finish_reasons=("stop", "stop"), lengths=(1, 1), mean_logprobs=(-0.5, -0.5))

    class Client:
        def __init__(self, lost=False):
            self.lost = lost

        def fetch_bundle(self, digest, source=None):
            if self.lost:
                raise Unavailable("broker gone")
            if digest == "a" * 64:
                raise NotFound("no bundle")
            if digest == "b" * 64:
                raise RecordError("malformed group record")
            if digest == "d" * 64:
                raise DeliveryError("bundle digest mismatch")
            return FetchedBundle(record=rec("p3"), signer="")

    offers = [offer("p1", digest="a" * 64), offer("p2", source="t", digest="b" * 64), offer("p3", digest="c" * 64),
              offer("p4", digest=""), offer("p5", source="u", digest="d" * 64)]
    got = fetch_offers(Client(), offers)
    assert set(got.records) == {"p3"} and got.records["p3"].model_id == "s"
    assert got.refused == 2 and got.bad == 3 and got.undelivered == 3 and got.delivery_failed == 1
    assert sorted(got.rejections, key=lambda e: e.prompt_id) == [
        ReportEntry("s", "p1", 0.0, 0.0, False, True), ReportEntry("t", "p2", 0.0, 0.0, True),
        ReportEntry("s", "p4", 0.0, 0.0, False, True), ReportEntry("u", "p5", 0.0, 0.0, False, True)]
    with pytest.raises(Unavailable):
        fetch_offers(Client(lost=True), offers)


def test_a_node_fetches_only_one_offer_per_all_fail_prompt_of_its_round():
    """A hostile broker offering groups for prompts the receiver solved or never had, several
    for one prompt, or thousands, cannot make it download, decode and report them."""
    offers = [offer("p1"), offer("p1", source="t"), offer("solved"), offer("p2", digest=""), offer("nowhere")]
    offers += [offer(f"x{i}") for i in range(10_000)]
    got, ignored = offers_to_fetch(offers, wanted={"p1", "p2", "p3"})
    assert got == [offer("p1"), offer("p2", digest="")] and ignored == 10_003
    # a source name that would go raw into the node's log (ANSI escapes, a forged line) or is no id at all
    bad = [offer("p3", source="s\x1b[2J\nINFO forged"), offer("p3", source=""), offer("p3", source="s" * 257)]
    assert offers_to_fetch(bad + [offer("p3", source="t")], wanted={"p3"}) == ([offer("p3", source="t")], 3)


def test_a_fetched_group_of_another_size_than_the_federations_is_rejected():
    """The broker checks a source's n against the manifest; a hostile broker relays a group of
    4,096 responses (4,096 re-verifications and scoring rows at the receiver): refused."""
    from graft_fed.core.records import GroupRecord
    from graft_fed.node.client import FetchedBundle
    from graft_fed.node.peers import fetch_offers

    def rec(pid, n):
        return GroupRecord(prompt_id=pid, step=0, model_id="m", tokenizer_id="t", problem="q", answer="1",
                           rewards=(1.0,) + (0.0,) * (n - 1), advantages=(0.7071,) + (-0.7071,) * (n - 1),
                           texts=("1",) * n, finish_reasons=("stop",) * n, lengths=(1,) * n,
                           mean_logprobs=(-0.5,) * n)

    class Client:
        def fetch_bundle(self, digest, source=None):
            return FetchedBundle(record=rec("p1", 2 if digest == "a" * 64 else 4096), signer="")

    got = fetch_offers(Client(), [offer("p1", digest="b" * 64)], n=2)
    assert got.records == {} and got.bad == 1
    assert got.rejections == [ReportEntry("s", "p1", 0.0, 0.0, True)]
    assert set(fetch_offers(Client(), [offer("p1", digest="a" * 64)], n=2).records) == {"p1"}


class UploadsClient:
    """A broker client that records what the node uploads."""

    def __init__(self):
        self.uploaded = []

    def upload_missing(self, records):
        records = list(records)
        self.uploaded += records
        return len(records)


def test_matched_only_a_broker_cannot_widen_the_upload_window_past_the_nodes_cap(caplog):
    """The window is the broker's staleness_rounds in asynchronous mode: a hostile broker
    announcing staleness 10^9 got a matched_only node at round 500 to upload its groups of
    every round since 0 (when it records them). The node takes at most
    federation.max_staleness_rounds (16 by default)."""
    from types import SimpleNamespace

    from graft_fed.federation.manifest import Manifest
    from graft_fed.federation.messages import MatchResult
    from graft_fed.node.peers import BrokerPeers

    learner = SimpleNamespace(step=500, store=InformativeStore(), run_id="r", model_id="m", tok_id="t")
    asks = MatchResult(ready=True, offers=[], upload_requests=[(f"p{r}", r) for r in range(500)])
    for staleness, cap, first in ((10**9, 16, 484), (4, 16, 496), (10**9, 0, None)):
        hostile = Manifest("f", 1, "d", "h", 0, 2, 4, "async", "v", "1", staleness, "group/sample")
        client = UploadsClient()
        peers = BrokerPeers(client, "me", "matched_only", hostile, "b", None, 1, 1, 1, 1, 1, 1,
                            max_staleness_rounds=cap)
        peers.broker_manifest = hostile
        peers._serve_uploads(learner, asks, {})
        rounds = [r for _, r in client.uploaded]
        assert rounds == ([] if first is None else list(range(first, 500))), (staleness, cap)
        assert peers.uploads_refused == 500 - len(rounds)


def test_share_all_uploads_only_informative_groups_each_once_whatever_the_broker_asks():
    """share_all shares every informative group; a hostile broker asking for the node's
    all-pass or all-fail groups, one group a thousand times, rounds it has not reached or
    millions of groups got them uploaded (or looked up one by one)."""
    from types import SimpleNamespace

    from graft_fed.core.records import GroupRecord
    from graft_fed.federation.limits import MAX_DIGESTS_PER_CALL
    from graft_fed.federation.manifest import Manifest
    from graft_fed.federation.messages import MatchResult
    from graft_fed.node.peers import BrokerPeers

    def rec(pid, step):
        k = {"pass": 2, "fail": 0}.get(pid[:4], 1)
        rewards = (1.0,) * k + (0.0,) * (2 - k)
        adv = (0.7071, -0.7071) if k == 1 else (0.0, 0.0)
        return GroupRecord(prompt_id=pid, step=step, model_id="m", tokenizer_id="t", problem="q", answer="1",
                           rewards=rewards, advantages=adv, texts=("a", "b"), finish_reasons=("stop", "stop"),
                           lengths=(1, 1), mean_logprobs=(-0.5, -0.25))

    class Store:
        def __init__(self):
            self.lookups = 0

        def lookup(self, pids, step=None, run_id=None, match="same_step"):
            self.lookups += 1
            return {p: rec(p, step) for p in pids}

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    client = UploadsClient()
    peers = BrokerPeers(client, "me", "share_all", m, "b", None, 1, 1, 1, 1, 1, 1)
    peers.broker_manifest = m
    learner = SimpleNamespace(step=5, store=Store(), run_id="r", model_id="m", tok_id="t")
    asks = [("pass-1", 4), ("fail-1", 3), ("p1", 4), ("p9", 6)] + [("p2", 3)] * 1000
    asks += [(f"x{i}", 1) for i in range(100_000)]
    peers._serve_uploads(learner, MatchResult(ready=True, offers=[], upload_requests=asks), {})
    assert [(r.prompt_id, rnd) for r, rnd in client.uploaded][:2] == [("p1", 4), ("p2", 3)]
    assert len(client.uploaded) == MAX_DIGESTS_PER_CALL - 2 and learner.store.lookups == MAX_DIGESTS_PER_CALL
    assert all(r.kind == "informative" for r, _ in client.uploaded)


def test_bundles_the_broker_refuses_are_counted_and_do_not_end_the_exchange(caplog):
    """Upload requests served (node/peers.py::_serve_uploads) that the broker then refuses,
    some (BundlesRefused: they do not match the summaries it holds) or all (PERMISSION_DENIED:
    the node is quarantined as a source), are counted and logged; they are not a lost
    broker, so the node still fetches the offers made to it (it was re-joining instead)."""
    from types import SimpleNamespace

    from graft_fed.federation.errors import PermissionDenied
    from graft_fed.federation.manifest import Manifest
    from graft_fed.federation.messages import MatchResult
    from graft_fed.node.client import BundlesRefused
    from graft_fed.node.peers import BrokerPeers

    class Refusing(UploadsClient):
        def __init__(self, exc):
            super().__init__()
            self.exc = exc

        def upload_missing(self, records):
            super().upload_missing(records)
            raise self.exc

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    learner = SimpleNamespace(step=5, store=InformativeStore(), run_id="r", model_id="m", tok_id="t")
    asks = MatchResult(ready=True, offers=[], upload_requests=[("p1", 4), ("p2", 4), ("p3", 5)])
    denied = PermissionDenied("node me is quarantined")
    denied.sent, denied.refused = 1, 2  # as upload_missing sets them
    for exc, sent, counted in ((BundlesRefused("refused 2 of the 3", sent=1, refused=2), 1, 2), (denied, 1, 2),
                               (PermissionDenied("node me is quarantined"), 0, 1)):
        client = Refusing(exc)
        peers = BrokerPeers(client, "me", "share_all", m, "b", None, 1, 1, 1, 1, 1, 1)
        peers.broker_manifest, peers.connected = m, True
        with caplog.at_level("WARNING", logger="graft_fed.node"):
            assert peers._serve_uploads(learner, asks, {}) == sent
        assert len(client.uploaded) == 3 and peers.uploads_refused_by_broker == counted
        assert peers.connected, "a refused upload is not a lost broker"
    assert "still receives theirs" in caplog.text


def test_a_node_whose_uploads_are_refused_for_its_quota_keeps_the_steps_exchange():
    """share_all, publish step: the summaries went, the bundles are refused RESOURCE_EXHAUSTED
    (the node's bundle quota at the broker, which only grows; the broker's disk full). The
    round stays live: the node still asks for its matches and reports (it dropped the
    exchange and re-joined, every step from then on)."""
    import threading
    from types import SimpleNamespace

    from graft_fed.federation.manifest import Manifest
    from graft_fed.node.peers import BrokerPeers

    class OverQuota(UploadsClient):
        session_lost = threading.Event()
        round = 0

        def publish(self, rnd, summaries):
            return len(summaries), 0

        def upload_missing(self, records):
            super().upload_missing(records)
            raise ResourceExhausted("UploadBundle: node me exceeded its bundle storage quota of 1 MiB")

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    peers = BrokerPeers(OverQuota(), "me", "share_all", m, "b", None, 1, 1, 1, 1, 1, 1)
    peers.broker_manifest, peers.connected = m, True
    learner = SimpleNamespace(is_main=True, step=5, store=None, run_id="r", model_id="m", tok_id="t")
    assert peers.publish(learner, SimpleNamespace(groups=[])) == {}
    assert peers._round.live and peers.connected, "a refused upload is not a lost broker"
    assert peers.uploads_refused_by_broker == 1


def test_a_node_that_does_not_wait_for_bundles_does_not_score_their_sources_zero():
    """federation.fetch_timeout_s 0: the node takes only the offered bundles already uploaded.
    A matched_only source uploads only once its own GetMatches answer asks it to, so its
    offers come without a digest; each was reported as undelivered (s 0), and every source of
    such a node's offers became the least compatible for it, for the node's own setting."""
    import threading
    from types import SimpleNamespace

    from graft_fed.federation.manifest import Manifest
    from graft_fed.federation.messages import MatchResult
    from graft_fed.node.client import FetchedBundle
    from graft_fed.node.peers import BrokerPeers, _Round

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    uploaded = InformativeStore().lookup(["p1"], step=5)["p1"]

    class Client(UploadsClient):
        session_lost = threading.Event()
        round = 5

        def get_matches(self, rnd, wait_s, wait_for_bundles=False):  # p2's source never uploads
            return MatchResult(ready=True, offers=[offer("p1", digest="a" * 64), offer("p2", source="t", digest="")],
                               upload_requests=[])

        def fetch_bundle(self, digest, source=None):
            return FetchedBundle(record=uploaded, signer="")

    # waited for, a bundle that still did not come is the source's doing (reported, s 0)
    for wait_s, reported in ((0.0, []), (1.0, [ReportEntry("t", "p2", 0.0, 0.0, False, undelivered=True)])):
        peers = BrokerPeers(Client(), "me", "share_all", m, "b", None, 1, 1, wait_s, 1, 1, 1)
        peers.broker_manifest, peers.connected = m, True
        all_fail = SimpleNamespace(k=0, n=2)
        peers._round = _Round(round=5, live=True, groups={"p1": all_fail, "p2": all_fail})
        learner = SimpleNamespace(step=5, store=None, run_id="r", model_id="m", tok_id="t", is_main=True)
        got = peers._offers(learner, [all_fail, all_fail])
        assert set(got.records) == {"p1"} and peers._round.rejections == reported, wait_s


def test_a_join_refused_for_want_of_a_client_certificate_is_a_configuration_error():
    """UNAUTHENTICATED at Join is no lost session (Join opens one): the broker requires mutual
    TLS and the node presented no certificate. It was taken for a lost broker and retried
    forever; it now stops the node with what to set."""
    from types import SimpleNamespace

    import pytest

    from graft_fed.errors import ConfigError
    from graft_fed.federation.errors import Unauthenticated
    from graft_fed.federation.manifest import Manifest
    from graft_fed.node.peers import BrokerPeers

    class NoCertificate:
        def wait_ready(self, timeout_s):
            return True

        def join(self, *args, **kwargs):
            raise Unauthenticated("no client certificate: this broker requires mutual TLS")

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    peers = BrokerPeers(NoCertificate(), "me", "share_all", m, "b", None, 1, 1, 1, 1, 1, 1)
    learner = SimpleNamespace(is_main=True, step=0, model_id="m", tok_id="t")
    with pytest.raises(ConfigError, match="requires mutual TLS.*federation.tls_cert"):
        peers.ensure_joined(learner)


def test_a_publish_the_broker_refuses_is_not_a_lost_broker():
    """A publish refused for its content (FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND) was
    kept in the backlog and taken for a lost broker: the node joined again, and the backlog
    flush sent the same refused summaries again. Now the step trains without the exchange,
    the node stays joined, and the round is counted as refused."""
    import threading
    from types import SimpleNamespace

    from graft_fed.federation.manifest import Manifest
    from graft_fed.node.peers import BrokerPeers

    class Refusing:
        session_lost = threading.Event()
        round = 0
        calls = 0

        def publish(self, rnd, summaries):
            self.calls += 1
            raise FailedPrecondition(f"round {rnd} is implausibly far ahead of the federation")

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    client = Refusing()
    peers = BrokerPeers(client, "me", "share_all", m, "b", None, 1, 1, 1, 1, 1, 1)
    peers.broker_manifest, peers.connected = m, True
    learner = SimpleNamespace(is_main=True, step=5, store=None, run_id="r", model_id="m", tok_id="t")
    got = peers.publish(learner, SimpleNamespace(groups=[]))
    assert got["federation/publish_refused"] == 1.0 and got["federation/connected"] == 1.0
    assert peers.connected and not peers.backlog and not peers._round.live
    assert client.calls == 1


def test_a_publish_refused_for_a_limit_waits_in_the_backlog_without_a_new_join():
    """A publish refused RESOURCE_EXHAUSTED (the node's publish rate, or the summaries the
    broker holds of it, max_node_summaries) was taken for a lost broker: the node joined
    again at every step. The broker is there: the node stays joined, the step trains
    without the exchange, and the summaries wait in the backlog until the limit lifts."""
    import threading
    from types import SimpleNamespace

    from graft_fed.federation.errors import ResourceExhausted
    from graft_fed.federation.manifest import Manifest
    from graft_fed.node.peers import BrokerPeers

    class AtQuota:
        session_lost = threading.Event()
        round = 0
        sent: list = []
        full = True

        def publish(self, rnd, summaries):
            if self.full:
                raise ResourceExhausted("node 'me' holds 6 summaries at the broker; quota of 6")
            self.sent.append(rnd)

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    client = AtQuota()
    peers = BrokerPeers(client, "me", "summaries_only", m, "b", None, 1, 1, 1, 1, 1, 1)
    peers.broker_manifest, peers.connected = m, True
    learner = SimpleNamespace(is_main=True, step=5, store=None, run_id="r", model_id="m", tok_id="t")
    got = peers.publish(learner, SimpleNamespace(groups=[]))
    assert got["federation/publish_refused"] == 1.0 and got["federation/connected"] == 1.0
    assert peers.connected and list(peers.backlog) == [5] and not peers._round.live
    client.full = False  # retention freed some: the next round goes, then (after its report) the backlog
    learner.step = 6
    peers.publish(learner, SimpleNamespace(groups=[]))
    assert client.sent == [6] and peers._round.live
    assert peers._flush_backlog(learner) == 1 and client.sent == [6, 5] and not peers.backlog


def test_a_report_the_broker_could_not_be_reached_for_is_sent_at_the_next_step():
    """A compatibility report lost to a transient error was dropped with the step's exchange,
    rejections of a lying source with it. It is kept and sent once the broker is back; one
    refused then (its round pruned at the broker) is dropped, not sent again."""
    import threading
    from types import SimpleNamespace

    from graft_fed.federation.errors import Unavailable
    from graft_fed.federation.manifest import Manifest
    from graft_fed.node.peers import BrokerPeers, _Round

    class Flaky:
        session_lost = threading.Event()
        round = 0

        def __init__(self):
            self.sent, self.down = [], True

        def report(self, rnd, entries):
            if self.down:
                raise Unavailable("the broker cannot be reached")
            if rnd == 3:
                raise FailedPrecondition("round 3 was pruned")
            self.sent.append((rnd, [(e.source, e.prompt_id, e.rejected) for e in entries]))

    m = Manifest("f", 1, "d", "h", 0, 2, 4, "sync", "v", "1", 0, "group/sample")
    client = Flaky()
    peers = BrokerPeers(client, "me", "share_all", m, "b", None, 1, 1, 1, 1, 1, 1)
    peers.broker_manifest, peers.connected = m, True
    learner = SimpleNamespace(is_main=True, step=5, store=None, run_id="r", model_id="m", tok_id="t")
    lie = ReportEntry(source="liar", prompt_id="p1", mean_s=0.0, admitted_fraction=0.0, rejected=True)
    for rnd in (3, 4):
        peers._round = _Round(round=rnd, live=True, rejections=[lie])
        got = peers.report(learner, [])
        assert not peers.connected and got["federation/report_backlog_rounds"] == rnd - 2
        peers.connected = True
    client.down = False
    peers._round = _Round(round=5, live=True, rejections=[lie])
    got = peers.report(learner, [])
    assert client.sent == [(5, [("liar", "p1", True)]), (4, [("liar", "p1", True)])]
    assert got["federation/reports_resent"] == 1.0 and got["federation/report_backlog_rounds"] == 0.0
    assert peers.connected


def test_a_node_secret_file_is_made_once_and_a_damaged_one_is_refused(tmp_path):
    from graft_fed.errors import ConfigError
    from graft_fed.node.secret import load_or_create

    import pytest

    first = load_or_create(tmp_path / "run")
    assert len(first) == 64 and load_or_create(tmp_path / "run") == first
    assert not [p for p in (tmp_path / "run").iterdir() if p.name != "node_secret"]  # no temporary file left
    (tmp_path / "run" / "node_secret").write_text("not a secret\n")
    with pytest.raises(ConfigError, match="is not a node secret.*federation.node_id"):
        load_or_create(tmp_path / "run")
