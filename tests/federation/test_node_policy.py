"""The node's side of issue 12 as pure policy (graft_fed/federation/policy.py): a refused
fetch skips one offer, undelivered and refused groups are reported, and matched_only
uploads only what the node can see was matched in the current window."""

from graft_fed.federation.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                                         PermissionDenied, ResourceExhausted, Unavailable)
from graft_fed.federation.messages import Offer, ReportEntry
from graft_fed.federation.policy import (fetch_failure_is_per_offer, refused_record_entry, undelivered_entries,
                                         uploads_to_serve)


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
    assert got == [ReportEntry("s", "p2", 0.0, 0.0, False), ReportEntry("t", "p3", 0.0, 0.0, False)]
    assert refused_record_entry(offer("p5")) == ReportEntry("s", "p5", 0.0, 0.0, True)


def test_matched_only_uploads_only_informative_groups_of_the_current_window():
    informative = {5: {"a", "b"}, 4: {"c"}, 1: {"old"}}
    requests = [("a", 5), ("z", 5), ("c", 4), ("old", 1), ("a", 6), ("b", 5)]
    ok, refused = uploads_to_serve(requests, current_round=5, window_rounds=0, informative=informative)
    assert ok == [("a", 5), ("b", 5)]
    assert refused == [("z", 5), ("c", 4), ("old", 1), ("a", 6)]
    ok, _ = uploads_to_serve(requests, current_round=5, window_rounds=2, informative=informative)  # async window
    assert ok == [("a", 5), ("c", 4), ("b", 5)]
