"""Bundles stream through the broker a chunk at a time (issue 13): an upload is hashed,
checked and written into the SQLite state as its chunks arrive, a fetch reads it back a
chunk at a time, so the broker's memory per transfer is bounded by the chunk size, not the
bundle; and an upload refused at any point leaves nothing stored."""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time
import tracemalloc

import grpc

from graft_fed.broker.bundlefiles import PartFile
from graft_fed.broker.handlers import Federation
from graft_fed.broker.servicer import BrokerServicer, _chunk_parser
from graft_fed.broker.state_sqlite import SqliteState
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.federation.codec import summaries_from_pb
from graft_fed.node.client import new_tag
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, code_of, record, summary


class _Context:
    def abort(self, code, message):  # noqa: ANN001, ANN201 - grpc.ServicerContext's shape
        raise AssertionError(f"aborted: {code} {message}")

    def auth_context(self):  # noqa: ANN201 - no mutual TLS
        return {}


def _pending(state: SqliteState) -> int:
    """Bytes of uploads not committed: their temporary files, written as the chunks come."""
    return sum(e.stat().st_size for e in os.scandir(state.files.path) if e.name.endswith(".part"))


def _files(state: SqliteState) -> list[str]:
    return sorted(os.listdir(state.files.path))


def _chunks(data: bytes, chunk: int, **fields):
    for off in range(0, len(data), chunk):
        yield pb.BundleChunk(offset=off, data=data[off:off + chunk], tag=new_tag() if off == 0 else None, **fields)


def _received(chunks):
    """Chunks as the servicer gets them from gRPC: each one's bytes, parsed as its method does."""
    for c in chunks:
        yield _chunk_parser(c.SerializeToString())


def summary_row(p):
    """The row a publish of test_broker_rpc's `summary(p, 1)` stores."""
    return summaries_from_pb(pb.PublishRequest(node_id="a", round=0, summaries=[summary(p, 1)]))[0]


def test_upload_holds_a_few_chunks_not_the_bundle(prompt_file, prompts, tmp_path):
    """A 16 MiB bundle uploaded in 256 KiB chunks: hashed, checked and stored as they come."""
    state = SqliteState(tmp_path / "b.db")
    fed = Federation(broker_config(prompt_file, chunk_kib=256), state)
    servicer = BrokerServicer(fed)
    session, _ = fed.join("a", "m", "tok", fed.manifest, "share_all", 0)
    fed.publish("a", session, 0, [summary_row(prompts[0])])
    rec = dataclasses.replace(record(prompts[0], 1), texts=("x" * (8 * 2**20), "y\n\"" * (2 * 2**20)))
    data = encode_bundle(rec)
    fields = dict(digest=digest_of(data), total_size=len(data), node_id="a", session_id=session,
                  prompt_id=prompts[0].id, round=0)
    del rec
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        resp = servicer.UploadBundle(_received(_chunks(data, 256 * 1024, **fields)), _Context())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert resp.stored and state.get_bundle(fields["digest"]) == data
        assert _files(state) == [fields["digest"]]  # one file, named by the digest
        assert peak - base < 8 * 256 * 1024, f"peak {peak - base} bytes uploading {len(data)} bytes in 256 KiB chunks"
    finally:
        state.close()


