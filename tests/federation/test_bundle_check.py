"""The broker's check of a bundle from before its start at its first fetch
(broker/bundles.py, _check_intact), where it meets the fetch bound, retention, uploads and
other fetches; each found in review (tests/federation/test_storage_faults.py has the check
itself)."""

import contextlib
import threading
import time

import grpc
import pytest

from graft_fed.broker.server import render_metrics
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, code_of, record, summary


@pytest.fixture()
def prompts(prompt_file):
    return load_prompts(DataConfig(source=str(prompt_file)))


def _restarted_with_two_old_bundles(prompt_file, prompts, tmp_path):
    """A broker restarted over a state holding two bundles a uploaded for b (round 0)."""
    db = tmp_path / "broker.sqlite"
    cfg = broker_config(prompt_file, db=str(db), max_publishes_per_s=0, balance="none", round_deadline_s=0.5)
    broker = start_broker(cfg)
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    try:
        for p in prompts[:2]:
            a.publish(0, [summary(p, 1)])
            b.publish(0, [summary(p, 0)])
        digests = [a.upload(record(p, 1, "a"), 0)[0] for p in prompts[:2]]
        assert {o.digest for o in b.get_matches(0, 10.0).offers} == set(digests)
    finally:
        for c in (a, b):
            c.close()
        broker.stop()
    broker = start_broker(cfg)
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    assert {o.digest for o in b.get_matches(0, 10.0).offers} == set(digests)  # granted anew
    return broker, a, b, digests


def _flip_a_bit(path):
    with open(path, "r+b") as fh:
        fh.seek(40)
        byte = fh.read(1)
        fh.seek(40)
        fh.write(bytes([byte[0] ^ 0x04]))


def test_the_whole_read_of_a_first_fetch_is_within_the_per_node_fetch_bound(prompt_file, prompts, tmp_path,
                                                                            monkeypatch):
    # servicer._fetch runs open_bundle (-> Bundles._check_intact, which reads and hashes the
    # whole bundle, up to max_bundle_mib) BEFORE self.fetches.hold(node): a node already at
    # its MAX_FETCHES_PER_NODE still makes the broker read a whole bundle per call, and N
    # concurrent first fetches read it N times (security.md: "at most ... 4 fetches in
    # flight per node")
    broker, a, b, (good, _) = _restarted_with_two_old_bundles(prompt_file, prompts, tmp_path)
    try:
        reads = []
        real = broker.state.iter_bundle
        monkeypatch.setattr(broker.state, "iter_bundle", lambda d, chunk: reads.append(d) or real(d, chunk))
        with contextlib.ExitStack() as held:
            for _ in range(broker.servicer.fetches.limit):
                held.enter_context(broker.servicer.fetches.hold("b"))
            code, _details = code_of(lambda: list(b.stub.FetchBundle(
                pb.FetchBundleRequest(node_id="b", session_id=b.session, digest=good), timeout=10)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reads == [], f"a fetch refused for the node's in-flight bound read the bundle whole first: {reads}"
    finally:
        for c in (a, b):
            c.close()
        broker.stop()


def test_a_check_that_outlives_its_copy_does_not_condemn_the_copy_stored_after_it(prompt_file, prompts, tmp_path,
                                                                                  monkeypatch):
    # _check_intact hashes from a descriptor opened before retention dropped the damaged
    # copy; meanwhile the source stores the group again. Found in review: the check then
    # marked the digest damaged after the upload had cleared it, so the new, intact copy was
    # NOT_FOUND "damaged" for the rest of the broker's life
    broker, a, b, (_, bad) = _restarted_with_two_old_bundles(prompt_file, prompts, tmp_path)
    try:
        _flip_a_bit(broker.state.bundle_file(bad)[0])
        real = broker.state.iter_bundle
        raced = []

        def iter_bundle(d, chunk):
            chunks = real(d, chunk)  # the damaged copy's descriptor, opened now
            if d == bad and not raced:
                raced.append(d)
                broker.state.prune(max_bundle_bytes=0)  # retention drops it meanwhile
                again = summary(prompts[1], 1, round=1)
                again.policy_version = 0  # the same group, so the same bytes and digest
                a.publish(1, [again])
                b.publish(1, [summary(prompts[1], 0, round=1)])
                assert a.upload(record(prompts[1], 1, "a"), 1) == (bad, True)  # stored anew, intact
            return chunks
        monkeypatch.setattr(broker.state, "iter_bundle", iter_bundle)
        # what the check read was damaged, but an upload replaced it meanwhile: this fetch is
        # served the copy stored since (hashed on its way in), and so is every later one
        assert digest_of(encode_bundle(b.fetch_bundle(bad, "a").record)) == bad
        assert raced and "graft_fed_bundles_damaged_total 0\n" in render_metrics(broker.fed, broker.servicer)
        assert [o.digest for o in b.get_matches(1, 10.0).offers] == [bad]
        assert digest_of(encode_bundle(b.fetch_bundle(bad, "a").record)) == bad
    finally:
        for c in (a, b):
            c.close()
        broker.stop()


def test_fetches_that_come_while_a_bundle_is_read_wait_for_that_read(prompt_file, prompts, tmp_path, monkeypatch):
    """Four receivers' first fetches of one bundle from before the start: one reads it whole,
    the others wait for its verdict rather than each reading it again."""
    broker, a, b, (good, _) = _restarted_with_two_old_bundles(prompt_file, prompts, tmp_path)
    try:
        reads = []
        real = broker.state.iter_bundle

        def slow(d, chunk):
            reads.append(d)
            if len(reads) == 1:
                time.sleep(0.5)  # the check's read: the others arrive meanwhile
            return real(d, chunk)
        monkeypatch.setattr(broker.state, "iter_bundle", slow)
        got = []

        def fetch():
            got.append(digest_of(b"".join(c.data for c in b.stub.FetchBundle(
                pb.FetchBundleRequest(node_id="b", session_id=b.session, digest=good), timeout=10))))
        threads = [threading.Thread(target=fetch) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert got == [good] * 4
        assert reads.count(good) == 1 + 4  # one check, then each fetch's stream
    finally:
        for c in (a, b):
            c.close()
        broker.stop()
