"""The one suite every BrokerState implementation passes (the contract is in
graft_fed/broker/state.py), then what only the SQLite state can show: restart, crash,
refusal of foreign or newer files, and rollback of a batch that fails half way."""

from __future__ import annotations

import dataclasses
import errno
import gc
import hashlib
import itertools
import json
import logging
import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from graft_fed.broker import blockfiles, bundlefiles
from graft_fed.broker.blockfiles import BlockFiles
from graft_fed.broker.bundlefiles import file_name
from graft_fed.broker.checkpointer import WAL_SIZE_LIMIT, Checkpointer, safety_pages
from graft_fed.broker.matchset import MatchSet
from graft_fed.broker.reportblock import decode_report_block, encode_report_block
from graft_fed.broker.state import CompatRow, MatchRow, NodeRow, ReportRow, ReportRows, RoundRow, SummaryRow
from graft_fed.broker.state_memory import InMemoryState
from graft_fed.broker.state_sqlite import SCHEMA_VERSION, SqliteState
from graft_fed.errors import DataError
from graft_fed.federation.errors import NotFound, StorageFull, Unavailable
from graft_fed.federation.summaryblock import SummaryBlock
from tests.broker.test_matching import gfm1_bytes
from tests.fds import open_under

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["memory", "sqlite"])
def state(request, tmp_path):
    s = InMemoryState() if request.param == "memory" else SqliteState(tmp_path / "broker.db")
    yield s
    s.close()


def node(node_id="a", **kw) -> NodeRow:
    base = dict(model_id="m", tokenizer_id="t", privacy="share_all", state="online", session_id="s1",
                round=0, last_seen=100.5)
    base.update(kw)
    return NodeRow(node_id=node_id, **base)


def summ(node_id="a", round=0, prompt_id="p0", **kw) -> SummaryRow:
    base = dict(policy_version=1, n=4, k=2, reward_mean=0.5, reward_std=0.5, lengths=[3, 5, 7, 9],
                mean_logprobs=[-0.25, -1.5, -0.125, -2.0])
    base.update(kw)
    return SummaryRow(node_id=node_id, round=round, prompt_id=prompt_id, **base)


def exact(x) -> str:
    """A float's identity, sign of zero and NaN included."""
    return repr(x)


# ---------------------------------------------------------------- nodes and rounds

def test_nodes_upsert_get_list(state):
    assert state.get_node("a") is None and state.list_nodes() == []
    state.upsert_node(node("b", round=3))
    state.upsert_node(node("a"))
    state.upsert_node(node("b", state="offline", round=4, published=7))  # replaces the whole row
    assert state.get_node("b") == node("b", state="offline", round=4, published=7)
    assert [n.node_id for n in state.list_nodes()] == ["a", "b"]
    assert state.list_nodes()[0] == node("a")


def test_node_secrets_are_kept_per_node_and_replaced(state):
    assert state.node_secret("a") == ""
    state.set_node_secret("a", "1" * 64)
    state.set_node_secret("b", "2" * 64)
    state.set_node_secret("a", "3" * 64)  # replaces
    assert (state.node_secret("a"), state.node_secret("b"), state.node_secret("c")) == ("3" * 64, "2" * 64, "")


def test_reads_and_writes_are_copies(state):
    n = node("a")
    state.upsert_node(n)
    n.state = "left"  # the caller's object after the write
    got = state.get_node("a")
    got.round = 99
    state.list_nodes()[0].model_id = "x"
    assert state.get_node("a") == node("a")

    s = summ()
    state.put_summaries([s])
    s.lengths.append(1)
    out = state.summaries()[0]
    out.lengths.append(2)
    out.mean_logprobs[0] = 9.0
    out.reward_mean = 9.0
    assert state.summaries() == [summ()]

    r = RoundRow(round=0, state="open", opened_at=1.0)
    state.put_round(r)
    r.state = "matched"
    state.get_round(0).state = "matched"
    assert state.get_round(0).state == "open"

    state.put_matches([MatchRow(0, "a", "p0", "b", 0)])
    state.matches()[0].source = "z"
    assert state.matches()[0].source == "b"

    state.update_compat("a", "b", 0.5, 1.0, False)
    state.compat()[0].groups = 50
    assert state.compat()[0].groups == 1


def test_rounds_and_latest_round(state):
    assert state.latest_round() == -1 and state.get_round(0) is None
    state.put_round(RoundRow(round=2, state="open", opened_at=10.0))
    state.put_round(RoundRow(round=0, state="matched", opened_at=1.0, matched_at=2.0))
    assert state.latest_round() == 2
    state.put_round(RoundRow(round=2, state="matched", opened_at=10.0, matched_at=11.25,
                             participants=["a", "b"]))  # replace
    assert state.get_round(2) == RoundRow(round=2, state="matched", opened_at=10.0, matched_at=11.25,
                                          participants=["a", "b"])
    state.get_round(2).participants.append("mutated")
    assert state.get_round(2).participants == ["a", "b"]
    assert state.get_round(0).matched_at == 2.0 and state.get_round(1) is None


# ---------------------------------------------------------------- summaries

def test_put_summaries_is_idempotent_first_write_wins(state):
    batch = [summ(prompt_id=f"p{i}") for i in range(3)]
    assert state.put_summaries(batch) == (3, 0)
    assert state.put_summaries(batch) == (0, 3)  # a retried publish
    assert state.put_summaries([summ(prompt_id="p0", reward_mean=0.0), summ(prompt_id="p3")]) == (1, 1)
    assert state.summaries(prompt_ids=["p0"])[0].reward_mean == 0.5  # the first write won
    # duplicates inside one batch: the first occurrence wins
    assert state.put_summaries([summ(prompt_id="q", k=1), summ(prompt_id="q", k=3)]) == (1, 1)
    assert state.summaries(prompt_ids=["q"])[0].k == 1
    assert state.put_summaries([]) == (0, 0)
    assert len(state.summaries()) == 5


def test_floats_round_trip_exactly(state):
    odd = [0.1, -1e-300, 1 / 3, -0.0, 5e-324, 1e308, float("inf"), float("-inf"), float("nan"), 2.0 ** 60]
    rows = [summ(prompt_id=f"p{i}", reward_mean=x, reward_std=-x, mean_logprobs=[x, -x, 0.1 + 0.2])
            for i, x in enumerate(odd)]
    state.put_summaries(rows)
    got = state.summaries()
    assert [exact(r.reward_mean) for r in got] == [exact(x) for x in odd]
    assert [exact(r.reward_std) for r in got] == [exact(-x) for x in odd]
    assert [list(map(exact, r.mean_logprobs)) for r in got] == [[exact(x), exact(-x), exact(0.1 + 0.2)] for x in odd]
    assert all(type(v) is float for r in got for v in (r.reward_mean, *r.mean_logprobs))
    assert all(type(v) is int for r in got for v in r.lengths)

    state.upsert_node(node("a", last_seen=1 / 3))
    assert exact(state.get_node("a").last_seen) == exact(1 / 3)
    state.put_round(RoundRow(round=0, state="open", opened_at=-0.0, matched_at=0.1))
    r = state.get_round(0)
    assert (exact(r.opened_at), exact(r.matched_at)) == ("-0.0", "0.1")
    state.update_compat("a", "b", 1 / 3, -1e-300, False)
    c = state.compat()[0]
    assert (exact(c.mean_s), exact(c.admitted_fraction)) == (exact(1 / 3), exact(-1e-300))


def test_summaries_filters(state):
    rows = [summ(n, r, p) for n in ("a", "b") for r in (0, 1, 2) for p in ("p0", "p1", "p2")]
    state.put_summaries(list(reversed(rows)))
    keys = lambda out: [(s.node_id, s.round, s.prompt_id) for s in out]  # noqa: E731
    assert keys(state.summaries()) == sorted(keys(rows), key=lambda k: (k[1], k[0], k[2]))  # round, node, prompt
    assert {s.round for s in state.summaries(round=1)} == {1} and len(state.summaries(round=1)) == 6
    assert len(state.summaries(node_id="b")) == 9
    assert keys(state.summaries(round=2, node_id="a")) == [("a", 2, "p0"), ("a", 2, "p1"), ("a", 2, "p2")]
    assert keys(state.summaries(prompt_ids=["p2", "zz"], min_round=1)) == [
        ("a", 1, "p2"), ("b", 1, "p2"), ("a", 2, "p2"), ("b", 2, "p2")]
    assert keys(state.summaries(prompt_ids=(p for p in ["p1"]), node_id="a", min_round=2)) == [("a", 2, "p1")]
    assert state.summaries(prompt_ids=[]) == []
    assert len(state.summaries(min_round=0)) == 18 and state.summaries(min_round=3) == []
    assert state.summaries(round=7) == [] and state.summaries(node_id="zz") == []
    many = [f"x{i}" for i in range(40000)] + ["p0"]  # beyond SQLite's bound-parameter limit
    assert len(state.summaries(prompt_ids=many)) == 6


def test_record_liveness_moves_last_seen_forward_only(state):
    state.upsert_node(node("a", last_seen=10.0, round=3, published=7))
    state.upsert_node(node("b", last_seen=50.0))
    state.record_liveness([("a", 20.5), ("b", 40.0), ("ghost", 99.0)])
    a, b = state.get_node("a"), state.get_node("b")
    assert (a.last_seen, a.round, a.published, a.session_id) == (20.5, 3, 7, "s1")
    assert b.last_seen == 50.0  # never moved back
    assert state.get_node("ghost") is None


def test_an_upload_commits_its_bundle_and_attaches_its_digest(state):
    """BundleWriter.commit_attached: the bundle stored and its digest on the node's summary,
    (stored, attached); a second upload of the bytes stores nothing and still attaches; a
    bundle for a summary not held (retention dropped it meanwhile) stores nothing: no grant
    could reach it, and it would count against its uploader."""
    state.put_summaries([summ(), summ(prompt_id="p1")])

    def upload(data: bytes, digest: str, prompt_id: str, round: int = 0) -> tuple[bool, bool]:
        w = state.begin_bundle()
        w.write(data)
        w.prepare(digest)
        return w.commit_attached(digest, b"", b"", "a", round, prompt_id)
    assert upload(b"one", "d" * 64, "p0") == (True, True)
    assert upload(b"one", "d" * 64, "p1") == (False, True)
    assert upload(b"two", "e" * 64, "p0", round=1) == (False, False)
    assert [s.bundle_digest for s in state.summaries()] == ["d" * 64, "d" * 64]
    assert state.get_bundle("d" * 64) == b"one" and state.get_bundle("e" * 64) is None


def test_summary_heads_match_summaries(state):
    rows = [summ(n, r, p, k=(r + len(p)) % 5) for n in ("a", "b") for r in (0, 1, 2) for p in ("p0", "p1", "p2")]
    state.put_summaries(list(reversed(rows)))
    state.set_bundle_digest("b", 1, "p1", "d" * 64)
    for kw in ({}, {"round": 1}, {"node_id": "b"}, {"prompt_ids": ["p2", "zz"], "min_round": 1}, {"prompt_ids": []},
               {"round": 2, "node_id": "a", "prompt_ids": ["p0"]}):
        heads = state.summary_heads(**kw)
        assert [(h.node_id, h.round, h.prompt_id, h.n, h.k, h.bundle_digest) for h in heads] == [
            (s.node_id, s.round, s.prompt_id, s.n, s.k, s.bundle_digest) for s in state.summaries(**kw)]


def test_set_bundle_digest(state):
    state.put_summaries([summ(), summ(prompt_id="p1")])
    assert state.set_bundle_digest("a", 0, "p0", "d" * 64) is True
    assert state.set_bundle_digest("a", 0, "missing", "d" * 64) is False
    assert state.set_bundle_digest("a", 1, "p0", "d" * 64) is False
    assert [s.bundle_digest for s in state.summaries()] == ["d" * 64, ""]
    assert state.set_bundle_digest("a", 0, "p0", "e" * 64) is True  # a later upload replaces the link
    assert state.summaries(prompt_ids=["p0"])[0].bundle_digest == "e" * 64
    assert state.set_bundle_digest("a", 0, "p0", "") is True  # "" detaches
    assert state.set_bundle_digest("a", 0, "missing", "") is False
    assert [s.bundle_digest for s in state.summaries()] == ["", ""]


# ---------------------------------------------------------------- matches, bundles, compat

def test_matches_idempotent_and_filters(state):
    rows = [MatchRow(1, "r1", "p0", "s1", 0), MatchRow(1, "r2", "p0", "s2", 1), MatchRow(0, "r1", "p1", "s2", 0)]
    state.put_matches(rows)
    state.put_matches(rows)  # retried
    state.put_matches([MatchRow(1, "r1", "p0", "other", 1)])  # same key: the first write wins
    assert state.matches() == [rows[2], rows[0], rows[1]]  # round, receiver, prompt
    assert state.matches(round=1, receiver="r1") == [rows[0]]
    assert state.matches(source="s2") == [rows[2], rows[1]]
    assert state.matches(round=0) == [rows[2]]
    assert state.matches(round=1, receiver="r1", source="s2") == []
    state.put_matches([])
    assert len(state.matches()) == 3
    assert state.has_matches(0) and state.has_matches(1) and not state.has_matches(2)
    state.put_match_set(2, b"set")
    assert not state.has_matches(2)  # a match set is not rows


def test_a_match_set_and_its_rounds_row_are_written_together_or_not_at_all(state):
    state.put_round(RoundRow(5, "open", 1.0))
    matched = RoundRow(5, "matched", 1.0, 2.0, ["a", "b"])
    assert state.put_match_set(5, b"five", round_row=matched) is True
    assert state.match_set(5) == b"five" and state.get_round(5) == matched
    # a set stored before wins, and the round's row is left as it was
    assert state.put_match_set(5, b"again", round_row=RoundRow(5, "matched", 1.0, 3.0, ["a"])) is False
    assert state.match_set(5) == b"five" and state.get_round(5) == matched


def test_match_sets_first_write_wins_and_prune_with_their_round(state):
    assert state.match_set(0) is None and state.match_set_rounds() == []
    assert state.put_match_set(1, b"one") is True
    assert state.put_match_set(1, b"other") is False  # the first set of a round wins
    assert state.put_match_set(0, b"zero") is True
    assert state.match_set(1) == b"one" and state.match_set_rounds() == [0, 1]
    assert state.matches() == []  # a set is not rows
    with pytest.raises(TypeError):
        state.put_match_set(2, "text")
    for r in range(3):
        state.put_round(RoundRow(round=r, state="open", opened_at=0.0))
    state.prune(keep_rounds=2)
    assert state.match_set_rounds() == [1] and state.match_set(0) is None


def test_bundles(state):
    assert state.bundle_stats() == (0, 0) and state.get_bundle("x") is None
    assert state.put_bundle("d1", b"abc") is True
    assert state.put_bundle("d1", b"abc") is False  # idempotent on the digest
    assert state.put_bundle("d2", bytearray(b"\x00" * 10)) is True
    assert state.put_bundle("d3", b"") is True
    assert state.get_bundle("d1") == b"abc" and type(state.get_bundle("d2")) is bytes
    assert state.get_bundle("d3") == b""
    assert state.bundle_stats() == (3, 13)
    assert state.has_bundles(["zz", "d3", "d1", "nope", "d2"]) == ["d3", "d1", "d2"]
    assert state.has_bundles([]) == []
    with pytest.raises(TypeError):
        state.put_bundle("d4", 5)  # bytes(5) would be five zero bytes
    assert state.bundle_stats() == (3, 13)


def test_bundle_provenance_is_stored_once_with_the_bytes(state):
    assert state.bundle_provenance("d1") is None
    assert state.put_bundle("d1", b"abc") is True
    assert state.bundle_provenance("d1") == (b"", b"")  # unsigned
    assert state.put_bundle("d2", b"xyz", signature=b"\x30sig", signer_cert=bytearray(b"\x30cert")) is True
    assert state.bundle_provenance("d2") == (b"\x30sig", b"\x30cert")
    assert type(state.bundle_provenance("d2")[1]) is bytes
    # the first upload wins: a later one can neither add nor replace the provenance
    assert state.put_bundle("d1", b"abc", signature=b"late", signer_cert=b"late") is False
    assert state.put_bundle("d2", b"xyz", signature=b"other", signer_cert=b"other") is False
    assert state.bundle_provenance("d1") == (b"", b"") and state.bundle_provenance("d2")[0] == b"\x30sig"
    with pytest.raises(TypeError):
        state.put_bundle("d3", b"q", signature="not bytes")
    assert state.bundle_provenance("d3") is None and state.bundle_stats() == (2, 6)
    state.prune(max_bundle_bytes=3)  # d1 goes, and its provenance with it
    assert state.bundle_provenance("d1") is None and state.bundle_provenance("d2") is not None


def test_compat_running_means_and_rejections(state):
    state.update_compat("s", "r", 0.2, 1.0, False)
    state.update_compat("s", "r", 0.9, 0.0, True)  # rejected: counts only towards `rejected`
    state.update_compat("s", "r", 0.4, 0.5, False)
    state.update_compat("s", "r", 0.9, 0.0, False)
    state.update_compat("a", "r", 0.7, 0.25, True)  # first report of a pair, rejected
    assert state.compat() == [
        CompatRow("a", "r", groups=0, mean_s=0.0, admitted_fraction=0.0, rejected=1),
        CompatRow("s", "r", groups=3, mean_s=pytest.approx(0.5), admitted_fraction=pytest.approx(0.5), rejected=1),
    ]
    state.update_compat("r", "s", 0.3, 0.75, False)  # the pair is directed
    assert [(c.source, c.receiver, c.groups) for c in state.compat()] == [("a", "r", 0), ("r", "s", 1), ("s", "r", 3)]
    assert state.compat()[1].mean_s == 0.3 and state.compat()[1].admitted_fraction == 0.75


