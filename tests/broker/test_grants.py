"""broker/grants.py: which receivers may fetch which bundles, bounded by digests and by
(digest, receiver) entries."""

from __future__ import annotations

from graft_fed.broker.grants import Grants


def test_the_oldest_digests_go_once_the_entries_pass_their_bound():
    g = Grants(limit=1000, max_entries=10)
    for i in range(4):  # 4 digests x 3 receivers: 12 entries
        for r in ("a", "b", "c"):
            g.grant(r, [f"d{i}"])
    assert g.entries() == 9 and len(g) == 3  # d0 went whole, the newest three stay
    assert not g.allowed("a", "d0") and all(g.allowed(r, "d3") for r in "abc")
    g.grant("a", ["d1"])  # granted again: no new entry, and d1 is now the newest
    assert g.entries() == 9
    g.grant("d", ["d4"])
    g.grant("e", ["d4"])  # 11 entries: the oldest, d2, goes
    assert not g.allowed("b", "d2") and g.allowed("b", "d1") and g.entries() == 8


def test_the_digest_bound_still_holds_and_the_last_grant_always_stays():
    g = Grants(limit=2, max_entries=1)
    g.grant("a", ["x", "y", "z"])
    assert len(g) == 1 and g.allowed("a", "z") and g.entries() == 1
    g.grant("b", ["z"])  # over the entry bound, but z is the digest granted last
    assert g.allowed("a", "z") and g.allowed("b", "z") and g.entries() == 2