def test_a_refused_upload_leaves_nothing_stored(prompt_file, prompts, tmp_path):
    """Refused anywhere in its stream (a chunk that is not JSON, the wrong digest, a record
    its summary does not describe, too few bytes, too many, a call cancelled midway): a
    clear status, never INTERNAL, and no bundle nor any of its chunks stays in the state."""
    broker = start_broker(broker_config(prompt_file, db=str(tmp_path / "b.db"), chunk_kib=16))
    try:
        a = client(broker, prompts, "a")
        a.publish(0, [summary(prompts[0], 1)])
        good = encode_bundle(dataclasses.replace(record(prompts[0], 1), texts=("x" * 60_000, "y" * 60_000)))
        other = encode_bundle(dataclasses.replace(record(prompts[0], 0), texts=("x" * 60_000, "y" * 60_000)))
        broken = good[:70_000] + b"\x01" + good[70_001:]  # a raw control character inside a text
        fields = dict(node_id="a", session_id=a.session, prompt_id=prompts[0].id, round=0)

        def send(data, digest=None, total=None, upto=None):
            chunks = list(_chunks(data, 16 * 1024, digest=digest or digest_of(data),
                                  total_size=len(data) if total is None else total, **fields))
            return code_of(lambda: a.stub.UploadBundle(iter(chunks[:upto]), timeout=10))

        for (code, details), want, words in [
                (send(broken), grpc.StatusCode.INVALID_ARGUMENT, "control character"),
                (send(good, digest="0" * 64), grpc.StatusCode.INVALID_ARGUMENT, "do not hash"),
                (send(other), grpc.StatusCode.INVALID_ARGUMENT, "does not hold the group"),
                (send(good, upto=3), grpc.StatusCode.INVALID_ARGUMENT, "ended after"),
                (send(good, total=len(good) - 1), grpc.StatusCode.INVALID_ARGUMENT, "exceed"),
                (send(good, total=2**40), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit")]:
            assert code == want and words in details, (code, details)
            assert broker.state.bundle_stats() == (0, 0) and _files(broker.state) == []

        release = threading.Event()

        def stalled():  # two chunks, then the client gives up
            chunks = _chunks(good, 16 * 1024, digest=digest_of(good), total_size=len(good), **fields)
            yield next(chunks)
            yield next(chunks)
            release.wait(10)

        call = a.stub.UploadBundle.future(stalled(), timeout=10)
        deadline = time.monotonic() + 10
        while _pending(broker.state) < 2 * 16 * 1024 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _pending(broker.state) == 2 * 16 * 1024  # written as they came
        call.cancel()
        release.set()
        while _files(broker.state) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broker.state.bundle_stats() == (0, 0) and _files(broker.state) == []

        a.chunk = 16 * 1024  # the broker's chunk size
        digest, stored = a._upload_bytes(good, digest_of(good), prompts[0].id, 0)
        assert stored and broker.state.get_bundle(digest) == good and set(a.has_bundles([digest])) == {digest}
        a.close()
    finally:
        broker.stop()


def test_fetch_holds_one_chunk_not_the_bundle(prompt_file, tmp_path):
    state = SqliteState(tmp_path / "b.db")
    fed = Federation(broker_config(prompt_file, chunk_kib=256), state)
    servicer = BrokerServicer(fed)
    data = os.urandom(16 * 2**20)
    digest = digest_of(data)
    state.put_bundle(digest, data)
    session, _ = fed.join("r", "m", "t", fed.manifest, "share_all", 0)
    fed.grants.grant("r", [digest])
    del data
    gc.collect()
    tracemalloc.start()
    try:
        received, peak_chunk = 0, 0
        for wire in servicer.FetchBundle(pb.FetchBundleRequest(node_id="r", session_id=session, digest=digest),
                                         _Context()):
            chunk = pb.BundleChunk.FromString(wire)  # what the client reads (the servicer answers wire bytes)
            del wire
            assert chunk.offset == received and chunk.total_size == 16 * 2**20
            received += len(chunk.data)
            peak_chunk = max(peak_chunk, len(chunk.data))
            del chunk
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        state.close()
    assert received == 16 * 2**20 and peak_chunk == 256 * 1024
    assert peak < 4 * 256 * 1024, f"peak {peak} bytes while streaming a 16 MiB bundle in 256 KiB chunks"


def test_an_uploads_file_is_synced_outside_the_brokers_lock(prompt_file, prompts, tmp_path, monkeypatch):
    """The bundle file's fsync and rename (bundlefiles.PartFile.seal) run before the broker takes its
    lock to check the bundle against its summary: publishes and heartbeats do not wait for
    the disk behind an upload."""
    state = SqliteState(tmp_path / "b.db")
    fed = Federation(broker_config(prompt_file, chunk_kib=256), state)
    servicer = BrokerServicer(fed)
    session, _ = fed.join("a", "m", "tok", fed.manifest, "share_all", 0)
    fed.publish("a", session, 0, [summary_row(prompts[0])])
    data = encode_bundle(record(prompts[0], 1))
    real_seal, free = PartFile.seal, []

    def seal(*args):
        def take() -> None:  # from another thread, as a publish would
            got = fed.cond.acquire(timeout=2)
            if got:
                fed.cond.release()
            free.append(got)
        t = threading.Thread(target=take)
        t.start()
        t.join()
        return real_seal(*args)
    monkeypatch.setattr(PartFile, "seal", seal)
    try:
        resp = servicer.UploadBundle(_received(_chunks(data, 256 * 1024, digest=digest_of(data), total_size=len(data),
                                                       node_id="a", session_id=session, prompt_id=prompts[0].id,
                                                       round=0)), _Context())
        assert resp.stored and free == [True] and state.get_bundle(digest_of(data)) == data
    finally:
        state.close()