def test_compat_of_given_pairs(state):
    state.put_reports([rep(source="s", receiver="r"), rep(source="t", receiver="r", rejected=True),
                       rep(source="r", receiver="s", mean_s=0.25)])
    everything = state.compat()
    assert state.compat(pairs=[("t", "r"), ("s", "r")]) == [everything[1], everything[2]]  # by (source, receiver)
    assert state.compat(pairs={("r", "s"), ("x", "r"), ("s", "t")}) == [everything[0]]  # pairs with no row: none
    assert state.compat(pairs=[("r", "s"), ("r", "s")]) == [everything[0]]  # a pair named twice: once
    assert state.compat(pairs=[]) == []
    with pytest.raises(TypeError, match="source"):
        state.compat(pairs=[(1, "r")])
    with pytest.raises(TypeError, match="pair"):
        state.compat(pairs=["sr"])


def test_report_batches_fold_as_one_report_at_a_time(state):
    rng = random.Random(11)
    batches = [[rep(round=rng.randrange(3), receiver=rng.choice("qr"), source=rng.choice("stu"),
                    prompt_id=f"p{rng.randrange(5)}", mean_s=rng.random(), admitted_fraction=rng.random(),
                    rejected=rng.random() < 0.2) for _ in range(rng.randrange(8))] for _ in range(40)]
    got = []
    for i in range(0, len(batches), 4):  # duplicates within a batch, across batches of a commit, across commits
        got += state.put_report_batches(batches[i:i + 4])
    one_at_a_time = InMemoryState()
    want = [tuple(sum(x) for x in zip((0, 0), *[one_at_a_time.put_reports([r]) for r in batch])) for batch in batches]
    assert got == want and sum(a for a, _ in got) > 20 and sum(d for _, d in got) > 20
    assert state.compat() == one_at_a_time.compat()  # the same floats, not approximately
    assert state.reports() == one_at_a_time.reports()
    assert state.put_report_batches([]) == []
    with pytest.raises(TypeError):  # a malformed batch: nothing of the commit is stored
        state.put_report_batches([[rep(round=9)], [rep(round=9, prompt_id="x", rejected=1)]])
    assert state.reports(round=9) == []


def test_a_report_as_columns_is_stored_as_its_rows(state):
    """state.ReportRows (how the broker hands a report to the state): the sequence of its
    ReportRow, stored and folded exactly as those rows as a list are."""
    cols = ReportRows(2, "r", ["s", "t", "s", "s"], ["p0", "p0", "p1", "p0"], [0.25, 0.5, 0.0, 0.75],
                      [1.0, 0.5, 0.0, 0.25], [False, False, True, False])
    rows = [rep(round=2, source="s", mean_s=0.25), rep(round=2, source="t", mean_s=0.5, admitted_fraction=0.5),
            rep(round=2, prompt_id="p1", mean_s=0.0, admitted_fraction=0.0, rejected=True),
            rep(round=2, mean_s=0.75, admitted_fraction=0.25)]
    assert len(cols) == 4 and list(cols) == rows and cols[1] == rows[1] and cols[-1] == rows[-1]
    assert cols[1:3] == rows[1:3] and cols[::-1] == rows[::-1]
    assert list(cols.without({("s", "p0"), ("x", "p9")})) == rows[1:3]
    with pytest.raises(IndexError):
        cols[4]
    with pytest.raises(ValueError, match="differ in length"):
        ReportRows(0, "r", ["s"], [], [0.5], [1.0], [False])
    as_list = InMemoryState()
    assert state.put_reports(cols) == as_list.put_reports(rows) == (3, 1)  # the first of (s, p0) wins
    assert state.reports() == as_list.reports() and state.compat() == as_list.compat()
    with pytest.raises(TypeError):  # checked as rows are: nothing stored
        state.put_reports(ReportRows(3, "r", ["s"], ["p0"], [0.5], [1.0], [1]))
    assert state.reports(round=3) == []


def rep(round=0, receiver="r", source="s", prompt_id="p0", mean_s=0.5, admitted_fraction=1.0, rejected=False,
        undelivered=False):
    return ReportRow(round=round, receiver=receiver, source=source, prompt_id=prompt_id, mean_s=mean_s,
                     admitted_fraction=admitted_fraction, rejected=rejected, undelivered=undelivered)


def test_reports_count_once_and_fold_into_compat(state):
    batch = [rep(prompt_id="p0", mean_s=0.2), rep(prompt_id="p1", mean_s=0.4, admitted_fraction=0.5),
             rep(prompt_id="p2", rejected=True, mean_s=0.0, admitted_fraction=0.0)]
    assert state.put_reports(batch) == (3, 0)
    assert state.compat() == [CompatRow("s", "r", groups=2, mean_s=pytest.approx(0.3),
                                        admitted_fraction=pytest.approx(0.75), rejected=1)]
    before = state.compat()
    assert state.put_reports(batch) == (0, 3)  # retried or replayed: nothing changes
    assert state.put_reports([rep(prompt_id="p2", rejected=False, mean_s=0.9)]) == (0, 1)  # the first wins
    assert state.compat() == before
    # another round, receiver or source is another report; duplicates inside a batch count once
    assert state.put_reports([rep(round=1), rep(round=1), rep(receiver="q"), rep(source="t")]) == (3, 1)
    assert [(c.source, c.receiver, c.groups) for c in state.compat()] == [("s", "q", 1), ("s", "r", 3),
                                                                          ("t", "r", 1)]
    assert [(r.round, r.receiver, r.source, r.prompt_id) for r in state.reports()] == [
        (0, "q", "s", "p0"), (0, "r", "s", "p0"), (0, "r", "s", "p1"), (0, "r", "s", "p2"), (0, "r", "t", "p0"),
        (1, "r", "s", "p0")]
    assert state.reports(round=0, receiver="r", source="s")[2] == rep(prompt_id="p2", rejected=True, mean_s=0.0,
                                                                     admitted_fraction=0.0)
    assert len(state.reports(source="t")) == 1 and state.reports(round=5) == []
    # validated before anything is written
    with pytest.raises(TypeError):
        state.put_reports([rep(prompt_id="new"), rep(prompt_id="bad", rejected=1)])
    with pytest.raises(TypeError):
        state.put_reports([rep(prompt_id="new"), rep(prompt_id="bad", mean_s="0.5")])
    assert len(state.reports()) == 6 and state.put_reports([]) == (0, 0)
    state.reports()[0].source = "mutated"
    assert state.reports()[0].source == "s"


# ---------------------------------------------------------------- retention

def _fill_rounds(state, n=5):
    for r in range(n):
        state.put_round(RoundRow(round=r, state="matched", opened_at=float(r)))
        state.put_summaries([summ("a", r, "p0"), summ("b", r, "p0")])
        state.put_matches([MatchRow(r, "a", "p0", "b", r)])


def test_prune_rounds(state):
    assert state.prune(keep_rounds=3) == 0  # nothing yet
    _fill_rounds(state)
    assert state.prune() == 0  # no limits: nothing goes
    assert state.prune(keep_rounds=3) == 2 * (2 + 1 + 1)  # rounds 0 and 1: 2 summaries, 1 match, 1 round each
    assert sorted({s.round for s in state.summaries()}) == [2, 3, 4]
    assert [m.round for m in state.matches()] == [2, 3, 4]
    assert state.get_round(1) is None and state.get_round(2) is not None and state.latest_round() == 4
    assert state.prune(keep_rounds=3) == 0  # idempotent
    assert state.prune(keep_rounds=1) == 2 * 4
    assert state.latest_round() == 4 and len(state.summaries()) == 2
    for bad in (dict(keep_rounds=0), dict(keep_rounds=-1), dict(max_bundle_bytes=-1)):
        with pytest.raises(ValueError):
            state.prune(**bad)
    state.put_reports([rep(round=r) for r in range(5)])
    assert state.prune(keep_rounds=2) == 3  # the reports of rounds 0 to 2
    assert [r.round for r in state.reports()] == [3, 4] and state.compat()[0].groups == 5  # compat stays


def test_summaries_held_per_node_count_new_rows_drop_with_retention_and_survive_reopening(state, tmp_path):
    """What the per-node summary quota (broker.max_node_summaries) reads: new summaries only
    (not duplicates, not another node's), lowered by retention, the same after reopening."""
    assert state.summaries_held("a") == 0
    _fill_rounds(state)  # a and b: one summary in each of rounds 0-4
    assert state.put_summaries([summ("a", 4, "p0"), summ("a", 4, "p1")]) == (1, 1)  # one duplicate
    assert state.put_summary_blocks([(SummaryBlock.from_rows([summ("a", 5, "p0"), summ("a", 5, "p1")]), None),
                                     (SummaryBlock.from_rows([summ("b", 5, "p0")]), None)]) == [(2, 0), (1, 0)]
    assert (state.summaries_held("a"), state.summaries_held("b"), state.summaries_held("c")) == (8, 6, 0)
    state.put_round(RoundRow(round=5, state="open", opened_at=5.0))
    state.prune(keep_rounds=2)  # rounds 4 and 5 stay
    assert (state.summaries_held("a"), state.summaries_held("b")) == (4, 2)
    assert {n: len(state.summaries(node_id=n)) for n in "ab"} == {"a": 4, "b": 2}
    state.prune(keep_rounds=1)
    assert (state.summaries_held("a"), state.summaries_held("b")) == (2, 1)
    if isinstance(state, SqliteState):
        state.close()
        again = SqliteState(tmp_path / "broker.db")
        try:
            assert (again.summaries_held("a"), again.summaries_held("b")) == (2, 1)
        finally:
            again.close()


def test_an_upload_whose_summary_retention_dropped_meanwhile_stores_nothing(state):
    """The summary checked, the bytes written, then retention drops the summary's round
    before the commit: the bundle was stored all the same, named by no summary, so no
    retention of rounds ever dropped it and it counted against its uploader for good
    (found in review). Nothing is stored now."""
    for r in (0, 1):
        state.put_round(RoundRow(round=r, state="matched", opened_at=float(r)))
        state.put_summaries([summ("a", r, "p0")])
    data = b'{"x": 1}' * 100
    digest = hashlib.sha256(data).hexdigest()
    w = state.begin_bundle()
    w.write(data)
    w.prepare(digest)
    state.prune(keep_rounds=1)
    assert w.commit_attached(digest, b"", b"", "a", 0, "p0") == (False, False)
    assert state.has_bundles([digest]) == [] and state.bundle_bytes_held("a") == 0
    w = state.begin_bundle()  # the same bytes for a summary still held are stored
    w.write(data)
    assert w.commit_attached(digest, b"", b"", "a", 1, "p0") == (True, True)
    assert state.bundle_bytes_held("a") == len(data)


def test_prune_bundles_drops_oldest_and_unlinks(state):
    state.put_summaries([summ(prompt_id=f"p{i}") for i in range(4)])
    for i, size in enumerate((40, 30, 20, 10)):
        state.put_bundle(f"d{i}", bytes(size))
    state.set_bundle_digest("a", 0, "p0", "d0")
    state.set_bundle_digest("a", 0, "p1", "d0")  # content-addressed: shared by two summaries
    state.set_bundle_digest("a", 0, "p2", "d2")
    assert state.prune(max_bundle_bytes=100) == 0
    assert state.prune(max_bundle_bytes=50) == 2  # d0 (40): 100 -> 60, still over; d1 (30): -> 30
    assert state.has_bundles(["d0", "d1", "d2", "d3"]) == ["d2", "d3"]
    assert state.bundle_stats() == (2, 30)
    assert [s.bundle_digest for s in state.summaries()] == ["", "", "d2", ""]
    assert state.put_bundle("d0", bytes(40)) is True  # re-uploaded: now the newest
    assert state.prune(max_bundle_bytes=45) == 2  # d2 (20): 70 -> 50, still over; d3 (10): -> 40
    assert state.has_bundles(["d0", "d2", "d3"]) == ["d0"] and state.bundle_stats() == (1, 40)


def test_a_bundle_is_held_at_open_only_once_the_state_is_opened_again(tmp_path):
    """broker/bundles.py reads a bundle whole at its first fetch only when an earlier process
    stored it (its bytes were not hashed on their way in by this one)."""
    assert InMemoryState().bundle_held_at_open("d0") is False
    path = tmp_path / "s.db"
    st = SqliteState(path)
    try:
        st.put_bundle("d0", b"x" * 10)
        assert st.bundle_held_at_open("d0") is False and st.bundle_held_at_open("d1") is False
    finally:
        st.close()
    st = SqliteState(path)
    try:
        assert st.bundle_held_at_open("d0") is True
        st.put_bundle("d1", b"y" * 10)  # stored in this life
        assert st.bundle_held_at_open("d1") is False
    finally:
        st.close()


def test_a_bundle_from_a_process_whose_clock_ran_ahead_is_still_held_at_open(tmp_path, monkeypatch):
    """Not the wall clock: an earlier process whose clock ran ahead (an NTP step back across a
    restart, a backup from a host with a fast clock) stored it before this open all the same."""
    import time as time_module

    st = SqliteState(tmp_path / "s.db")
    real = time_module.time
    monkeypatch.setattr(time_module, "time", lambda: real() + 600)
    st.put_bundle("d0", b"x" * 10)
    monkeypatch.setattr(time_module, "time", real)
    st.close()
    st = SqliteState(tmp_path / "s.db")
    try:
        assert st.bundle_held_at_open("d0") is True
    finally:
        st.close()


def test_prune_bundles_budget_zero(state):
    state.put_bundle("d0", b"x")
    state.put_bundle("d1", b"")
    assert state.prune(max_bundle_bytes=0) == 1  # the empty bundle fits a budget of 0
    assert state.has_bundles(["d0", "d1"]) == ["d1"]


# ---------------------------------------------------------------- atomicity, threads

def test_put_summaries_credits_the_node_in_the_same_write(state):
    state.upsert_node(node("a", published=2))
    batch = [summ(prompt_id=f"p{i}") for i in range(3)]
    assert state.put_summaries(batch, node=node("a", published=2, round=4, last_seen=7.0)) == (3, 0)
    got = state.get_node("a")
    assert (got.published, got.round, got.last_seen) == (5, 4, 7.0)
    # a retried publish credits nothing more
    assert state.put_summaries(batch, node=node("a", published=got.published, round=4)) == (0, 3)
    assert state.get_node("a").published == 5
    # a bad node row writes none of the summaries either
    with pytest.raises((TypeError, ValueError)):
        state.put_summaries([summ(prompt_id="p9")], node=node("a", published="five"))
    assert state.summaries(prompt_ids=["p9"]) == [] and state.get_node("a").published == 5


def test_a_bad_row_writes_nothing_of_its_batch(state):
    state.put_summaries([summ(prompt_id="old")])
    bad = [summ(prompt_id="p0"), summ(prompt_id="p1"), summ(prompt_id="p2", lengths=[1, object()])]
    with pytest.raises(TypeError):
        state.put_summaries(bad)
    with pytest.raises(TypeError):
        state.put_summaries([summ(prompt_id="p3"), summ(prompt_id="p4", reward_mean="0.5")])
    with pytest.raises(ValueError):
        state.put_summaries([summ(prompt_id="p5"), summ(prompt_id="p6", n=2**64)])
    with pytest.raises(TypeError):
        state.put_matches([MatchRow(0, "r", "p", "s", 0), MatchRow(0, "r", "q", None, 0)])
    assert [s.prompt_id for s in state.summaries()] == ["old"] and state.matches() == []


def test_several_publishes_are_stored_at_once_each_with_its_own_outcome(state):
    """put_summary_blocks: each publish its result (first write wins, the node credited in
    the same write) or its error; one that fails does not stop the others; SQLite commits
    them together."""
    state.put_summaries([summ("b", 0, "p0")])
    for name in "abc":
        state.upsert_node(node(name, published=1))
    items = [(SummaryBlock.from_rows([summ("a", 0, f"p{i}") for i in range(3)]), node("a", published=1, round=2)),
             ("not a block", node("x")),
             (SummaryBlock.from_rows([summ("b", 0, "p0"), summ("b", 0, "p1")]), node("b", published=1)),
             (SummaryBlock.from_rows([summ("c", 0, "p0")]), None)]
    commits = getattr(state, "group_commits", None)
    out = state.put_summary_blocks(items)
    assert out[0] == (3, 0) and out[2] == (1, 1) and out[3] == (1, 0)
    assert isinstance(out[1], (TypeError, ValueError))
    if commits is not None:
        assert state.group_commits == commits + 1  # one transaction, one fsync, for the three
    assert (state.get_node("a").published, state.get_node("a").round) == (4, 2)
    assert state.get_node("b").published == 2 and state.get_node("c").published == 1
    held = {(s.node_id, s.prompt_id) for s in state.summaries()}
    assert held == {("a", "p0"), ("a", "p1"), ("a", "p2"), ("b", "p0"), ("b", "p1"), ("c", "p0")}
    assert state.put_summary_blocks([]) == []


def test_concurrent_publishers(state):
    errors = []

    def publish(t: int):
        try:
            for b in range(15):
                rows = [summ(f"n{t}", b, f"p{i}") for i in range(5)]
                assert state.put_summaries(rows) == (5, 0)
                assert state.put_summaries(rows[:2]) == (0, 2)
                state.update_compat(f"n{t}", "r", 0.5, 0.5, False)
                assert len(state.summaries(node_id=f"n{t}", round=b)) == 5
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(state.summaries()) == 4 * 15 * 5
    assert [c.groups for c in state.compat()] == [15] * 4


# ---------------------------------------------------------------- both implementations agree

_ids = st.sampled_from(["a", "b", "c"])
_prompts = st.sampled_from(["p0", "p1", "p2"])
_rounds = st.integers(0, 6)
# the awkward values often, any float sometimes
_floats = st.sampled_from([0.0, -0.0, 0.1, 1 / 3, -1e-300, 5e-324, float("nan"), float("inf")]) | st.floats()


def _obs(x):
    """A comparable view of results in which floats compare by repr (-0.0 != 0.0, nan == nan)."""
    if isinstance(x, float):
        return repr(x)
    if dataclasses.is_dataclass(x):
        return (type(x).__name__, _obs(dataclasses.astuple(x)))
    if isinstance(x, (list, tuple)):
        return [_obs(v) for v in x]
    return x


class SameBehaviour(RuleBasedStateMachine):
    """Random operations on both implementations give the same results and the same state."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.mem = InMemoryState()
        self.sql = SqliteState(os.path.join(self.dir, "s.db"))

    def both(self, method, *args, **kw):
        out = []
        for s in (self.mem, self.sql):
            try:
                out.append(("ok", _obs(getattr(s, method)(*args, **kw))))
            except (TypeError, ValueError) as e:
                out.append(("raised", type(e).__name__))
        assert out[0] == out[1], (method, args, kw, out)

    @rule(n=_ids, state=st.sampled_from(["online", "offline"]), r=_rounds, seen=_floats)
    def upsert_node(self, n, state, r, seen):
        self.both("upsert_node", node(n, state=state, round=r, last_seen=seen))

    @rule(r=_rounds, matched=st.none() | _floats)
    def put_round(self, r, matched):
        self.both("put_round", RoundRow(round=r, state="open" if matched is None else "matched",
                                        opened_at=1.0, matched_at=matched))

    @rule(rows=st.lists(st.builds(summ, _ids, _rounds, _prompts, reward_mean=_floats, k=st.integers(0, 4),
                                  mean_logprobs=st.lists(_floats, max_size=3)), max_size=4),
          credit=st.none() | _ids, base=st.integers(0, 5))
    def put_summaries(self, rows, credit, base):
        if credit is None:
            self.both("put_summaries", rows)
        else:  # the node's row (published += accepted) in the same transaction
            self.both("put_summaries", rows, node=node(credit, published=base))

    @rule(n=_ids, r=_rounds, p=_prompts, d=st.sampled_from(["d0", "d1", "d2"]))
    def set_bundle_digest(self, n, r, p, d):
        self.both("set_bundle_digest", n, r, p, d)

    @rule(rows=st.lists(st.builds(MatchRow, _rounds, _ids, _prompts, _ids, _rounds), max_size=3))
    def put_matches(self, rows):
        self.both("put_matches", rows)

    @rule(r=_rounds, data=st.sampled_from([b"s0", b"s1", b""]))
    def put_match_set(self, r, data):
        self.both("put_match_set", r, data)

    @rule(bundles=st.lists(st.tuples(st.sampled_from(["d0", "d1", "d2", "d3"]), st.binary(max_size=20),
                                     st.sampled_from([b"", b"sig1", b"sig2"]), st.sampled_from(["", "a", "b"])),
                           min_size=1, max_size=3))
    def put_bundles(self, bundles):
        for d, data, sig, uploader in bundles:
            self.both("put_bundle", d, data, signature=sig, signer_cert=sig and b"cert", node_id=uploader)

    @rule(rows=st.lists(st.builds(rep, _rounds, _ids, _ids, _prompts, _floats, st.floats(0, 1), st.booleans()),
                        max_size=4))
    def put_reports(self, rows):
        self.both("put_reports", rows)

    @rule(rows=st.lists(st.builds(rep, _rounds, _ids, _ids, _prompts, st.just(0.0), st.just(0.0), st.just(False),
                                  st.just(True)), max_size=3))
    def put_undelivered_reports(self, rows):
        self.both("put_reports", rows)

    @rule(s=_ids, r=_ids, mean_s=_floats, frac=st.floats(0, 1), rejected=st.booleans())
    def update_compat(self, s, r, mean_s, frac, rejected):
        self.both("update_compat", s, r, mean_s, frac, rejected)

    @rule(keep=st.none() | st.integers(1, 4), share=st.none() | st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]))
    def prune(self, keep, share):
        budget = None if share is None else int(self.mem.bundle_stats()[1] * share)  # a budget that bites
        self.both("prune", keep_rounds=keep, max_bundle_bytes=budget)

    @rule(keep=st.sampled_from([-1, 0, 2]), budget=st.sampled_from([-1, None]))
    def prune_refused(self, keep, budget):
        self.both("prune", keep_rounds=keep, max_bundle_bytes=budget)

    @rule(r=st.none() | _rounds, n=st.none() | _ids, p=st.none() | st.lists(_prompts, max_size=2),
          m=st.none() | _rounds)
    def query_summaries(self, r, n, p, m):
        self.both("summaries", round=r, node_id=n, prompt_ids=p, min_round=m)

    @rule(r=st.none() | _rounds, rec=st.none() | _ids, src=st.none() | _ids)
    def query_matches(self, r, rec, src):
        self.both("matches", round=r, receiver=rec, source=src)

    @invariant()
    def same_state(self):
        for method, args in (("list_nodes", ()), ("latest_round", ()), ("summaries", ()), ("matches", ()),
                             ("compat", ()), ("bundle_stats", ()), ("has_bundles", (["d3", "d2", "d1", "d0"],)),
                             ("reports", ())):
            self.both(method, *args)
        for d in ("d0", "d1", "d2", "d3"):
            self.both("bundle_provenance", d)
        for r in range(7):
            self.both("get_round", r)
            self.both("match_set", r)
        self.both("match_set_rounds")
        held = [s.node_id for s in self.mem.summaries()]
        for n in sorted(set(held)) + ["nobody"]:
            self.both("summaries_held", n)
            assert self.mem.summaries_held(n) == held.count(n)  # the quota's count is the rows held
        for n in ("a", "b", ""):
            self.both("bundle_bytes_held", n)

    def teardown(self):
        self.mem.close()
        self.sql.close()
        shutil.rmtree(self.dir)  # the database, its WAL and its bundles directory


test_implementations_agree = SameBehaviour.TestCase
test_implementations_agree.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- SQLite only

def _populate(s):
    s.upsert_node(node("a", last_seen=1 / 3))
    s.put_round(RoundRow(round=3, state="matched", opened_at=1.0, matched_at=2.5))
    s.put_summaries([summ(reward_mean=0.1, mean_logprobs=[-1e-300, -0.0]), summ(prompt_id="p1")])
    s.put_bundle("d0", b"bundle bytes", signature=b"sig", signer_cert=b"cert")
    s.set_bundle_digest("a", 0, "p0", "d0")
    s.put_matches([MatchRow(3, "a", "p0", "b", 2)])
    s.put_match_set(3, b"GFM1 a round's matching")
    s.update_compat("b", "a", 0.25, 0.5, False)
    s.update_compat("b", "a", 0.0, 0.0, True)
    s.put_reports([rep(round=3, receiver="a", source="b", mean_s=1 / 3)])


def _observe(s):
    return _obs([s.list_nodes(), s.get_round(3), s.latest_round(), s.summaries(), s.matches(), s.match_set(3),
                 s.match_set_rounds(), s.compat(),
                 s.bundle_stats(), s.get_bundle("d0"), s.bundle_provenance("d0"), s.reports()])


def test_sqlite_reopen_restores_everything(tmp_path):
    path = tmp_path / "b.db"
    mem, s = InMemoryState(), SqliteState(path)
    _populate(mem)
    _populate(s)
    s.close()
    s2 = SqliteState(str(path))
    try:
        assert _observe(s2) == _observe(mem)
        assert s2.put_summaries([summ()]) == (0, 1)  # idempotence survives the restart
        assert s2.put_reports([rep(round=3, receiver="a", source="b")]) == (0, 1)  # so does a report's
        assert s2._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s2._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    finally:
        s2.close()


def test_sqlite_survives_a_killed_process(tmp_path):
    path = tmp_path / "b.db"
    code = ("import os, sys\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from graft_fed.broker.state_sqlite import SqliteState\n"
            "from tests.broker.test_state import _populate\n"
            "s = SqliteState(sys.argv[1]); _populate(s)\n"
            "os._exit(0)  # no close(), no checkpoint: the writes live only in the WAL\n")
    subprocess.run([sys.executable, "-c", code, str(path), str(ROOT)], check=True, timeout=60, cwd=ROOT)
    mem = InMemoryState()
    _populate(mem)
    s = SqliteState(path)
    try:
        assert _observe(s) == _observe(mem)
    finally:
        s.close()


def test_sqlite_refuses_a_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(DataError, match="junk.db.*not a readable SQLite database"):
        SqliteState(path)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n" * 100)
    with pytest.raises(DataError, match="notes.txt"):
        SqliteState(text)
    with pytest.raises(DataError, match="cannot open|not a readable"):
        SqliteState(tmp_path)  # a directory
    with pytest.raises(DataError, match="cannot open|not a readable"):
        SqliteState(tmp_path / "missing" / "dir" / "b.db")


def test_sqlite_refuses_another_applications_database(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE users (id INTEGER)")
    c.close()
    with pytest.raises(DataError, match="not a graft-fed broker state.*users"):
        SqliteState(path)


def test_sqlite_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "b.db"
    SqliteState(path).close()
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    c.close()
    with pytest.raises(DataError, match=rf"b\.db.*schema version '{SCHEMA_VERSION + 1}'.*newer graft-fed: upgrade"):
        SqliteState(path)
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value = 'banana' WHERE key = 'schema_version'")
    c.close()
    with pytest.raises(DataError, match="banana.*Move the file aside"):
        SqliteState(path)


def _stored_blocks(s) -> list[bytes]:
    """The bytes of every summary block the state holds (in its row or in its round's file)."""
    return [s._block_data(*r) for r in s._conn.execute("SELECT node_id, round, data, file_offset, file_length, "
                                                        "file_crc FROM summary_blocks").fetchall()]


def _damage_blocks(s, node_id: str) -> None:
    """Damage the stored blocks of a node on disk: one byte of each changed in its round's file."""
    rows = s._conn.execute("SELECT round, file_offset FROM summary_blocks WHERE node_id = ?", (node_id,)).fetchall()
    assert rows and all(off >= 0 for _, off in rows)
    for rnd, off in rows:
        with open(os.path.join(s.blocks.path, f"r{rnd}"), "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def _as_version_10(c):
    """Turn a state file (open on connection `c`) back into schema version 10: a row per
    report instead of a block per receiver and round."""
    c.execute("CREATE TABLE reports (round INTEGER NOT NULL, receiver TEXT NOT NULL, source TEXT NOT NULL, "
              "prompt_id TEXT NOT NULL, mean_s NOT NULL, admitted_fraction NOT NULL, rejected INTEGER NOT NULL, "
              "undelivered INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (round, receiver, source, prompt_id))")
    for rnd, receiver, data in c.execute("SELECT round, receiver, data FROM report_blocks").fetchall():
        c.executemany("INSERT INTO reports VALUES (?,?,?,?,?,?,?,?)",
                      [(rnd, receiver, src, pid, "nan" if m != m else m, a, int(r), int(u))
                       for src, pid, m, a, r, u in decode_report_block(data)])
    c.execute("DROP TABLE report_blocks")
    c.execute("UPDATE meta SET value = '10' WHERE key = 'schema_version'")
    c.commit()


def test_sqlite_migrates_a_version_10_file_its_reports_into_blocks_that_still_count_once(tmp_path):
    s = SqliteState(tmp_path / "b.db")
    _populate(s)
    s.put_reports([rep(round=4, receiver="c", source="a", prompt_id=f"p{i}", mean_s=i / 7) for i in range(5)]
                  + [rep(round=4, receiver="c", source="b", prompt_id="p0", mean_s=0.0, admitted_fraction=0.0,
                         undelivered=True),
                     rep(round=4, receiver="c", source="b", prompt_id="p1", mean_s=0.0, rejected=True)])
    s.put_reports([rep(round=4, receiver="c", source="b", prompt_id="p2", mean_s=float("nan"))])  # a second report
    before = _observe(s)
    s = _reopened_from(s, _as_version_10)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert repr(_observe(s)) == repr(before)  # NaN included
        assert s._conn.execute("SELECT name FROM sqlite_master WHERE name = 'reports'").fetchall() == []
        assert s._conn.execute("SELECT round, receiver, count FROM report_blocks ORDER BY round, receiver"
                               ).fetchall() == [(3, "a", 1), (4, "c", 8)]  # one per receiver and round
        compat = s.compat()
        # what was reported before counts once; a new group joins the receiver's block
        assert s.put_reports([rep(round=4, receiver="c", source="a", prompt_id="p3", mean_s=0.5),
                              rep(round=4, receiver="c", source="a", prompt_id="p9", mean_s=0.5)]) == (1, 1)
        assert [(c.source, c.receiver, c.groups) for c in s.compat()] != [(c.source, c.receiver, c.groups)
                                                                          for c in compat]
        assert s._conn.execute("SELECT count FROM report_blocks WHERE round = 4").fetchall() == [(9,)]
    finally:
        s.close()


def _as_version_9(c):
    """Turn a state file (open on connection `c`) back into schema version 9: no bundle's
    uploader, no report or pair counting undelivered groups."""
    _as_version_10(c)
    c.execute("ALTER TABLE bundles DROP COLUMN node_id")
    c.execute("ALTER TABLE compat DROP COLUMN undelivered")
    c.execute("ALTER TABLE reports DROP COLUMN undelivered")
    c.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    c.commit()


def _reopened_from(s: SqliteState, convert) -> SqliteState:
    """`s`'s file turned back into an older schema by `convert(connection)`, then opened
    again (migrated)."""
    with sqlite3.connect(s.path) as c:
        convert(c)
        s.close()
    c.close()
    return SqliteState(s.path)


def test_sqlite_migrates_a_version_9_file_each_bundle_counted_for_the_node_it_is_attached_to(tmp_path):
    s = SqliteState(tmp_path / "b.db")
    _populate(s)  # d0 (12 bytes) attached to a's summary
    s.put_bundle("d9", b"unattached")
    before = _observe(s)
    s = _reopened_from(s, _as_version_9)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert _observe(s) == before
        assert s.bundle_bytes_held("a") == len(b"bundle bytes")  # an unattached bundle counts for nobody
        assert s._conn.execute("SELECT digest, node_id FROM bundles ORDER BY digest").fetchall() == [("d0", "a"),
                                                                                                      ("d9", "")]
    finally:
        s.close()


def _as_version_8(c):
    """Turn a state file (open on connection `c`) back into schema version 8: no node secrets."""
    _as_version_9(c)
    c.execute("DROP TABLE node_secrets")
    c.execute("UPDATE meta SET value = '8' WHERE key = 'schema_version'")
    c.commit()


def test_sqlite_migrates_a_version_8_file_no_node_id_held_yet(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    _populate(s)
    before = _observe(s)
    s = _reopened_from(s, _as_version_8)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert _observe(s) == before and s.node_secret("a") == ""
        s.set_node_secret("a", "f" * 64)
    finally:
        s.close()
    s = SqliteState(path)
    try:
        assert s.node_secret("a") == "f" * 64  # durable
    finally:
        s.close()


def _as_version_7(c):
    """Turn a state file (open on connection `c`) back into schema version 7: every summary
    block's bytes in its row (read from its round's file), the columns saying where they
    were and the block files' directory gone."""
    _as_version_8(c)
    path = c.execute("PRAGMA database_list").fetchone()[2]
    files = path + "-blocks"
    for rowid, rnd, off, length in c.execute("SELECT rowid, round, file_offset, file_length FROM summary_blocks "
                                             "WHERE file_offset >= 0").fetchall():
        with open(os.path.join(files, f"r{rnd}"), "rb") as f:
            f.seek(off)
            c.execute("UPDATE summary_blocks SET data = ? WHERE rowid = ?", (f.read(length), rowid))
    for col in ("file_offset", "file_length", "file_crc"):
        c.execute(f"ALTER TABLE summary_blocks DROP COLUMN {col}")
    c.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    c.commit()
    shutil.rmtree(files, ignore_errors=True)


def _as_version_6(c):
    """Turn a state file (open on connection `c`) back into schema version 6: every match set
    in the encoding it had then (b"GFM1": every array int32)."""
    _as_version_7(c)
    for round_, data in c.execute("SELECT round, data FROM match_sets").fetchall():
        if bytes(data[:4]) == b"GFM2":
            c.execute("UPDATE match_sets SET data = ? WHERE round = ?", (gfm1_bytes(MatchSet.from_bytes(data)), round_))
    c.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")


def _a_match_set(round_: int) -> MatchSet:
    k = np.array([[0, 3, 5], [2, 0, 0], [6, 1, 0]], dtype=np.int16)
    return MatchSet.from_choice(round_, ["a", "b", "c"], ["p2", "p0", "p1"], k,
                                [(np.array([0]), np.array([2])), (np.array([1, 2]), np.array([0, 0])),
                                 (np.array([2]), np.array([0]))])


def test_sqlite_migrates_a_version_6_file_its_old_match_sets_read_as_before(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    _populate(s)
    s.put_match_set(4, _a_match_set(4).to_bytes())
    before = _observe(s)
    rows = MatchSet.from_bytes(s.match_set(4)).rows()
    with sqlite3.connect(path) as c:
        _as_version_6(c)
        assert bytes(c.execute("SELECT data FROM match_sets WHERE round = 4").fetchone()[0][:4]) == b"GFM1"
        s.close()
    c.close()
    s = SqliteState(path)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert _observe(s) == before and MatchSet.from_bytes(s.match_set(4)).rows() == rows
        assert s.match_set(4)[:4] == b"GFM1"  # kept as it was
        s.put_match_set(5, _a_match_set(5).to_bytes())
        assert s.match_set(5)[:4] == b"GFM2" and MatchSet.from_bytes(s.match_set(5)).rows()[0].round == 5
    finally:
        s.close()


def _as_version_5(c):
    """Turn a state file (open on connection `c`) back into schema version 5: every summary
    block in the encoding it had then (b"GFS1": every integer column int64), every match set
    in b"GFM1"."""
    _as_version_6(c)
    for rowid, data in c.execute("SELECT rowid, data FROM summary_blocks").fetchall():
        b = SummaryBlock.from_bytes(data)
        head = json.dumps({"node_id": b.node_id, "round": b.round, "prompt_ids": b.prompt_ids,
                           "nl": int(b.lengths.size), "nm": int(b.mean_logprobs.size)}).encode()
        old = b"".join([b"GFS1", len(head).to_bytes(4, "little"), head] + [
            np.asarray(a).astype(t).tobytes() for a, t in (
                (b.policy_version, "<i8"), (b.n, "<i8"), (b.k, "<i8"), (b.reward_mean, "<f8"),
                (b.reward_std, "<f8"), (b.n_lengths, "<i8"), (b.n_logprobs, "<i8"), (b.lengths, "<i8"),
                (b.mean_logprobs, "<f8"))])
        c.execute("UPDATE summary_blocks SET data = ? WHERE rowid = ?", (old, rowid))
    c.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")


def test_sqlite_migrates_a_version_5_file_its_old_blocks_read_as_before(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    _populate(s)
    before = _observe(s)
    heads = s.summary_heads()
    with sqlite3.connect(path) as c:
        _as_version_5(c)
        assert {bytes(r[0][:4]) for r in c.execute("SELECT data FROM summary_blocks")} == {b"GFS1"}
        s.close()
    c.close()
    s = SqliteState(path)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert _observe(s) == before and s.summary_heads() == heads
        assert s.put_summaries([summ(prompt_id="fresh", round=7, lengths=[300, 70000])]) == (1, 0)
        magics = sorted(data[:4] for data in _stored_blocks(s))
        assert magics[-1] == b"GFS2" and magics[0] == b"GFS1"  # the new block narrow, the old ones as they were
        fresh = [r for r in s.summaries(round=7) if r.prompt_id == "fresh"]
        assert fresh[0].lengths == [300, 70000]
    finally:
        s.close()


def _as_version_4(c, parts: bool = False):
    """Turn a state file (open on connection `c`) back into schema version 4: the bytes of
    every bundle held as a file in bundles.data, or (`parts`) in rows of bundle_parts of
    3-byte chunks; no bundles directory."""
    _as_version_5(c)
    path = next(r[2] for r in c.execute("PRAGMA database_list") if r[1] == "main")
    files = path + "-bundles"
    for digest, in c.execute("SELECT digest FROM bundles WHERE in_file = 1").fetchall():
        data = open(os.path.join(files, file_name(digest)), "rb").read()
        if parts:
            (last,), = c.execute("SELECT COALESCE(MAX(parts), 0) + 1 FROM bundles").fetchall()
            c.executemany("INSERT INTO bundle_parts (parts, data) VALUES (?, ?)",
                          [(last, data[i:i + 3]) for i in range(0, len(data), 3)])
            c.execute("UPDATE bundles SET parts = ? WHERE digest = ?", (last, digest))
        else:
            c.execute("UPDATE bundles SET data = ? WHERE digest = ?", (data, digest))
    c.execute("ALTER TABLE bundles DROP COLUMN in_file")
    c.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    shutil.rmtree(files)


def _as_version_3(c):
    """Turn a state file (open on connection `c`) back into schema version 3: every bundle's
    bytes in bundles.data, no bundle_parts."""
    _as_version_4(c)
    for digest, parts in c.execute("SELECT digest, parts FROM bundles WHERE parts != 0").fetchall():
        data = b"".join(r[0] for r in c.execute("SELECT data FROM bundle_parts WHERE parts = ? ORDER BY id", (parts,)))
        c.execute("UPDATE bundles SET data = ? WHERE digest = ?", (data, digest))
    c.execute("DROP TABLE bundle_parts")
    c.execute("ALTER TABLE bundles DROP COLUMN parts")
    c.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


def _as_version_2(s, c):
    """Turn the file of SqliteState `s` (open on connection `c`) back into schema version 2:
    summaries as rows (lists as JSON), no match sets."""
    rows = s.summaries()  # (read by the current schema)
    _as_version_3(c)
    c.execute("""CREATE TABLE summaries (
        node_id TEXT NOT NULL, round INTEGER NOT NULL, prompt_id TEXT NOT NULL,
        policy_version INTEGER NOT NULL, n INTEGER NOT NULL, k INTEGER NOT NULL,
        reward_mean NOT NULL, reward_std NOT NULL, lengths TEXT NOT NULL, mean_logprobs TEXT NOT NULL,
        bundle_digest TEXT NOT NULL DEFAULT '', PRIMARY KEY (node_id, round, prompt_id))""")
    c.executemany("INSERT INTO summaries VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                  [(r.node_id, r.round, r.prompt_id, r.policy_version, r.n, r.k, r.reward_mean, r.reward_std,
                    json.dumps(r.lengths), json.dumps(r.mean_logprobs), r.bundle_digest) for r in rows])
    for table in ("match_sets", "summary_blocks", "summary_digests"):
        c.execute(f"DROP TABLE {table}")
    c.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def test_sqlite_migrates_a_version_1_file_in_place(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    _populate(s)
    before = s.summaries()
    with sqlite3.connect(path) as c:  # what graft-fed 0.1 (schema version 1) wrote
        _as_version_2(s, c)
        s.close()
        c.execute("DROP TABLE reports")
        c.execute("ALTER TABLE bundles DROP COLUMN signature")
        c.execute("ALTER TABLE bundles DROP COLUMN signer_cert")
        c.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    c.close()
    s = SqliteState(path)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert s.get_bundle("d0") == b"bundle bytes" and s.bundle_provenance("d0") == (b"", b"")  # kept, unsigned
        assert s.summaries() == before and s.reports() == [] and s.compat()[0].rejected == 1
        assert s.put_reports([rep(round=3, receiver="a", source="b")]) == (1, 0)
        assert s.put_bundle("d1", b"new", signature=b"sig", signer_cert=b"cert")
        assert s.bundle_provenance("d1") == (b"sig", b"cert")
    finally:
        s.close()


def test_sqlite_migrates_a_version_2_file_in_place(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    _populate(s)
    before = _observe(s)
    with sqlite3.connect(path) as c:  # schema version 2: summaries and matches as rows
        _as_version_2(s, c)
        s.close()
    c.close()
    s = SqliteState(path)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        after = _observe(s)
        assert after[:5] == before[:5] and after[7:] == before[7:]  # all but the match set
        assert s.summaries()[0].bundle_digest == "d0" and s.put_summaries([summ()]) == (0, 1)
        assert len(s.matches()) == 1 and s.match_set_rounds() == []
        assert s.put_match_set(3, b"set") and s.match_set(3) == b"set"
    finally:
        s.close()


def test_sqlite_batch_failing_midway_is_rolled_back(tmp_path, monkeypatch):
    s = SqliteState(tmp_path / "b.db")
    try:
        s.put_summaries([summ(prompt_id="old")])
        real, calls = SqliteState._insert_many, []

        def flaky(conn, head, width, rows):
            real(conn, head, width, rows)
            calls.append(len(rows))
            raise OSError("disk on fire")

        monkeypatch.setattr(SqliteState, "_insert_many", staticmethod(flaky))
        batch = [summ(prompt_id=f"p{i}", round=0 if i < 2 else 1) for i in range(5)]  # two blocks
        with pytest.raises(OSError, match="disk on fire"):
            s.put_summaries(batch)
        assert calls == [2, 2]  # both blocks had been inserted when it failed (and again, one call at a time)
        assert [r.prompt_id for r in s.summaries()] == ["old"]
        monkeypatch.undo()
        assert s.put_summaries(batch) == (5, 0)  # the state is usable
    finally:
        s.close()
    s = SqliteState(tmp_path / "b.db")
    try:
        assert len(s.summaries()) == 6
    finally:
        s.close()


def _group_of(s: SqliteState, calls: list[tuple[str, object]], results: dict[str, object]) -> None:
    """Run `calls` ((name, fn)) on threads so that the first leads a commit of its own and all
    the others queue behind it and share the next one (a commit under way is simulated by
    holding the state's lock); each result, or the exception raised, lands in `results`."""
    def run(name: str, fn) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - what the caller would see
            results[name] = exc

    deadline = time.monotonic() + 20
    with s._lock:
        threads = [threading.Thread(target=run, args=calls[0])]
        threads[0].start()
        while not s._group_leader or s._group:
            assert time.monotonic() < deadline, "the first call never led a group commit"
        for call in calls[1:]:
            threads.append(threading.Thread(target=run, args=call))
            threads[-1].start()
        while len(s._group) < len(calls) - 1:
            assert time.monotonic() < deadline, (f"{len(s._group)} of {len(calls) - 1} calls queued for the group "
                                                 "commit: the others wrote on their own")
    for t in threads:
        t.join(timeout=30)


def test_sqlite_group_commit_shares_one_transaction_and_isolates_failures(tmp_path, monkeypatch):
    """Publishes queued while a commit is under way share the next one; when a batched
    statement fails (not expected: the blocks were checked before), the group is written
    one publish at a time and only the publish that fails fails, with its own error; every
    other one is durable when it returns."""
    s = SqliteState(tmp_path / "g.db")
    real = SqliteState._insert_many
    statements: list[int] = []

    def insert(conn, head, width, rows):
        statements.append(len(rows))
        if "summary_blocks" in head and any(r[0] == "c" for r in rows):
            raise sqlite3.IntegrityError("this publish only")
        return real(conn, head, width, rows)

    monkeypatch.setattr(SqliteState, "_insert_many", staticmethod(insert))
    results: dict[str, object] = {}
    try:
        _group_of(s, [(name, (lambda name=name, prompts=prompts: s.put_summaries([summ(name, 0, p) for p in prompts])))
                      for name, prompts in (("lead", ["p0"]), ("b", ["p0", "p1"]), ("c", ["bad"]), ("d", ["p0"]),
                                            ("e", ["p2", "p3", "p4"]))], results)
        assert results["lead"] == (1, 0) and results["b"] == (2, 0) and results["d"] == (1, 0)
        assert results["e"] == (3, 0) and isinstance(results["c"], sqlite3.IntegrityError)
        assert str(results["c"]) == "this publish only"
        assert statements == [1, 4, 1, 1, 1, 1]  # the leader alone; the group of 4 batched, then one by one
        assert (s.group_commits, s.grouped_calls) == (2, 5)
    finally:
        s.close()
    s = SqliteState(tmp_path / "g.db")
    try:
        assert sorted((r.node_id, r.prompt_id) for r in s.summaries()) == [
            ("b", "p0"), ("b", "p1"), ("d", "p0"), ("e", "p2"), ("e", "p3"), ("e", "p4"), ("lead", "p0")]
    finally:
        s.close()


def test_sqlite_uploads_share_group_commits_with_each_other_and_with_publishes(tmp_path):
    """An upload's row and the attachment of its digest to its summary go through the same
    group commit as publishes: uploads queued while a commit is under way share the next
    one. A second upload of a digest in the group stores nothing; a digest for a summary the
    state does not hold is not attached."""
    import hashlib

    s = SqliteState(tmp_path / "g.db")
    try:
        s.put_summaries([summ("a", 0, f"p{i}") for i in range(3)])
        blobs = [f"bundle {i}".encode() for i in range(3)] + [b"bundle 0"]
        digests = [hashlib.sha256(b).hexdigest() for b in blobs]
        writers = []
        for b, d in zip(blobs, digests):
            w = s.begin_bundle()
            w.write(b)
            w.prepare(d)  # the file in place, as an upload's finish does before the broker's lock
            writers.append(w)
        results: dict[str, object] = {}
        calls = [("publish", lambda: s.put_summaries([summ("b", 0, "p0")]))]
        calls += [(f"row{i}", (lambda w=w, d=d: w.commit(d))) for i, (w, d) in enumerate(zip(writers, digests))]
        calls += [(f"attach{i}", (lambda i=i: s.set_bundle_digest("a", 0, f"p{i}", digests[i]))) for i in range(3)]
        calls += [("stray", lambda: s.set_bundle_digest("a", 0, "not-published", digests[0]))]
        both = s.begin_bundle()  # an upload's row and its digest, as one job
        both.write(b"bundle 3")
        both.prepare(hashlib.sha256(b"bundle 3").hexdigest())
        calls += [("both", lambda: both.commit_attached(hashlib.sha256(b"bundle 3").hexdigest(), b"", b"", "b", 0,
                                                        "p0"))]
        _group_of(s, calls, results)
        assert results["publish"] == (1, 0)
        assert sorted(results[f"row{i}"] for i in range(4)) == [False, True, True, True]  # bundle 0 twice: one stores
        assert results["row1"] is True and results["row2"] is True
        assert [results[f"attach{i}"] for i in range(3)] == [True, True, True] and results["stray"] is False
        assert results["both"] == (True, True)  # its digest on b's summary, the first call's publish
        assert (s.group_commits, s.grouped_calls) == (3, 11)  # the first put, the lead, then one group of 9
        assert {r.prompt_id: r.bundle_digest for r in s.summaries(node_id="a")} == {
            f"p{i}": digests[i] for i in range(3)}
        assert [s.get_bundle(d) for d in digests[:3]] == blobs[:3]
    finally:
        s.close()


def test_sqlite_an_upload_for_a_damaged_block_stores_nothing(tmp_path):
    """An upload whose summary's (node, round) holds a damaged block: the decoding error,
    and neither the bundle's row nor its file is left (its digest could not be attached)."""
    from graft_fed.federation.summaryblock import SummaryBlockError

    s = SqliteState(tmp_path / "g.db")
    try:
        s.put_summaries([summ("bad", 0, "p0")])
        _damage_blocks(s, "bad")
        w = s.begin_bundle()
        w.write(b"bytes")
        w.prepare("a" * 64)
        with pytest.raises(SummaryBlockError):
            w.commit_attached("a" * 64, b"", b"", "bad", 0, "p0")
        assert s.get_bundle("a" * 64) is None and os.listdir(s.files.path) == []
    finally:
        s.close()


def test_sqlite_group_commit_writes_a_group_in_a_few_statements(tmp_path):
    """However many publishes a group holds, its transaction runs the same few statements:
    BEGIN, a read of what their (node, round)s hold, INSERTs of the blocks, of the node rows,
    COMMIT (each step one statement per power of two of its rows). A publish whose stored block of the same node and round is damaged
    fails alone, with the decoding error, inside the same transaction."""
    from graft_fed.federation.summaryblock import SummaryBlock, SummaryBlockError

    s = SqliteState(tmp_path / "g.db")
    try:
        s.put_summaries([summ("bad", 0, "p0")])
        _damage_blocks(s, "bad")
        s.put_summaries([summ("twice", 0, "p0")], node=node("twice", published=0))
        seen: list[str] = []
        s._conn.set_trace_callback(seen.append)
        results: dict[str, object] = {}
        names = ["lead", "b", "bad", "c", "twice", "d", "e", "twice"]

        def call(i: int, name: str):
            block = SummaryBlock.from_rows([summ(name, 0, p) for p in (f"q{i}", "p0", "p1")])
            return lambda: s.put_summary_block(block, node=node(name, published=7))

        _group_of(s, [(f"{name}{i}", call(i, name)) for i, name in enumerate(names)], results)
        s._conn.set_trace_callback(None)
        assert isinstance(results["bad2"], SummaryBlockError)
        assert results["twice4"] == (2, 1) and results["twice7"] == (1, 2)  # q4, p1; then q7 (first write wins)
        assert all(results[f"{n}{i}"] == (3, 0) for i, n in enumerate(names) if n not in ("bad", "twice"))
        assert (s.group_commits, s.grouped_calls) == (4, 10)
        # each step is one statement per power of two of its rows (_spans): the second
        # group's six (node, round)s are read in two, its six blocks and six node rows
        # written in two each
        steps = [" ".join(q.split()[:3]) if q.startswith("INSERT") else q.split()[0] for q in seen]
        runs = [(step, sum(1 for _ in group)) for step, group in itertools.groupby(steps)]
        blocks, nodes = "INSERT INTO summary_blocks", "INSERT OR REPLACE"
        assert runs == [("BEGIN", 1), ("SELECT", 1), (blocks, 1), (nodes, 1), ("COMMIT", 1),
                        ("BEGIN", 1), ("SELECT", 2), (blocks, 2), (nodes, 2), ("COMMIT", 1)], seen
        rows = {r.node_id: r.published for r in s.list_nodes()}
        assert rows == {"lead": 10, "b": 10, "c": 10, "twice": 8, "d": 10, "e": 10}  # the later row of "twice" wins
        got = {(r.node_id, r.prompt_id) for r in s.summaries(node_id="twice")}
        assert got == {("twice", p) for p in ("p0", "p1", "q4", "q7")}
        assert [len(b) for b in _blocks(s, "twice")] == [1, 2, 1]  # seq 0, 1, 2 in one transaction
    finally:
        s.close()


def test_sqlite_statements_come_in_a_few_shapes_whatever_the_group(tmp_path):
    """The connection keeps every distinct statement it prepared (up to cached_statements);
    a group commit of any size writes and reads with statements of a few row counts only,
    so the cache, and the broker's SQLite memory, stop growing (issue 13)."""
    from graft_fed.broker.state_sqlite import _spans

    assert list(_spans(37, 199)) == [(0, 32), (32, 36), (36, 37)]
    assert list(_spans(400, 199)) == [(0, 199), (199, 398), (398, 400)] and list(_spans(0, 5)) == []
    s = SqliteState(tmp_path / "g.db")
    try:
        seen: set[str] = set()
        s._conn.set_trace_callback(lambda q: seen.add(f"{q[:20]} with {q.count('(')} parentheses"))
        conn = s._conn
        for count in range(1, 260):
            with s._lock:
                conn.execute("BEGIN IMMEDIATE")
                s._insert_many(conn, "INSERT INTO summary_blocks (node_id, round, seq, count, data) VALUES ", 5,
                               [(f"n{i}", 0, i, 1, b"x") for i in range(count)])
                s._held_many(conn, [(f"n{i}", 0) for i in range(count)])
                conn.execute("ROLLBACK")
        s._conn.set_trace_callback(None)
        inserts = {q for q in seen if q.startswith("INSERT")}
        selects = {q for q in seen if q.startswith("SELECT")}
        assert len(inserts) <= 9 and len(selects) <= 9, (sorted(inserts), sorted(selects))
    finally:
        s.close()


def _blocks(s: SqliteState, node_id: str) -> list:
    from graft_fed.federation.summaryblock import SummaryBlock

    return [SummaryBlock.from_bytes(s._block_data(*r)) for r in s._conn.execute(
        "SELECT node_id, round, data, file_offset, file_length, file_crc FROM summary_blocks WHERE node_id = ? "
        "ORDER BY round, seq", (node_id,)).fetchall()]


def test_sqlite_sigkill_between_the_group_insert_and_its_commit_loses_nothing_acknowledged(tmp_path):
    """A broker killed after a group's INSERTs ran but before its COMMIT: every publish
    acknowledged before is there, nothing of the interrupted group is (none of its callers
    had an answer), and the file reopens and takes the same publishes again."""
    path = tmp_path / "b.db"
    code = ("import os, signal, sys\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from graft_fed.broker.state_sqlite import SqliteState\n"
            "from tests.broker.test_state import node, summ\n"
            "s = SqliteState(sys.argv[1])\n"
            "assert s.put_summaries([summ('a', 0, 'p0'), summ('a', 0, 'p1')], node=node('a')) == (2, 0)\n"
            "real = SqliteState._write_jobs\n"
            "def write_then_die(self, conn, jobs):\n"
            "    real(self, conn, jobs)\n"
            "    assert conn.in_transaction\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "SqliteState._write_jobs = write_then_die\n"
            "s.put_summaries([summ('a', 0, 'p2'), summ('b', 0, 'p0')], node=node('a', published=2))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(ROOT)], timeout=60, cwd=ROOT)
    assert proc.returncode == -9
    s = SqliteState(path)
    try:
        assert [(r.node_id, r.prompt_id) for r in s.summaries()] == [("a", "p0"), ("a", "p1")]
        assert [(n.node_id, n.published) for n in s.list_nodes()] == [("a", 2)]
        assert s.put_summaries([summ("a", 0, "p1"), summ("a", 0, "p2"), summ("b", 0, "p0")]) == (2, 1)
    finally:
        s.close()


def test_matched_heads_join_matches_to_their_source_summaries(state):
    state.put_summaries([summ("b", 0, "p0", k=3), summ("b", 0, "p1", k=1), summ("c", 1, "p2", k=2)])
    state.set_bundle_digest("b", 0, "p1", "d" * 64)
    state.put_matches([MatchRow(0, "a", "p0", "b", 0), MatchRow(0, "a", "p1", "b", 0), MatchRow(1, "a", "p2", "c", 1),
                       MatchRow(1, "a", "p9", "c", 1), MatchRow(0, "c", "p0", "b", 0)])  # p9: no summary
    got = [(m.receiver, m.prompt_id, m.source, h.k, h.n, h.bundle_digest) for m, h in state.matched_heads(0, receiver="a")]
    assert got == [("a", "p0", "b", 3, 4, ""), ("a", "p1", "b", 1, 4, "d" * 64)]
    assert [m.prompt_id for m, _ in state.matched_heads(1, receiver="a")] == ["p2"]
    assert [(m.receiver, m.prompt_id) for m, _ in state.matched_heads(0, source="b")] == [
        ("a", "p0"), ("a", "p1"), ("c", "p0")]
    assert state.matched_heads(5) == []


def test_read_bundle_in_chunks(state):
    data = bytes(range(256)) * 1000
    state.put_bundle("d" * 64, data)
    assert state.bundle_size("d" * 64) == len(data) and state.bundle_size("e" * 64) is None
    chunks = [state.read_bundle("d" * 64, off, 4096) for off in range(0, len(data), 4096)]
    assert b"".join(chunks) == data and all(len(c) <= 4096 for c in chunks)
    assert state.read_bundle("d" * 64, len(data), 10) == b"" and state.read_bundle("d" * 64, 5, 0) == b""
    assert state.read_bundle("d" * 64, len(data) - 3, 10) == data[-3:]
    assert state.read_bundle("e" * 64, 0, 10) is None


def test_iter_bundle_streams_a_snapshot(state):
    data = bytes(range(256)) * 1000
    state.put_bundle("d" * 64, data)
    state.put_bundle("e" * 64, b"")
    chunks = state.iter_bundle("d" * 64, 4096)
    first = next(chunks)
    state.prune(max_bundle_bytes=0)  # pruned while being read: the reader finishes what it started
    rest = list(chunks)
    assert first + b"".join(rest) == data and all(len(c) == 4096 for c in rest[:-1])
    assert state.iter_bundle("d" * 64, 4096) is None and state.iter_bundle("f" * 64, 10) is None
    state.put_bundle("e" * 64, b"")
    assert list(state.iter_bundle("e" * 64, 10)) == [b""]


def test_bundle_written_a_chunk_at_a_time(state):
    """begin_bundle: nothing is held before the commit; the commit is put_bundle's (first
    upload wins, provenance included); an abort leaves nothing."""
    w = state.begin_bundle()
    for part in (b"abc", b"", b"defg", b"h"):
        w.write(part)
    assert state.has_bundles(["d" * 64]) == [] and state.bundle_stats() == (0, 0)
    assert w.commit("d" * 64, signature=b"sig", signer_cert=b"cert")
    w.abort()  # after a commit: changes nothing
    assert state.get_bundle("d" * 64) == b"abcdefgh" and state.bundle_stats() == (1, 8)
    assert state.read_bundle("d" * 64, 2, 4) == b"cdef" and state.read_bundle("d" * 64, 7, 9) == b"h"
    assert b"".join(state.iter_bundle("d" * 64, 2)) == b"abcdefgh"
    assert all(len(c) <= 2 for c in state.iter_bundle("d" * 64, 2))
    again = state.begin_bundle()
    again.write(b"other")
    assert not again.commit("d" * 64, signature=b"x")
    dropped = state.begin_bundle()
    dropped.write(b"zz")
    dropped.abort()
    assert state.get_bundle("d" * 64) == b"abcdefgh" and state.bundle_provenance("d" * 64) == (b"sig", b"cert")
    assert state.bundle_stats() == (1, 8) and state.has_bundles(["d" * 64, "e" * 64]) == ["d" * 64]
    if isinstance(state, SqliteState):  # one file: the duplicate's and the aborted upload's are gone
        assert sorted(os.listdir(state.files.path)) == ["d" * 64]
        state.prune(max_bundle_bytes=0)
        assert os.listdir(state.files.path) == [] and state.get_bundle("d" * 64) is None


def test_sqlite_upload_cut_off_by_a_crash_leaves_nothing(tmp_path):
    s = SqliteState(tmp_path / "b.db")
    s.put_bundle("d" * 64, b"kept")
    w = s.begin_bundle()
    w.write(b"x" * 100_000)
    # the broker dies mid-upload (a temporary file), and another dies between its file's
    # rename and its row's commit (a file no row names)
    with open(os.path.join(s.files.path, "f" * 64), "wb") as f:
        f.write(b"sealed, never committed")
    s.close()
    s = SqliteState(tmp_path / "b.db")
    try:
        assert os.listdir(s.files.path) == ["d" * 64]  # both swept at open
        assert s.bundle_stats() == (1, 4) and s.get_bundle("d" * 64) == b"kept"
        assert s.has_bundles(["f" * 64]) == []
        w = s.begin_bundle()
        w.write(b"new")
        assert w.commit("e" * 64) and s.get_bundle("e" * 64) == b"new"
    finally:
        s.close()


def test_sqlite_bundles_are_files_beside_the_database(tmp_path):
    """A bundle's bytes are a file named by its digest in <db>-bundles/ (other keys hashed:
    no key names a path outside it); reads of every kind come from it."""
    s = SqliteState(tmp_path / "b.db")
    try:
        data = bytes(range(256)) * 4096  # 1 MiB
        assert s.put_bundle("a" * 64, data) and s.put_bundle("../../escape", b"k")
        assert sorted(os.listdir(tmp_path / "b.db-bundles")) == sorted(["a" * 64, file_name("../../escape")])
        assert file_name("../../escape").startswith("k-") and len(file_name("../../escape")) == 66
        assert (tmp_path / "b.db-bundles" / ("a" * 64)).read_bytes() == data
        assert s._conn.execute("SELECT length(data), parts, in_file FROM bundles WHERE digest = ?",
                               ("a" * 64,)).fetchone() == (0, 0, 1)
        assert s.get_bundle("a" * 64) == data and s.bundle_size("a" * 64) == len(data)
        assert s.read_bundle("a" * 64, 1000, 7) == data[1000:1007] and s.read_bundle("a" * 64, len(data) - 2, 9) == \
            data[-2:] and s.read_bundle("a" * 64, len(data) + 5, 3) == b""
        chunks = list(s.iter_bundle("a" * 64, 300_000))
        assert b"".join(chunks) == data and [len(c) for c in chunks] == [300_000, 300_000, 300_000, 148_576]
        assert list(s.iter_bundle("../../escape", 4)) == [b"k"] and s.read_bundle("b" * 64, 0, 1) is None
        assert s.put_bundle("e" * 64, b"") and list(s.iter_bundle("e" * 64, 4)) == [b""]
        it = s.iter_bundle("a" * 64, 2**19)
        first = next(it)
        s.prune(max_bundle_bytes=0)  # retention deletes the file while a fetch reads it
        assert os.listdir(tmp_path / "b.db-bundles") == ["e" * 64]  # the empty bundle fits a budget of 0
        assert s.get_bundle("a" * 64) is None
        assert first + b"".join(it) == data  # the fetch that had it open reads it to the end
    finally:
        s.close()


def test_sqlite_a_bundle_whose_file_is_lost_is_dropped_at_open(tmp_path, caplog):
    """A row whose file is missing (a damaged volume, the database restored without its
    directory): reading it is NOT_FOUND (that bundle cannot be served) with the reason
    logged; the next open drops it, as retention would (its summaries lose the digest), and
    says so."""
    s = SqliteState(tmp_path / "b.db")
    s.put_summaries([summ(prompt_id="p0")])
    s.put_bundle("a" * 64, b"aaa")
    s.put_bundle("b" * 64, b"bbb")
    assert s.set_bundle_digest("a", 0, "p0", "a" * 64)
    os.unlink(tmp_path / "b.db-bundles" / ("a" * 64))
    try:
        for read in (lambda: s.get_bundle("a" * 64), lambda: s.read_bundle("a" * 64, 0, 1),
                     lambda: s.iter_bundle("a" * 64, 4)):
            with pytest.raises(NotFound, match="copy is damaged"):  # that bundle's failure, not the broker's
                read()
        assert "has a row but no file" in caplog.text
    finally:
        s.close()
    caplog.clear()
    (tmp_path / "b.db-bundles" / ("b" * 64)).write_bytes(b"bb")  # and one cut short
    s = SqliteState(tmp_path / "b.db")
    try:
        assert s.has_bundles(["a" * 64, "b" * 64]) == [] and s.summaries()[0].bundle_digest == ""
        assert "2 bundle(s) whose file is missing" in caplog.text and os.listdir(s.files.path) == []
        assert s.put_bundle("c" * 64, b"ccc")
        (tmp_path / "b.db-bundles" / ("c" * 64)).write_bytes(b"c")  # damaged while the broker runs
        with pytest.raises(NotFound, match="copy is damaged"):
            s.get_bundle("c" * 64)
        with pytest.raises(NotFound, match="copy is damaged"):
            b"".join(s.iter_bundle("c" * 64, 2))
        assert "shorter than its row says" in caplog.text
    finally:
        s.close()


def test_sqlite_refuses_to_start_when_its_bundles_directory_is_missing(tmp_path):
    """Rows name files in a directory that is not there (a volume not mounted, the database
    restored alone): the start stops and deletes nothing; an empty directory is the way to
    go on without those bundles."""
    s = SqliteState(tmp_path / "b.db")
    s.put_bundle("a" * 64, b"aaa")
    s.close()
    shutil.rmtree(tmp_path / "b.db-bundles")
    with pytest.raises(DataError, match=r"names 1 bundle\(s\) stored as files in .*b\.db-bundles.*create it empty"):
        SqliteState(tmp_path / "b.db")
    assert not (tmp_path / "b.db-bundles").exists()
    (tmp_path / "b.db-bundles").mkdir()
    s = SqliteState(tmp_path / "b.db")
    try:
        assert s.bundle_stats() == (0, 0)
    finally:
        s.close()


def test_sqlite_a_bundles_directory_it_cannot_write_to_stops_the_start(tmp_path):
    """Where the directory should be there is something the broker cannot write files into
    (here a file, which fails as a directory of another owner does for a broker not run as
    root): the start stops, naming the directory and what to check."""
    (tmp_path / "b.db-bundles").write_bytes(b"not a directory")
    with pytest.raises(DataError, match=r"b\.db-bundles.*cannot write there.*belong to the broker's user"):
        SqliteState(tmp_path / "b.db")


def test_sqlite_upload_disk_full_is_resource_exhausted_and_stores_nothing(tmp_path, monkeypatch):
    s = SqliteState(tmp_path / "b.db")
    try:
        w = s.begin_bundle()
        w.write(b"first")
        real = os.write

        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "write", full)
        with pytest.raises(StorageFull, match="storage is full"):
            w.write(b"second")
        monkeypatch.setattr(os, "write", real)
        w.abort()
        assert os.listdir(s.files.path) == [] and s.bundle_stats() == (0, 0)
        assert s.put_bundle("a" * 64, b"after") and s.get_bundle("a" * 64) == b"after"
    finally:
        s.close()


def test_sqlite_retention_leaves_the_file_of_an_upload_being_sealed(tmp_path, monkeypatch):
    """Upload B of a digest has put its file in place but not committed its row when upload
    A of the same digest commits, and retention then drops A's row: the file must stay (B's
    row is about to name it). Without the guard B commits a row with no file."""
    s = SqliteState(tmp_path / "b.db")
    try:
        b = s.begin_bundle()
        b.write(b"same bytes")
        b.prepare("a" * 64)  # B: renamed, row not yet written
        assert s.put_bundle("a" * 64, b"same bytes")  # A wins the row
        s.prune(max_bundle_bytes=0)  # retention drops A's row while B still holds its claim
        assert s.bundle_stats() == (0, 0) and os.listdir(s.files.path) == ["a" * 64]
        assert b.commit("a" * 64)  # B's row now names the file retention left
        assert s.get_bundle("a" * 64) == b"same bytes"
    finally:
        s.close()


def test_sqlite_retention_keeps_the_file_of_a_bundle_stored_again_while_it_prunes(tmp_path):
    """Uploads commit in group commits that do not wait for retention: between retention's
    commit (the rows dropped) and its deletion of a file, an upload of that digest may store
    a new row naming the file. Retention then leaves the file (without the check the bundle
    would have a row and no file: held, but unreadable)."""
    s = SqliteState(tmp_path / "b.db")
    try:
        blobs = {hashlib.sha256(b).hexdigest(): b for b in (b"old zero", b"old one")}
        for d, b in blobs.items():
            assert s.put_bundle(d, b)
        real_remove, again = s.files.remove, []

        def remove(digests):
            # retention has committed and deletes the first file (its lock is taken per file:
            # an upload can only come in between two): the other digest is stored again
            if not again:
                other = next(d for d in blobs if d not in digests)
                again.append(other)
                w = s.begin_bundle()
                w.write(blobs[other])
                w.prepare(other)
                assert w.commit(other)  # a fresh row naming the file retention is about to delete
            return real_remove(digests)
        s.files.remove = remove
        s.prune(max_bundle_bytes=0)
        assert s.has_bundles(list(blobs)) == again and s.get_bundle(again[0]) == blobs[again[0]]
        assert os.listdir(s.files.path) == [file_name(again[0])]
    finally:
        s.close()


def test_sqlite_retention_that_cannot_check_a_file_after_its_commit_leaves_it_to_the_sweep(tmp_path, monkeypatch):
    """Retention's rows are committed; if the state then fails to say whether a row names a
    file again, the file stays (the sweep at the next open deletes it) and retention still
    reports what it removed (so the broker still clears its round index)."""
    s = SqliteState(tmp_path / "b.db")
    try:
        assert s.put_bundle("a" * 64, b"bytes")

        def failing(digest):
            raise Unavailable("the broker's storage failed during a read: retry later")
        monkeypatch.setattr(s, "_names_file", failing)
        assert s.prune(max_bundle_bytes=0) == 1
        assert s.bundle_stats() == (0, 0) and os.listdir(s.files.path) == ["a" * 64]
    finally:
        s.close()
    s = SqliteState(tmp_path / "b.db")  # the sweep at open: a file no row names
    try:
        assert os.listdir(s.files.path) == []
    finally:
        s.close()


def test_sqlite_a_bundle_dropped_by_retention_before_its_upload_let_go_leaves_no_file(tmp_path):
    """Retention leaves the file of a claimed digest alone; when it drops the row of an upload
    between the upload's commit and the end of its claim, the upload deletes the file itself
    (else it would stay, named by no row, until the next open)."""
    s = SqliteState(tmp_path / "b.db")
    try:
        real_release = s._release

        def release(digest, stored):
            s.prune(max_bundle_bytes=0)  # the upload's row is committed; its claim not yet given up
            real_release(digest, stored)
        s._release = release
        w = s.begin_bundle()
        w.write(b"short-lived")
        w.prepare("a" * 64)
        assert w.commit("a" * 64)
        assert s.bundle_stats() == (0, 0) and os.listdir(s.files.path) == []
    finally:
        s.close()


def test_sqlite_an_upload_that_stores_nothing_leaves_no_file(tmp_path, monkeypatch):
    """After its file was put in place: a refused upload (abort), a failed row commit, and a
    duplicate of a bundle held in the database (schema 4) delete it; a duplicate of a bundle
    held as a file keeps it (it is that bundle's)."""
    s = SqliteState(tmp_path / "b.db")
    try:
        w = s.begin_bundle()
        w.write(b"refused")
        w.prepare("a" * 64)
        assert os.listdir(s.files.path) == ["a" * 64]
        w.abort()
        assert os.listdir(s.files.path) == [] and s.bundle_stats() == (0, 0)

        def full(*args):
            raise StorageFull("the broker's storage is full")
        monkeypatch.setattr(s, "_insert_file_row", full)
        w = s.begin_bundle()
        w.write(b"no room for its row")
        with pytest.raises(StorageFull):
            w.commit("b" * 64)
        assert os.listdir(s.files.path) == []
        w.abort()  # after a failed commit: nothing left to do
        monkeypatch.undo()

        s._conn.execute("INSERT INTO bundles (digest, data, size, created) VALUES (?, ?, 3, 0)", ("c" * 64, b"old"))
        w = s.begin_bundle()
        w.write(b"old")
        w.prepare("c" * 64)
        assert not w.commit("c" * 64) and os.listdir(s.files.path) == [] and s.get_bundle("c" * 64) == b"old"

        assert s.put_bundle("d" * 64, b"kept")
        w = s.begin_bundle()
        w.write(b"kept")
        w.prepare("d" * 64)
        assert not w.commit("d" * 64) and os.listdir(s.files.path) == ["d" * 64] and s.get_bundle("d" * 64) == b"kept"
    finally:
        s.close()


def test_sqlite_an_uploads_bytes_are_flushed_behind_its_writes(tmp_path, monkeypatch):
    """Once FLUSH_BEHIND bytes are unflushed, a background thread fdatasyncs the file while
    the upload goes on writing; sealing waits for that flush, then fsyncs the tail; an abort
    closes the file only after it. An upload under FLUSH_BEHIND flushes nothing behind, and
    a flush still queued behind other uploads' is dropped by the seal (its fsync covers it)."""
    s = SqliteState(tmp_path / "b.db")
    calls, release, started, seen = [], threading.Event(), threading.Event(), []
    real = os.fdatasync

    def part_inode() -> int:
        [part] = [e for e in os.scandir(s.files.path) if e.name.endswith(".part")]
        return part.inode()

    def slow_fdatasync(fd):
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(10)
        try:
            seen.append(os.fstat(fd).st_ino)  # still the upload's file: nobody closed it under the flush
        except OSError as exc:
            seen.append(exc)
        return real(fd)
    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    try:
        chunk = bytes(range(256)) * (bundlefiles.FLUSH_BEHIND // 256)
        w = s.begin_bundle()
        w.write(chunk)
        inode = part_inode()
        assert started.wait(10) and calls[0].startswith("bundle-flush")
        w.write(chunk)  # a flush is under way: no second one
        sealed = threading.Thread(target=w.prepare, args=("a" * 64,))
        sealed.start()
        sealed.join(0.2)
        assert sealed.is_alive() and os.listdir(s.files.path) != ["a" * 64]  # waits for the flush
        release.set()
        sealed.join(10)
        assert w.commit("a" * 64) and s.get_bundle("a" * 64) == chunk * 2 and len(calls) == 1
        assert seen == [inode]

        w = s.begin_bundle()
        w.write(chunk[:-1])
        assert w.commit("b" * 64) and len(calls) == 1  # under FLUSH_BEHIND: none

        release.clear()
        started.clear()
        w = s.begin_bundle()
        w.write(chunk)
        inode = part_inode()
        assert started.wait(10)
        threading.Timer(0.2, release.set).start()
        w.abort()  # waits for the flush under way before it closes the descriptor
        assert len(calls) == 2 and seen[1] == inode
        assert sorted(os.listdir(s.files.path)) == ["a" * 64, "b" * 64]

        release.clear()
        started.clear()
        monkeypatch.setattr(bundlefiles, "FLUSH_THREADS", 1)
        s.files.close()  # a pool of one thread from here on
        s.files._closed = False
        first, second = s.begin_bundle(), s.begin_bundle()
        first.write(chunk)
        assert started.wait(10)  # the one flush thread is busy with the first upload's
        second.write(chunk)  # its flush waits in the queue
        t0 = time.monotonic()
        assert second.commit("c" * 64) and time.monotonic() - t0 < 5  # dropped, not waited for
        assert len(calls) == 3
        release.set()
        assert first.commit("d" * 64) and len(calls) == 3
    finally:
        release.set()
        s.close()


@pytest.mark.parametrize("err, expected", [(errno.EIO, Unavailable), (errno.ENOSPC, StorageFull)])
def test_sqlite_a_failed_background_flush_fails_the_upload(tmp_path, monkeypatch, err, expected):
    """A write-back error seen by the background fdatasync is the upload's: Linux reports it
    to one fsync of the file, so the seal's own fsync could succeed on bytes never written.
    The next write or the seal raises it, and the file is gone."""
    s = SqliteState(tmp_path / "b.db")

    failed = threading.Event()

    def failing(fd):
        failed.set()
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(os, "fdatasync", failing)
    try:
        chunk = b"x" * bundlefiles.FLUSH_BEHIND
        for finish in ("write", "seal"):
            failed.clear()
            w = s.begin_bundle()
            w.write(chunk)  # starts the flush that fails
            assert failed.wait(10)  # (one not yet started is dropped by the seal: its fsync is the check)
            with pytest.raises(expected):
                if finish == "write":
                    for _ in range(100):  # the next write to find the flush done raises
                        w.write(chunk)
                        time.sleep(0.01)
                else:
                    w.commit("a" * 64)
            w.abort()
            assert os.listdir(s.files.path) == [] and s.get_bundle("a" * 64) is None
    finally:
        s.close()


def test_sqlite_bundle_reads_close_their_files(tmp_path):
    """No descriptor outlives a read: whole, a chunk, an iteration read to its end, closed
    half way or never started."""
    s = SqliteState(tmp_path / "b.db")
    try:
        assert s.put_bundle("a" * 64, bytes(10_000))
        before = open_under(tmp_path)  # the database's own files
        for _ in range(20):
            s.get_bundle("a" * 64)
            s.read_bundle("a" * 64, 5, 100)
            assert len(b"".join(s.iter_bundle("a" * 64, 3000))) == 10_000
            half = s.iter_bundle("a" * 64, 3000)
            next(half)
            half.close()
            s.iter_bundle("a" * 64, 3000)  # never started, dropped
        gc.collect()
        assert open_under(tmp_path) == before
    finally:
        s.close()


def _migrated(path, data: bytes, downgrade) -> SqliteState:
    """A state holding `data` as the signed bundle "d" * 64, turned into an older schema by
    `downgrade(connection)`, then opened again (and so migrated)."""
    s = SqliteState(path)
    s.put_bundle("d" * 64, data, signature=b"sig", signer_cert=b"cert")
    s.close()
    with sqlite3.connect(path) as c:
        downgrade(c)
    c.close()
    return SqliteState(path)


def test_sqlite_migrates_a_version_4_file_in_place(tmp_path):
    """Bundles of a version 4 file keep their bytes in bundle_parts and read as before; new
    ones are files; retention drops both."""
    data = bytes(range(256)) * 40
    s = _migrated(tmp_path / "b.db", data, lambda c: _as_version_4(c, parts=True))
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert s._conn.execute("SELECT COUNT(*) FROM bundle_parts").fetchone()[0] == len(range(0, len(data), 3))
        assert s.get_bundle("d" * 64) == data and s.bundle_provenance("d" * 64) == (b"sig", b"cert")
        assert b"".join(s.iter_bundle("d" * 64, 100)) == data and s.read_bundle("d" * 64, 10, 5) == data[10:15]
        assert s.put_bundle("e" * 64, b"new") and os.listdir(s.files.path) == ["e" * 64]
        s.prune(max_bundle_bytes=0)
        assert s.bundle_stats() == (0, 0) and os.listdir(s.files.path) == []
        assert s._conn.execute("SELECT COUNT(*) FROM bundle_parts").fetchone()[0] == 0
    finally:
        s.close()


def test_sqlite_migrates_a_version_3_file_in_place(tmp_path):
    """Bundles of a version 3 file keep their bytes in bundles.data and read as before."""
    data = bytes(range(256)) * 1000
    s = _migrated(tmp_path / "b.db", data, _as_version_3)
    try:
        assert s._conn.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        assert s.get_bundle("d" * 64) == data and s.bundle_provenance("d" * 64) == (b"sig", b"cert")
        assert b"".join(s.iter_bundle("d" * 64, 4096)) == data and s.read_bundle("d" * 64, 1000, 3) == data[1000:1003]
        assert s.put_bundle("e" * 64, b"new") and s.get_bundle("e" * 64) == b"new"
        assert s.bundle_stats() == (2, len(data) + 3)
        s.prune(max_bundle_bytes=3)
        assert s.has_bundles(["d" * 64, "e" * 64]) == ["e" * 64]
    finally:
        s.close()


def test_sqlite_a_match_set_whose_rounds_row_fails_is_not_stored(tmp_path, monkeypatch):
    s = SqliteState(tmp_path / "broker.db")
    try:
        def boom(conn, row):
            raise sqlite3.OperationalError("disk I/O error")
        monkeypatch.setattr(SqliteState, "_write_round", staticmethod(boom))
        with pytest.raises(Exception):
            s.put_match_set(4, b"four", round_row=RoundRow(4, "matched", 1.0, 2.0, ["a"]))
        monkeypatch.undo()
        assert s.match_set(4) is None and s.get_round(4) is None  # one transaction: neither
        assert s.put_match_set(4, b"four", round_row=RoundRow(4, "matched", 1.0, 2.0, ["a"])) is True
    finally:
        s.close()


def test_sqlite_checkpoints_run_in_a_thread_not_in_commits(tmp_path):
    """No commit checkpoints the WAL below the safety size; the state's checkpointer thread
    copies it into the database file once the WAL file reaches its threshold (and not
    before), and stops with the state."""
    s = SqliteState(tmp_path / "b.db")
    try:
        assert s._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == safety_pages(65536) == 4096
        s.checkpointer.stop()  # none in the background while the WAL fills
        for i in range(40):  # 80 MB: 1,280 pages of 64 KiB, past SQLite's default of 1,000
            s.put_match_set(i, bytes(2_000_000))
        probe = sqlite3.connect(tmp_path / "b.db", isolation_level=None)
        try:
            logged, done = s.checkpointer.run_once(probe)  # what the thread does every interval
            assert logged >= 40 * 31 and done == logged  # no commit had checkpointed (and reset) the WAL
        finally:
            probe.close()
    finally:
        s.close()
    s = SqliteState(tmp_path / "b.db")
    try:
        s.checkpointer.stop()
        # (checkpoints of a WAL that stopped growing: their own test, below)
        s.checkpointer = Checkpointer(s.path, threshold_bytes=3_000_000, poll_s=0.01, idle_bytes=1 << 40)
        time.sleep(0.05)
        s.put_match_set(98, bytes(200_000))
        s.put_match_set(99, bytes(200_000))
        time.sleep(0.2)
        assert s.checkpointer.runs == 0  # grown by less than the threshold: left alone
        s.put_match_set(100, bytes(3_000_000))
        deadline = time.monotonic() + 10
        while s.checkpointer.last[1] < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        # one checkpoint, or two when the first looked while the commit was still appending
        # its frames (it copies only committed ones; the rest count towards the next)
        assert 1 <= s.checkpointer.runs <= 2 and s.checkpointer.last[1] >= 50 and s.checkpointer.alive
        s.put_match_set(101, bytes(1000))  # the first write after a complete checkpoint starts the WAL over
        probe = sqlite3.connect(tmp_path / "b.db", isolation_level=None)
        try:
            assert probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1] <= 4  # frames in the WAL now
        finally:
            probe.close()
        assert s.checkpointer.wal_bytes() <= max(WAL_SIZE_LIMIT, 3_500_000)
        assert s.match_set(100) == bytes(3_000_000) and s.match_set(39) == bytes(2_000_000)
        # writes that never pause: a checkpoint per threshold of growth, not one per look
        stop = threading.Event()

        def writer():
            i = 1000
            while not stop.is_set():
                s.put_match_set(i, bytes(300_000))
                i += 1
        s.checkpointer.threshold_bytes = 30_000_000  # several polls' worth of this writer's pages
        looks, runs = s.checkpointer.looks, s.checkpointer.runs
        t = threading.Thread(target=writer)
        t.start()
        # at least a second, and until two checkpoints ran (a slow disk writes 30 MB later)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and (time.monotonic() - t0 < 1.0 or s.checkpointer.runs - runs < 2):
            time.sleep(0.05)
        stop.set()
        t.join()
        looks, runs = s.checkpointer.looks - looks, s.checkpointer.runs - runs
        assert 1 <= runs and 2 * runs <= looks, (runs, looks)
        assert s.checkpointer.failures == 0
    finally:
        s.close()
    assert not s.checkpointer.alive


def test_sqlite_a_commit_between_the_quiet_checkpoint_and_its_truncation_skips_the_truncation(tmp_path):
    """The TRUNCATE after a quiet checkpoint holds writers off while it runs; it only runs when
    nothing was committed since the PASSIVE one copied every frame (else it would copy the new
    frames with the writers held off). A commit in between starts the WAL over and cuts it to
    WAL_SIZE_LIMIT: the checkpointer sees the file's size change and leaves it at that."""
    s = SqliteState(tmp_path / "b.db")
    calls = []
    injected = threading.Event()

    class CommitInBetween(Checkpointer):
        def run_once(self, conn, mode="PASSIVE"):
            calls.append((mode, injected.is_set()))
            got = super().run_once(conn, mode)
            if not injected.is_set() and got[0] == got[1] > 0:  # everything copied ...
                s.put_match_set(9_999, b"in between")  # ... and then a commit
                injected.set()
            return got
    try:
        s.checkpointer.stop()
        s.checkpointer = cp = CommitInBetween(s.path, threshold_bytes=1 << 40, poll_s=0.1,
                                              idle_bytes=WAL_SIZE_LIMIT + (512 << 10))
        s.put_match_set(0, bytes(6_000_000))
        deadline = time.monotonic() + 20
        while not injected.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.6)  # six more looks: the file, cut to WAL_SIZE_LIMIT, is below idle_bytes
        # no TRUNCATE after the commit: the checkpoint that copied everything was the last
        assert injected.is_set() and calls[-1] == ("PASSIVE", False), calls
        assert cp.idle_runs >= 1 and cp.failures == 0 and 0 < cp.wal_bytes() <= WAL_SIZE_LIMIT
        assert s.match_set(9_999) == b"in between" and s.match_set(0) == bytes(6_000_000)
    finally:
        s.close()


def test_sqlite_a_wal_that_stopped_growing_is_checkpointed_once_and_starts_over(tmp_path):
    """A checkpoint by growth runs while commits append and leaves the last frames, so the
    WAL would never start over and would grow to the safety size, whose checkpoint some
    commit then runs. A WAL of at least idle_bytes that did not grow between two looks is
    checkpointed once and truncated, so that the next commit does not start it over.
    Smaller ones, and growing ones, are left to the threshold."""
    s = SqliteState(tmp_path / "b.db")
    try:
        s.checkpointer.stop()
        # looks far apart next to a commit, so that the writer below is never quiet for one
        s.checkpointer = cp = Checkpointer(s.path, threshold_bytes=1 << 40, poll_s=0.2, idle_bytes=3_000_000)
        s.put_match_set(0, bytes(1_000_000))
        time.sleep(0.5)
        assert cp.runs == 0  # quiet, but smaller than idle_bytes
        stop = threading.Event()

        def writer():
            i = 1
            while not stop.is_set():
                s.put_match_set(i, bytes(200_000))
                i += 1
                time.sleep(0.001)
        t = threading.Thread(target=writer)
        t.start()
        deadline = time.monotonic() + 10
        while cp.wal_bytes() < 3_500_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        t.join()
        while (cp.wal_bytes() or not cp.idle_runs) and time.monotonic() < deadline:
            time.sleep(0.01)
        # everything copied (PASSIVE), then the WAL truncated (TRUNCATE, nothing left to copy)
        assert cp.wal_bytes() == 0 and cp.last[0] == cp.last[1] and cp.failures == 0
        runs = cp.runs
        time.sleep(0.6)  # three more looks: nothing more to do
        # (a commit slower than a look could have let one run while the writer wrote)
        assert 1 <= cp.idle_runs and cp.runs == runs and 1 <= cp.truncations <= cp.idle_runs <= cp.runs
        s.put_match_set(10_000, bytes(1000))  # the WAL starts again from its beginning
        probe = sqlite3.connect(tmp_path / "b.db", isolation_level=None)
        try:
            assert probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1] <= 4
        finally:
            probe.close()
        assert cp.wal_bytes() <= WAL_SIZE_LIMIT
        assert s.match_set(0) == bytes(1_000_000) and s.match_set(10_000) == bytes(1000)
    finally:
        s.close()
    assert not s.checkpointer.alive


# ----- summary blocks as files (broker/blockfiles.py)
def _block_rows(s) -> list[tuple]:
    return s._conn.execute("SELECT node_id, round, seq, data, file_offset, file_length, file_crc FROM summary_blocks "
                           "ORDER BY round, node_id, seq").fetchall()


def _round_files(path) -> list[str]:
    """The round files of a blocks directory (not its .lock)."""
    return sorted(n for n in os.listdir(path) if n != blockfiles.LOCK_NAME)


def test_sqlite_summary_blocks_are_appended_to_their_rounds_files(tmp_path):
    """A publish's block is appended to its round's file in <db>-blocks/; its row holds where
    (offset, length, CRC-32) and no bytes; the state reads the same before and after a
    reopen."""

    path = tmp_path / "b.db"
    s = SqliteState(path)
    try:
        assert s.put_summaries([summ("a", 0, "p0"), summ("a", 0, "p1")]) == (2, 0)
        assert s.put_summaries([summ("b", 0, "p0")]) == (1, 0)
        assert s.put_summaries([summ("a", 1, "p0", k=3)]) == (1, 0)
        rows = _block_rows(s)
        assert _round_files(tmp_path / "b.db-blocks") == ["r0", "r1"]
        r0 = (tmp_path / "b.db-blocks" / "r0").read_bytes()
        assert [(r[0], r[1], r[4]) for r in rows] == [("a", 0, 0), ("b", 0, rows[0][5]), ("a", 1, 0)]
        assert all(r[3] == b"" for r in rows) and len(r0) == rows[0][5] + rows[1][5]
        for nid, rnd, _seq, _data, off, length, crc in rows:
            data = (tmp_path / "b.db-blocks" / f"r{rnd}").read_bytes()[off:off + length]
            assert zlib.crc32(data) == crc and SummaryBlock.from_bytes(data).node_id == nid
        before = (s.summaries(), s.summary_heads())
    finally:
        s.close()
    s = SqliteState(path)
    try:
        assert (s.summaries(), s.summary_heads()) == before
        assert [r.k for r in s.summaries(round=1)] == [3]
    finally:
        s.close()


def test_sqlite_bytes_no_row_names_are_cut_off_at_open(tmp_path):
    """What a crash leaves between a group's append and its commit (bytes past the last block
    a row names, the file of a round no row names) is gone after the next open, and what was
    acknowledged reads as before; the next publish goes after the last named block."""
    path = tmp_path / "b.db"
    s = SqliteState(path)
    try:
        s.put_summaries([summ("a", 0, "p0")])
        size = os.path.getsize(tmp_path / "b.db-blocks" / "r0")
        before = s.summaries()
    finally:
        s.close()
    with open(tmp_path / "b.db-blocks" / "r0", "ab") as f:
        f.write(b"half a block")
    (tmp_path / "b.db-blocks" / "r5").write_bytes(b"a round whose commit never happened")
    s = SqliteState(path)
    try:
        assert _round_files(tmp_path / "b.db-blocks") == ["r0"]
        assert os.path.getsize(tmp_path / "b.db-blocks" / "r0") == size
        assert s.summaries() == before
        assert s.put_summaries([summ("b", 0, "p0")]) == (1, 0)
        assert _block_rows(s)[1][4] == size and len(s.summaries(round=0)) == 2
    finally:
        s.close()


def test_sqlite_a_damaged_or_short_block_file_fails_only_its_round(tmp_path, caplog):
    """A block whose bytes no longer match its row's checksum, or that its file no longer
    holds (a damaged volume, a backup of the database newer than its block files'), reads as
    a damaged block (SummaryBlockError) for its round only; the open says which rounds."""
    from graft_fed.federation.summaryblock import SummaryBlockError

    path = tmp_path / "b.db"
    s = SqliteState(path)
    try:
        s.put_summaries([summ("a", 0, "p0")])
        s.put_summaries([summ("a", 1, "p0")])
        s.put_summaries([summ("a", 2, "p0")])
        _damage_blocks(s, "a")  # every round's block changed...
        with pytest.raises(SummaryBlockError, match=r"node 'a', round 0.*do not match the checksum"):
            s.summaries(round=0, node_id="a")
    finally:
        s.close()
    for rnd in (1, 2):  # ... rounds 1 and 2 restored from a good copy, then round 1 cut short, round 2 lost
        data = bytearray((tmp_path / "b.db-blocks" / f"r{rnd}").read_bytes())
        data[0] ^= 0xFF
        (tmp_path / "b.db-blocks" / f"r{rnd}").write_bytes(bytes(data))
    good = SqliteState(path)
    try:
        assert len(good.summaries(round=1)) == 1 and len(good.summaries(round=2)) == 1
    finally:
        good.close()
    with open(tmp_path / "b.db-blocks" / "r1", "r+b") as f:
        f.truncate(5)
    os.unlink(tmp_path / "b.db-blocks" / "r2")
    with caplog.at_level("ERROR", logger="graft_fed.broker"):
        s = SqliteState(path)
    try:
        assert "2 round(s) (1, 2)" in caplog.text and "b.db-blocks" in caplog.text
        with pytest.raises(SummaryBlockError, match=r"round 1: its file .* ends before"):
            s.summary_heads(round=1, node_id="a")
        with pytest.raises(SummaryBlockError, match=r"round 2: its file .* is missing"):
            s.summaries(round=2, node_id="a")
        assert s.put_summaries([summ("b", 3, "p0")]) == (1, 0) and len(s.summaries(round=3)) == 1
    finally:
        s.close()


def test_sqlite_a_database_restored_without_its_block_files_stops_the_start(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    s.put_summaries([summ("a", 0, "p0")])
    s.close()
    shutil.rmtree(tmp_path / "b.db-blocks")
    with pytest.raises(DataError, match=r"names summary blocks of 1 round\(s\) stored as files in .*b\.db-blocks"):
        SqliteState(path)
    assert not (tmp_path / "b.db-blocks").exists()  # nothing created, nothing deleted
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM summary_blocks").fetchone() == (1,)


def test_sqlite_retention_deletes_the_block_files_of_the_rounds_it_drops(tmp_path):
    s = SqliteState(tmp_path / "b.db")
    try:
        for r in range(4):
            s.put_round(RoundRow(round=r, state="matched", opened_at=0.0, matched_at=1.0))
            s.put_summaries([summ("a", r, "p0")])
        assert _round_files(s.blocks.path) == ["r0", "r1", "r2", "r3"]
        s.prune(keep_rounds=2)
        assert _round_files(s.blocks.path) == ["r2", "r3"]
        assert [x.round for x in s.summaries()] == [2, 3]
    finally:
        s.close()


def test_sqlite_reads_across_nodes_skip_a_damaged_block_and_log_it_once(tmp_path, caplog):
    """One damaged publish does not fail its round for everyone: a read of the round (every
    node's: the round index's rebuild, matching) skips it with an error in the log, once;
    the owner's own reads and writes of that round still fail with the damage."""
    from graft_fed.federation.summaryblock import SummaryBlockError

    s = SqliteState(tmp_path / "b.db")
    try:
        s.put_summaries([summ("a", 0, "p0"), summ("a", 0, "p1")])
        s.put_summaries([summ("b", 0, "p0")])
        _damage_blocks(s, "a")
        with caplog.at_level("ERROR", logger="graft_fed.broker"):
            assert [(h.node_id, h.prompt_id) for h in s.summary_heads(round=0)] == [("b", "p0")]
            assert [(x.node_id, x.prompt_id) for x in s.summaries(round=0)] == [("b", "p0")]
            assert [(x.node_id, x.prompt_id) for x in s.summaries()] == [("b", "p0")]
        damaged = [r for r in caplog.records if "reads across nodes skip it" in r.getMessage()]
        assert len(damaged) == 1 and "node 'a', round 0" in damaged[0].getMessage()
        with pytest.raises(SummaryBlockError, match="node 'a', round 0"):
            s.summaries(node_id="a")
        with pytest.raises(SummaryBlockError, match="node 'a', round 0"):
            s.put_summaries([summ("a", 0, "p2")])
    finally:
        s.close()


def test_sqlite_a_second_broker_on_the_same_state_is_refused(tmp_path):
    """Two brokers on one state would append at their own ends of a round's file, over each
    other's acknowledged blocks, and the second's sweep would cut what the first is about
    to commit: the second open stops, naming the cause; after the first closes it opens."""
    path = tmp_path / "b.db"
    first = SqliteState(path)
    try:
        first.put_summaries([summ("a", 0, "p0")])
        with pytest.raises(DataError, match=r"another broker process has this state open.*one broker per state"):
            SqliteState(path)
        assert first.put_summaries([summ("b", 0, "p0")]) == (1, 0)  # the first one is untouched
        assert len(first.summaries(round=0)) == 2
    finally:
        first.close()
    again = SqliteState(path)
    try:
        assert [x.node_id for x in again.summaries(round=0)] == ["a", "b"]
    finally:
        again.close()


def test_sqlite_a_short_block_file_is_appended_past_its_rows_never_over_them(tmp_path):
    """A round's file found short at open (a restored copy older than the database's): the
    next block of that round goes where the rows end (a hole before it), so the region an
    acknowledged row names is never written over; the damaged rows stay damaged, the new one
    reads back, also after a reopen."""
    from graft_fed.federation.summaryblock import SummaryBlockError

    path = tmp_path / "b.db"
    s = SqliteState(path)
    try:
        s.put_summaries([summ("a", 0, "p0")])
        s.put_summaries([summ("b", 0, "p0")])
        (_, _, _, _, a_off, a_len, _), (_, _, _, _, b_off, b_len, _) = _block_rows(s)
    finally:
        s.close()
    with open(tmp_path / "b.db-blocks" / "r0", "r+b") as f:
        f.truncate(a_off + a_len)  # b's block lost
    for _ in range(2):  # the second open finds the file short again (a hole is not b's bytes)
        s = SqliteState(path)
        try:
            with pytest.raises(SummaryBlockError, match="node 'b', round 0"):
                s.summaries(round=0, node_id="b")
            if len(_block_rows(s)) == 2:
                assert s.put_summaries([summ("c", 0, "p0")]) == (1, 0)
            c_off = _block_rows(s)[2][4]
            assert c_off == b_off + b_len  # after b's region, not over it
            assert [x.node_id for x in s.summaries(round=0)] == ["a", "c"]
        finally:
            s.close()


def test_sqlite_a_round_file_that_is_not_a_regular_file_stops_the_start(tmp_path):
    """A link or a directory where a round's file should be: the open stops and says so, and
    follows nothing (the link's target is not cut to the rows' end)."""
    path = tmp_path / "b.db"
    s = SqliteState(path)
    s.put_summaries([summ("a", 0, "p0")])
    s.close()
    r0 = tmp_path / "b.db-blocks" / "r0"
    victim = tmp_path / "victim"
    victim.write_bytes(r0.read_bytes() + b"x" * 1000)
    size = victim.stat().st_size
    r0.unlink()
    r0.symlink_to(victim)
    with pytest.raises(DataError, match=r"r0 is not a regular file"):
        SqliteState(path)
    assert victim.stat().st_size == size  # not cut to the rows' end
    r0.unlink()
    r0.mkdir()
    with pytest.raises(DataError, match=r"r0 is not a regular file"):
        SqliteState(path)


def test_block_files_fsync_the_directory_after_a_creation_only(tmp_path, monkeypatch):
    """A new round file's name is made durable (its directory fsynced) once; appends to a
    file that exists, also after a reopen, fsync no directory; a creation whose directory
    fsync failed is fsynced at the next append to it."""

    synced = []
    real = blockfiles.sync_dir
    monkeypatch.setattr(blockfiles, "sync_dir", lambda p: (synced.append(p), real(p)))
    files = blockfiles.BlockFiles(str(tmp_path / "blocks"))
    try:
        synced.clear()
        for _ in range(3):
            files.append([(r, b"x" * 10) for r in range(12)])
        assert len(synced) == 12
    finally:
        files.close()
    files = blockfiles.BlockFiles(str(tmp_path / "blocks"))
    try:
        synced.clear()
        files.append([(r, b"y") for r in range(12)])
        assert synced == []

        def fails(p):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(blockfiles, "sync_dir", fails)
        with pytest.raises(Exception, match="storage failed"):
            files.append([(20, b"z")])
        monkeypatch.setattr(blockfiles, "sync_dir", lambda p: (synced.append(p), real(p)))
        assert files.append([(20, b"z")]) == [(0, 1, zlib.crc32(b"z"))]
        assert len(synced) == 1
    finally:
        files.close()
    with pytest.raises(Exception, match="storage failed"):
        files.append([(0, b"after close")])


def test_sqlite_a_full_disk_under_a_publish_stores_nothing_and_the_next_one_goes_on(tmp_path, monkeypatch):
    """The block file's write fails (the disk is full): the publish is refused with
    StorageFull and stores nothing (no row, nor the node's); the next publish after the disk
    has room goes after what the failed write left, and is stored and reads back."""
    path = tmp_path / "b.db"
    s = SqliteState(path)
    try:
        s.put_summaries([summ("a", 0, "p0")])
        real = os.pwritev
        calls = []

        def full(fd, buffers, offset):
            calls.append(offset)
            real(fd, [b"".join(map(bytes, buffers))[:7]], offset)  # part of it went to disk
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(StorageFull, match="storage is full"):
            s.put_summaries([summ("b", 0, "p0")], node=node("b", published=0))
        monkeypatch.setattr(os, "pwritev", real)
        assert calls and [r[0] for r in _block_rows(s)] == ["a"] and s.get_node("b") is None
        assert s.put_summaries([summ("c", 0, "p0")]) == (1, 0)
        assert [(x.node_id, x.prompt_id) for x in s.summaries()] == [("a", "p0"), ("c", "p0")]
        (_, _, _, _, a_off, a_len, _), (_, _, _, _, c_off, c_len, _) = _block_rows(s)
        assert (a_off, c_off) == (0, a_len + 7)  # after the 7 bytes no row names
        end = c_off + c_len
    finally:
        s.close()
    s = SqliteState(path)
    try:
        assert os.path.getsize(tmp_path / "b.db-blocks" / "r0") == end
        assert [(x.node_id, x.prompt_id) for x in s.summaries()] == [("a", "p0"), ("c", "p0")]
    finally:
        s.close()


def test_block_files_write_a_block_given_as_buffers_whole_through_short_writes(tmp_path, monkeypatch):
    """A block handed over as the buffers of its encoding (SummaryBlock.to_parts) is stored
    as their concatenation, with its CRC, also when the system writes a few bytes at a time
    (a short write, which a full disk or a signal can cause): the rest follows from where
    it stopped, across buffer boundaries; a write that makes no progress is an error."""
    block = SummaryBlock.from_rows([summ("a", 3, f"p{i}") for i in range(5)])
    parts = block.to_parts()
    whole = block.to_bytes()
    assert len(parts) > 3 and b"".join(map(bytes, parts)) == whole
    real = os.pwritev
    sizes = []

    def short(fd, buffers, offset):
        data = b"".join(map(bytes, buffers))[:5]
        sizes.append(len(data))
        return real(fd, [data], offset)
    files = BlockFiles(str(tmp_path / "blocks"))
    try:
        assert files.append([(3, b"head")]) == [(0, 4, zlib.crc32(b"head"))]
        monkeypatch.setattr(os, "pwritev", short)
        assert files.append([(3, parts)]) == [(4, len(whole), zlib.crc32(whole))]
        assert len(sizes) == -(-len(whole) // 5)
        assert files.read(3, 4, len(whole), zlib.crc32(whole), "a block") == whole
        assert SummaryBlock.from_bytes(files.read(3, 4, len(whole), zlib.crc32(whole), "a block")).rows() == block.rows()
        monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: 0)
        with pytest.raises(Exception, match="storage failed during a write") as got:
            files.append([(3, parts)])
        assert "no progress" in str(got.value.__cause__)
    finally:
        files.close()


def test_sqlite_one_write_across_more_rounds_than_files_kept_open(tmp_path):
    """put_summaries of 20 rounds at once appends to 20 round files in one group (more than
    the few the state keeps open: none is closed while the group still writes it), and the
    next writes reopen the ones it closed after."""

    s = SqliteState(tmp_path / "b.db")
    try:
        rounds = range(2 * blockfiles._OPEN_FILES + 4)
        assert s.put_summaries([summ("a", r, "p0") for r in rounds]) == (len(rounds), 0)
        assert s.put_summaries([summ("b", r, "p0") for r in rounds]) == (len(rounds), 0)
        assert len(_round_files(s.blocks.path)) == len(rounds) and len(s.blocks._fds) <= blockfiles._OPEN_FILES
        assert sorted((x.node_id, x.round) for x in s.summaries()) == sorted((n, r) for n in "ab" for r in rounds)
    finally:
        s.close()


# ---------------------------------------------------------------- the federation a state belongs to

def manifest(**kw):
    from graft_fed.federation.manifest import Manifest

    base = dict(federation_id="fed-A", protocol_version=1, dataset_id="ds", dataset_hash="h" * 64, seed=0, n=8,
                prompts_per_round=4, mode="sync", verifier_name="math-verify", verifier_version="math-verify 1.0",
                staleness_rounds=2, advantage="group/std")
    base.update(kw)
    return Manifest(**base)


def test_a_state_is_bound_to_the_federation_it_was_first_used_for(state):
    """The identifying fields are stored at the first bind; a later manifest that differs in
    any of them is refused, naming each field with both values, and changes nothing; the
    operator's knobs and versions an upgrade moves may change."""
    state.bind_manifest(manifest())
    state.bind_manifest(manifest(mode="async", staleness_rounds=9, verifier_version="math-verify 2.0",
                                 protocol_version=2))
    with pytest.raises(DataError) as info:
        state.bind_manifest(manifest(federation_id="fed-B", n=4))
    message = str(info.value)
    assert "federation_id: the state has 'fed-A', the configuration 'fed-B'" in message
    assert "n: the state has 8, the configuration 4" in message and "seed" not in message
    assert "its rows were left as they were" in message and "new path" in message
    for field, value in [("dataset_id", "other"), ("dataset_hash", "0" * 64), ("seed", 1), ("prompts_per_round", 8),
                         ("verifier_name", "plugin"), ("advantage", "none/none")]:
        with pytest.raises(DataError, match=f"{field}: the state has"):
            state.bind_manifest(manifest(**{field: value}))
    state.bind_manifest(manifest())  # still bound to fed-A


def _bound_rows(path):
    return sqlite3.connect(path).execute("SELECT value FROM meta WHERE key = 'manifest'").fetchall()


def test_sqlite_a_state_of_another_federation_is_refused_after_a_restart(tmp_path):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    try:
        s.bind_manifest(manifest())
        s.put_summaries([summ("alice", 0, "p0", n=8, lengths=[3] * 8, mean_logprobs=[-0.5] * 8)])
    finally:
        s.close()
    stored = _bound_rows(path)
    assert json.loads(stored[0][0])["federation_id"] == "fed-A"
    s = SqliteState(path)
    try:
        with pytest.raises(DataError, match=r"broker state '.*b\.db' belongs to another federation .*"
                                            r"federation_id: the state has 'fed-A', the configuration 'fed-B'"):
            s.bind_manifest(manifest(federation_id="fed-B", n=4, seed=9))
        s.bind_manifest(manifest(mode="async"))
        assert len(s.summaries()) == 1
    finally:
        s.close()
    assert _bound_rows(path) == stored


def test_sqlite_a_state_from_before_manifests_adopts_the_first_one(tmp_path, caplog):
    """A database written before the manifest was stored holds rows and no manifest: it is
    not refused but adopts the broker's, says so, and is bound from then on."""
    path = tmp_path / "b.db"
    s = SqliteState(path)
    s.upsert_node(node("alice"))
    s.close()
    assert _bound_rows(path) == []
    s = SqliteState(path)
    try:
        with caplog.at_level("INFO", logger="graft_fed.broker"):
            s.bind_manifest(manifest())
        assert "holds rows but no manifest" in caplog.text and "federation_id='fed-A'" in caplog.text
    finally:
        s.close()
    s = SqliteState(path)
    try:
        with pytest.raises(DataError, match="federation_id"):
            s.bind_manifest(manifest(federation_id="fed-B"))
    finally:
        s.close()


# ---------------------------------------------------------------- a database lost beside its files

def _populated(path):
    s = SqliteState(path)
    try:
        s.put_summaries([summ("a", 0, "p0")])
        s.put_bundle("a" * 64, b"aaa")
    finally:
        s.close()
    return sorted(os.listdir(f"{path}-bundles")), _round_files(f"{path}-blocks")


@pytest.mark.parametrize("how", ["emptied", "deleted"])
def test_sqlite_a_new_database_beside_a_previous_states_files_stops_the_start(tmp_path, how):
    """The database gone (emptied or deleted, its -wal and -shm with it) and its bundle and
    block directories still there: the sweeps would take every file for a crash's leftover
    and delete it. The start stops instead, says what it found and what to do, and deletes
    nothing (nor leaves a database it created)."""
    path = tmp_path / "b.db"
    bundles, rounds = _populated(path)
    assert bundles == ["a" * 64] and rounds == ["r0"]
    for p in (path, f"{path}-wal", f"{path}-shm"):
        if os.path.exists(p):
            os.unlink(p)
    if how == "emptied":
        path.write_bytes(b"")
    for _ in range(2):  # a second try finds the same (the refused start wrote no schema)
        with pytest.raises(DataError) as info:
            SqliteState(path)
        message = str(info.value)
        assert "1 bundle file(s) in" in message and "b.db-bundles" in message
        assert "block files of 1 round(s)" in message and "b.db-blocks" in message
        assert "Nothing was deleted" in message and "from a backup" in message and "move both directories aside" \
            in message
        assert sorted(os.listdir(f"{path}-bundles")) == bundles and _round_files(f"{path}-blocks") == rounds
        assert os.path.exists(path) == (how == "emptied")
    os.rename(f"{path}-bundles", tmp_path / "old-bundles")  # the way on, with an empty state
    os.rename(f"{path}-blocks", tmp_path / "old-blocks")
    s = SqliteState(path)
    try:
        assert s.bundle_stats() == (0, 0) and _round_files(f"{path}-blocks") == []
    finally:
        s.close()


def test_sqlite_a_new_database_beside_empty_directories_starts(tmp_path):
    path = tmp_path / "b.db"
    SqliteState(path).close()
    for p in (path, f"{path}-wal", f"{path}-shm"):
        if os.path.exists(p):
            os.unlink(p)
    s = SqliteState(path)  # the directories hold nothing of a state (the blocks' .lock only)
    try:
        assert s.bundle_stats() == (0, 0)
    finally:
        s.close()


# ---------------------------------------------------------------- permissions

def test_sqlite_the_database_and_its_wal_are_created_0600(tmp_path):
    """The database holds live session ids: only the broker's user may read it, whatever
    the umask; SQLite gives the -wal and -shm files the database's mode."""
    old = os.umask(0)
    try:
        s = SqliteState(tmp_path / "b.db")
    finally:
        os.umask(old)
    try:
        s.upsert_node(node("a"))
        for name in ("b.db", "b.db-wal", "b.db-shm"):
            assert oct(os.stat(tmp_path / name).st_mode & 0o777) == oct(0o600), name
    finally:
        s.close()


def test_sqlite_an_existing_database_readable_by_others_is_tightened(tmp_path, caplog):
    path = tmp_path / "b.db"
    s = SqliteState(path)
    s.upsert_node(node("a", session_id="live"))
    s.close()
    os.chmod(path, 0o644)
    with caplog.at_level("WARNING", logger="graft_fed.broker"):
        s = SqliteState(path)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert "mode 0644 let other users read it" in caplog.text and "tightened to 0600" in caplog.text
        assert os.stat(f"{path}-wal").st_mode & 0o777 == 0o600 and s.get_node("a").session_id == "live"
    finally:
        s.close()


def test_sqlite_a_database_it_can_only_read_is_a_permission_problem_not_damage(tmp_path, monkeypatch):
    """SQLite opens a file it may not write read-only without a word (its mode, its owner, a
    read-only mount): the open says it is a permission problem and never advises moving the
    data aside. Here the read-only open is forced (the tests run as root, whom modes do not
    stop)."""
    path = tmp_path / "b.db"
    _populated(path)
    before = path.read_bytes()
    real = sqlite3.connect

    def read_only(database, *args, **kw):
        return real(f"file:{database}?mode=ro", *args, uri=True, **kw)

    monkeypatch.setattr(sqlite3, "connect", read_only)
    with pytest.raises(DataError) as info:
        SqliteState(path)
    message = str(info.value)
    assert "permission or mount problem, not damage" in message and "nothing was changed" in message
    assert "readonly" in message and "aside" not in message and "backup" not in message
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(f"{path}-bundles") == ["a" * 64]


def test_sqlite_a_database_on_a_read_only_mount_is_a_mount_problem_not_damage(tmp_path):
    """The same on a real read-only bind mount (in a mount namespace of its own): skipped
    where the tests may not create one."""
    d = tmp_path / "ro"
    d.mkdir()
    _populated(d / "b.db")
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount --bind {d} {d} && mount -o remount,ro,bind {d} {d}"],
            capture_output=True).returncode != 0:
        pytest.skip("no read-only bind mount here (needs unshare -m and mount)")
    code = ("from graft_fed.broker.state_sqlite import SqliteState\n"
            "from graft_fed.errors import DataError\n"
            "try:\n    SqliteState(%r)\nexcept DataError as e:\n    print(e)\n" % str(d / "b.db"))
    out = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {d} {d} && mount -o remount,ro,bind {d} {d} "
                          f"&& exec {sys.executable} -c \"$0\"", code], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert "read-only mount" in out.stdout and "permission or mount problem" in out.stdout, out.stdout + out.stderr
    assert "aside" not in out.stdout


@pytest.mark.parametrize("damage", ["CAST('{\"v\":1,\"sources\":[' AS BLOB)", "'stored as text'", "x'00'"])
def test_sqlite_a_damaged_report_block_is_logged_and_read_as_empty(tmp_path, caplog, damage):
    s = SqliteState(tmp_path / "b.db")
    try:
        s.put_reports([rep(round=1, receiver="a", source="b", prompt_id=f"p{i}") for i in range(3)])
        s.put_reports([rep(round=1, receiver="c", source="b", prompt_id="p0")])
        s.put_reports([rep(round=1, receiver="a", source="b", prompt_id="p3")])
        assert s._conn.execute("SELECT COUNT(*) FROM report_blocks").fetchone() == (2,)  # a block per receiver
        with s._lock:
            s._conn.execute(f"UPDATE report_blocks SET data = {damage} WHERE receiver = 'a'")
        assert [(r.receiver, r.prompt_id) for r in s.reports()] == [("c", "p0")]
        assert "the reports of a for round 1 are damaged" in caplog.text
        # what the damaged block held is lost: reported again, it counts (its pair's row already did)
        assert s.put_reports([rep(round=1, receiver="a", source="b", prompt_id="p0")]) == (1, 0)
        assert [(r.receiver, r.prompt_id) for r in s.reports()] == [("a", "p0"), ("c", "p0")]
    finally:
        s.close()


def test_sqlite_a_report_reads_one_block_however_many_reports_came_before(tmp_path):
    """A receiver may send a report per group: each one decoded every block before it
    (quadratic, under the state's lock). Its reports of a round are one block, rewritten."""
    s = SqliteState(tmp_path / "b.db")
    try:
        for i in range(300):
            assert s.put_reports([rep(round=2, receiver="a", source="b", prompt_id=f"p{i}")]) == (1, 0)
        assert s._conn.execute("SELECT count FROM report_blocks").fetchall() == [(300,)]
        assert s.put_reports([rep(round=2, receiver="a", source="b", prompt_id=f"p{i}") for i in range(301)]) == \
            (1, 300)
        assert len(s.reports(round=2, receiver="a")) == 301
    finally:
        s.close()


def test_sqlite_migrating_reports_holds_one_receiver_and_round_at_a_time(tmp_path):
    import tracemalloc

    peaks = []
    for rounds in (4, 16):
        s = SqliteState(tmp_path / f"b{rounds}.db")
        for r in range(rounds):
            s.put_reports([rep(round=r, receiver="a", source="b", prompt_id=f"p{i:04d}") for i in range(500)])
        with sqlite3.connect(s.path) as c:
            _as_version_10(c)
        s.close()
        c.close()
        tracemalloc.start()
        s = SqliteState(tmp_path / f"b{rounds}.db")  # migrates
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(s.reports()) == 500 * rounds
        s.close()
    assert peaks[1] < 1.5 * peaks[0], peaks  # four times the rows, not four times the memory


def _block(n, header, tail):
    import struct
    head = json.dumps(header).encode()
    return struct.pack("<4sII", b"GFR1", n, len(head)) + head + tail


@pytest.mark.parametrize("data", [
    b"", b"GFR", b"\xff\xfe\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", b"GFR1" + bytes(8) + b"x",
    _block(1, {"sources": ["a"], "prompt_ids": ["p"]}, bytes(21)),  # one byte short
    _block(1, {"sources": ["a"], "prompt_ids": ["p"]}, bytes(23)),  # one byte too many
    _block(1, {"sources": ["a"], "prompt_ids": ["p"]}, (1).to_bytes(4, "little") + bytes(18)),  # source 1 of 1
    _block(1, {"sources": ["a"], "prompt_ids": [7]}, bytes(22)),
    _block(1, {"sources": ["a"]}, bytes(22)),
    _block(1, {"sources": ["a"], "prompt_ids": ["p"]}, bytes(20) + b"\x02\x00"),  # a flag of 2
    b"GFR1" + (1).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"{x}" + bytes(22),
    b"GFR1" + (0).to_bytes(4, "little") + (200_000).to_bytes(4, "little") + b"[" * 100_000 + b"]" * 100_000,
    "a block stored as text"])
def test_a_report_block_that_is_not_what_this_code_wrote_is_a_value_error(data):
    with pytest.raises(ValueError, match="a report block"):
        decode_report_block(data)


def test_a_report_block_round_trips_its_entries_exactly():
    entries = [("b", "p1", 1 / 3, 0.25, False, False), ("a", "p0", 0.0, 0.0, False, True),
               ("b", "p\u00e9\x00\n", float("inf"), 1.0, True, False), ("c", "p2", float("nan"), -0.0, False, False),
               ("\u2028", "p3", 5e-324, 1.0, False, False)]
    out = decode_report_block(encode_report_block(entries))
    assert repr(out) == repr(entries)
    assert [math.copysign(1, e[3]) for e in out] == [math.copysign(1, e[3]) for e in entries]  # -0.0 kept
    assert decode_report_block(encode_report_block([])) == []


def test_report_segments_of_a_report_as_columns_are_those_of_its_rows_or_the_same_error():
    from graft_fed.broker.state_rows import report_fields, report_segments

    def cols(**over):
        base = dict(round=3, receiver="r", sources=["a", "b"], prompt_ids=["p0", "p1"], mean_s=[0.5, 0.0],
                    admitted_fraction=[1.0, 0.0], rejected=[False, False], undelivered=[False, True])
        base.update(over)
        return ReportRows(**base)

    def rowwise(rows):
        try:
            return [report_fields(r) for r in rows]
        except (TypeError, ValueError) as exc:
            return type(exc)

    def fast(rows):
        try:
            return [(rnd, receiver, *e) for rnd, receiver, c in report_segments(rows) for e in zip(*c)]
        except (TypeError, ValueError) as exc:
            return type(exc)

    cases = [cols(), cols(mean_s=[np.float64(0.5), 0.0]), cols(admitted_fraction=[1, 0.0]), cols(round=np.int64(3)),
             cols(sources=["a\u00e9", "b"]), cols(prompt_ids=["p0", "\ud800"]), cols(rejected=[0, False]),
             cols(undelivered=[False, 1]), cols(mean_s=[0.5, 0.25]), cols(rejected=[False, True]),
             cols(admitted_fraction=[1.0, 0.5]), cols(receiver=7), cols(round=2**63), cols(sources=["a", None]),
             cols(mean_s=[float("nan"), 0.0]), cols(sources=[], prompt_ids=[], mean_s=[], admitted_fraction=[],
                                                    rejected=[], undelivered=[])]
    for rows in cases:
        assert repr(fast(rows)) == repr(rowwise(rows)), rows
    assert fast(cases[0]) == [(3, "r", "a", "p0", 0.5, 1.0, False, False), (3, "r", "b", "p1", 0.0, 0.0, False, True)]
    # a plain report is one run whose columns are the report's own (nothing copied)
    (seg,) = report_segments(cases[0])
    assert seg[:2] == (3, "r") and seg[2].sources is cases[0].sources and seg[2].mean_s is cases[0].mean_s
    # rows of several (round, receiver)s: one run per stretch of the same, in the rows' order
    mixed = [ReportRow(0, "a", "s", "p0", 0.5, 1.0, False), ReportRow(0, "a", "s", "p1", 0.5, 1.0, False),
             ReportRow(1, "a", "s", "p0", 0.25, 1.0, False), ReportRow(0, "a", "t", "p2", 0.0, 0.0, True)]
    assert [(rnd, receiver, c.prompt_ids) for rnd, receiver, c in report_segments(mixed)] == [
        (0, "a", ["p0", "p1"]), (1, "a", ["p0"]), (0, "a", ["p2"])]
    assert fast(mixed) == rowwise(mixed)


def test_reports_as_columns_count_once_in_sqlite_as_in_memory_whatever_repeats(tmp_path):
    # the SQLite state takes a ReportRows (the broker's reports) a column at a time, adding a
    # report whose groups are all new to its block whole; every other case picks the new
    # groups one by one. Random batches of reports that repeat groups within a report, across
    # the reports of one commit and across commits, and mix in plain rows (some of two rounds
    # in one call), end with the same reports and the same compatibility rows, bit for bit,
    # in both states
    rng = random.Random(11)
    mem, sql = InMemoryState(), SqliteState(tmp_path / "b.db")
    receivers, sources, prompts = ["r0", "r1", "r2"], ["s0", "s1", "s2", "s3"], [f"p{i}" for i in range(12)]

    def report(rnd, receiver):
        keys = [(rng.choice(sources), rng.choice(prompts)) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.5:  # a report of distinct groups, as the broker's intake passes them
            keys = list(dict.fromkeys(keys))
        rejected = [rng.random() < 0.2 for _ in keys]
        undelivered = [not r and rng.random() < 0.2 for r in rejected]
        mean_s = [0.0 if r or u else rng.random() * 3 for r, u in zip(rejected, undelivered)]
        admitted = [0.0 if u else rng.random() for u in undelivered]
        rows = ReportRows(rnd, receiver, [k[0] for k in keys], [k[1] for k in keys], mean_s, admitted, rejected,
                          undelivered)
        return rows if rng.random() < 0.8 else list(rows)

    def mixed(receiver):  # one call's rows of two rounds, the first round's again after the second's
        first, second = list(report(0, receiver)), list(report(1, receiver))
        return first + second + first[::-1]

    for _ in range(40):
        batch = [report(rng.randrange(3), rng.choice(receivers)) if rng.random() < 0.8 else mixed(rng.choice(receivers))
                 for _ in range(rng.randrange(1, 5))]
        assert sql.put_report_batches(batch) == mem.put_report_batches(batch)
    assert repr(sql.reports()) == repr(mem.reports()) and len(mem.reports()) > 50
    assert repr(sql.compat()) == repr(mem.compat())
    sql.close()
    again = SqliteState(tmp_path / "b.db")  # and as stored
    assert repr(again.reports()) == repr(mem.reports()) and repr(again.compat()) == repr(mem.compat())
    again.close()


def _one_report(prompt_id, receiver="r"):
    return ReportRows(0, receiver, ["s"], [prompt_id], [0.5], [1.0], [False], [False])


def test_a_report_whose_columns_grew_unevenly_after_it_was_made_is_read_as_its_rows(state):
    # a ReportRows checks its columns' lengths when it is made; the lists stay the caller's.
    # One grown since is read as its rows are (the shortest column), never stored as a block
    # of columns of different lengths (which would read back as damaged)
    assert state.put_reports(_one_report("earlier")) == (1, 0)
    rows = _one_report("p1")
    rows.sources.append("t")
    assert state.put_reports(rows) == (1, 0)
    assert [r.prompt_id for r in state.reports()] == ["earlier", "p1"]


def test_sqlite_an_empty_report_reads_no_block(tmp_path, caplog):
    s = SqliteState(tmp_path / "b.db")
    s.put_reports(_one_report("p0"))
    with s._lock:
        s._conn.execute("UPDATE report_blocks SET data = x'00'")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="graft_fed.broker"):
        assert s.put_reports(ReportRows(0, "r", [], [], [], [], [], [])) == (0, 0)
    assert "damaged" not in caplog.text  # nothing to add: the block was not even read
    s.close()
