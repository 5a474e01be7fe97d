"""The front process (`front_process: true`, broker/front.py): gRPC served by a process of
its own that hands every call to the broker over a Unix socket. The RPC, hostile-input,
mutual-TLS and provenance tests run on it too (their broker fixtures take both); these
cover what only the front has: streams flow-controlled across the socket, calls that end
at the client, and either process dying."""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import stat
import struct
import threading
import time

import grpc
import pytest

from graft_fed.broker.server import render_metrics
from graft_fed.broker.front import CANCEL, CLOSE, CREDIT, END, FILE, HEAD, MSG, SENT, START, WINDOW, FileStream
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker
from graft_fed.node.client import BrokerClient
from tests.federation.test_broker_rpc import code_of, manifest, record, summary


@pytest.fixture()
def fronted(prompt_file):
    server = start_broker(broker_config(prompt_file, front_process=True, chunk_kib=16, balance="none"))
    yield server
    server.stop()


@pytest.fixture()
def fronted_files(prompt_file, tmp_path):
    """The front before a broker whose state is on disk: its bundles are files."""
    server = start_broker(broker_config(prompt_file, db=str(tmp_path / "b.db"), front_process=True, chunk_kib=16,
                                        balance="none"))
    yield server
    server.stop()


def client(broker, prompts, name):
    c = BrokerClient(broker.address, name, chunk_kib=16)
    c.join(name, "tok", manifest(prompts), "share_all", 0)
    return c


def _matched_bundle(broker, prompts, texts):
    """a uploads its group of p0 (of `texts`), b failed p0 and is matched to it: (a, b, digest, record)."""
    a, b = client(broker, prompts, "a"), client(broker, prompts, "b")
    a.publish(0, [summary(prompts[0], 1)])
    b.publish(0, [summary(prompts[0], 0)])
    rec = dataclasses.replace(record(prompts[0], 1), texts=texts)
    digest, stored = a.upload(rec, 0)
    assert stored and [o.digest for o in b.get_matches(0, 10.0).offers] == [digest]
    return a, b, digest, rec


def _wait(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_bundle_of_many_chunks_goes_up_and_down_through_the_front(fronted, prompts):
    # ~75 chunks of 16 KiB each way; the window is 4
    a, b, digest, rec = _matched_bundle(fronted, prompts, ("x" * 600_000, os.urandom(300_000).hex()))
    assert digest == digest_of(encode_bundle(rec))
    assert b.fetch_bundle(digest, "a").record == rec
    assert _wait(lambda: fronted.front._calls == {})
    a.close()
    b.close()


def test_a_fetch_leaves_from_the_fronts_own_read_of_the_bundle_file(fronted_files, prompts, monkeypatch):
    """A bundle stored as a file is sent by the front from the file, in chunks of the
    broker's size, as the broker would send them; the broker reads none of it."""
    a, b, digest, rec = _matched_bundle(fronted_files, prompts, ("y" * 200_000, os.urandom(20_000).hex()))
    size = fronted_files.state.bundle_size(digest)

    def unread(*args):
        raise AssertionError("the broker read the bundle")
    monkeypatch.setattr(fronted_files.fed, "stream_bundle", unread)
    out0 = fronted_files.fed.counters["bundle_bytes_out"]
    chunks = list(_fetch(b, digest))
    assert [c.offset for c in chunks] == list(range(0, size, 16 * 1024))
    assert all(c.digest == digest and c.total_size == size for c in chunks)
    assert {len(c.data) for c in chunks[:-1]} == {16 * 1024}
    assert digest_of(b"".join(c.data for c in chunks)) == digest
    assert fronted_files.fed.counters["bundle_bytes_out"] - out0 == size
    assert b.fetch_bundle(digest, "a").record == rec
    assert _wait(lambda: fronted_files.front._calls == {})
    a.close()
    b.close()


def test_a_fetch_whose_file_is_gone_or_short_says_so(fronted_files, prompts, monkeypatch, tmp_path, caplog):
    """A file missing while its row is there, or shorter than its row: NOT_FOUND (that bundle
    cannot be served, on a retry either: a node skips the offer; UNAVAILABLE made it drop the
    step's whole exchange), and the operator is told in the broker's log (as when the broker
    reads it itself). Retention
    deleting the bundle between the broker's checks and the front's open: NOT_FOUND, as
    when it deletes it before the broker reads it."""
    a, b, digest, rec = _matched_bundle(fronted_files, prompts, ("z" * 100_000, "w" * 1_000))
    fed, state = fronted_files.fed, fronted_files.state
    size = state.bundle_size(digest)
    monkeypatch.setattr(fed, "bundle_file", lambda d: (str(tmp_path / "gone"), size))
    code, details = code_of(lambda: list(_fetch(b, digest)))
    assert code == grpc.StatusCode.NOT_FOUND and "copy is damaged" in details
    assert any("has a row but no file" in r.getMessage() for r in caplog.records)
    short = tmp_path / "short"
    short.write_bytes(b"x" * (size // 2))
    monkeypatch.setattr(fed, "bundle_file", lambda d: (str(short), size))
    code, details = code_of(lambda: list(_fetch(b, digest)))
    assert code == grpc.StatusCode.NOT_FOUND and "copy is damaged" in details
    assert any("shorter than its row" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert b.fetch_bundle(digest, "a").record == rec  # the real file: as before
    real = fed.bundle_file

    def pruned_meanwhile(d):
        where = real(d)
        state.prune(max_bundle_bytes=0)  # the row, then the file
        return where
    monkeypatch.setattr(fed, "bundle_file", pruned_meanwhile)
    code, details = code_of(lambda: list(_fetch(b, digest)))
    assert code == grpc.StatusCode.NOT_FOUND and "pruned by retention" in details
    assert _wait(lambda: fronted_files.front._calls == {})
    a.close()
    b.close()


def test_a_bundle_whose_file_was_damaged_is_not_sent_by_the_front_either(prompt_file, prompts, tmp_path, caplog):
    """The front sends a bundle's file itself, after the broker granted the fetch: the broker's
    check of a bundle from before its start (broker/bundles.py, at its first fetch) stands
    before it."""
    cfg = broker_config(prompt_file, db=str(tmp_path / "b.db"), front_process=True, chunk_kib=16, balance="none")
    broker = start_broker(cfg)
    try:
        a, b, digest, rec = _matched_bundle(broker, prompts, ("z" * 100_000, "w" * 1_000))
        a.close()
        b.close()
    finally:
        broker.stop()
    broker = start_broker(cfg)
    try:
        with open(broker.state.bundle_file(digest)[0], "r+b") as fh:
            first = fh.read(1)
            fh.seek(0)
            fh.write(bytes([first[0] ^ 0x01]))
        b = client(broker, prompts, "b")
        assert [o.digest for o in b.get_matches(0, 10.0).offers] == [digest]
        code, details = code_of(lambda: list(_fetch(b, digest)))
        assert code == grpc.StatusCode.NOT_FOUND and "copy is damaged" in details
        assert "no longer hashes to its digest" in caplog.text
        assert _wait(lambda: broker.front._calls == {})
        b.close()
    finally:
        broker.stop()


def _fetch(c, digest):
    return c.stub.FetchBundle(pb.FetchBundleRequest(node_id=c.node_id, session_id=c.session, digest=digest), timeout=30)


def test_calls_that_end_at_the_client_end_at_the_broker(fronted, prompts):
    a, b, digest, _ = _matched_bundle(fronted, prompts, (os.urandom(250_000).hex(), os.urandom(250_000).hex()))
    # a fetch cancelled after one chunk: the broker's call ends
    stream = _fetch(b, digest)
    next(stream)
    stream.cancel()
    assert _wait(lambda: fronted.front._calls == {})
    # a long-poll whose deadline passes at the client: the broker's call is told, and, parked
    # (it held no thread), it ends then rather than when its 30 s wait would have
    a.publish(1, [summary(prompts[1], 1, round=1)])  # b has not: a's GetMatches waits for it
    t0 = time.monotonic()
    waiting = a.stub.GetMatches.future(pb.MatchRequest(node_id="a", session_id=a.session, round=1, wait_ms=30000),
                                       timeout=5)
    assert _wait(lambda: len(fronted.front._calls) == 1 and fronted.fed.answers.long_polls() == 1, 4.5)
    call = next(iter(fronted.front._calls.values()))
    code, _ = code_of(waiting.result)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait(lambda: call.cancelled.is_set() and fronted.front._calls == {}
                 and fronted.fed.answers.long_polls() == 0, 5.0)
    assert time.monotonic() - t0 < 20.0
    assert b.publish(1, [summary(prompts[1], 0, round=1)]) == (1, 0)  # and the broker serves on
    assert a.get_matches(1, 5.0).ready
    a.close()
    b.close()


def test_an_upload_refused_before_its_end_is_answered_at_once(fronted, prompts):
    """The broker may refuse an upload at its first chunk; the front answers the client then,
    rather than when the client's stream ends."""
    a = client(fronted, prompts, "a")
    release = threading.Event()

    def trickle():
        yield pb.BundleChunk(digest="ab" * 32, total_size=10**12, offset=0, data=b"x", node_id="a",
                             session_id=a.session, prompt_id=prompts[0].id, round=0)
        release.wait(20)

    t0 = time.monotonic()
    code, details = code_of(lambda: a.stub.UploadBundle(trickle(), timeout=15))
    release.set()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds" in details
    assert time.monotonic() - t0 < 5
    a.close()


def test_the_socket_is_private_and_gone_once_the_front_is_connected(fronted):
    from graft_fed.broker.front import _socket_dir

    d = _socket_dir()
    try:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700  # only the broker's user can reach it
    finally:
        os.rmdir(d)
    # the front holds the one connection; nothing is left to connect to (or behind, after a SIGKILL)
    assert not os.path.exists(fronted.front.path) and not os.path.exists(os.path.dirname(fronted.front.path))


def test_when_the_front_exits_the_broker_says_so_and_stops_serving(fronted, prompts):
    a = client(fronted, prompts, "a")
    fronted.front.proc.kill()
    assert fronted.failed.wait(10)
    assert "front process" in fronted.failure and "exited" in fronted.failure
    code, _ = code_of(lambda: a.publish(0, [summary(prompts[0], 1)]))
    assert code == grpc.StatusCode.UNAVAILABLE
    a.close()


def test_when_the_broker_goes_the_front_exits(prompt_file):
    server = start_broker(broker_config(prompt_file, front_process=True))
    proc = server.front.proc
    server.front._stopping = True  # as if the broker died: its end of the socket closes
    server.front._sock.shutdown(socket.SHUT_RDWR)
    try:
        assert proc.wait(15) is not None
    finally:
        server.stop()
    # and a stopped broker leaves no front behind
    server = start_broker(broker_config(prompt_file, front_process=True))
    proc = server.front.proc
    server.stop()
    assert proc.poll() is not None


def test_a_taken_port_is_the_same_error_as_without_the_front(prompt_file):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="Failed to bind"):
            start_broker(broker_config(prompt_file, front_process=True, listen=f"127.0.0.1:{port}"))


# ----- the broker's end of the socket, driven frame by frame --------------------------------------

class _Frames:
    """A stand-in for the front: a FrontLink's socket, written and read frame by frame."""

    def __init__(self, link) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(link.path)
        link._sock, _ = link._listener.accept()
        threading.Thread(target=link._read, daemon=True).start()
        self.buf = b""

    def send(self, cid, kind, payload=b""):
        self.sock.sendall(HEAD.pack(len(payload), cid, kind) + payload)

    def start(self, cid, method, request=b""):
        self.send(cid, START, bytes([method]) + b"".join(struct.pack("<I", 0) for _ in range(4)) + request)

    def _fill(self, n, end):
        while len(self.buf) < n:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return False
            data = self.sock.recv(65536)
            if not data:
                return False
            self.buf += data
        return True

    def read(self, timeout):
        """(call id, kind, payload) of the broker's next frame; None if none comes in `timeout` s."""
        end = time.monotonic() + timeout
        if not self._fill(HEAD.size, end):
            return None
        size, cid, kind = HEAD.unpack(self.buf[:HEAD.size])
        if not self._fill(HEAD.size + size, end):
            return None
        payload, self.buf = self.buf[HEAD.size:HEAD.size + size], self.buf[HEAD.size + size:]
        return cid, kind, payload


@pytest.fixture()
def link():
    from graft_fed.broker.front import FrontLink

    made = {"yielded": 0, "closed": threading.Event(), "taken": [], "inbox_max": 0}

    def answers(request, context):
        try:
            for i in range(100):
                made["yielded"] += 1
                yield bytes([i])
        finally:
            made["closed"].set()

    def upload(requests, context):
        for r in requests:
            made["taken"].append(r)
            time.sleep(0.05)
        return b"done"

    def note(request, context):
        made["noted"].append(request)
        return b"ok"

    def from_file(request, context):
        stream = FileStream("/some/file", 3, 40, 16, b"first", b"later", 4, 5)
        try:
            yield stream
            made["outcome"] = (stream.outcome, stream.sent, stream.reason)
        finally:
            made["file_closed"].set()

    made["noted"], made["file_closed"] = [], threading.Event()
    handlers = {"Answers": grpc.unary_stream_rpc_method_handler(answers),
                "Upload": grpc.stream_unary_rpc_method_handler(upload),
                "Note": grpc.unary_unary_rpc_method_handler(note),
                "File": grpc.unary_stream_rpc_method_handler(from_file)}
    lost = []
    fl = FrontLink("t.Svc", [("Answers", "unary_stream"), ("Upload", "stream_unary"), ("Note", "unary_unary"),
                             ("File", "unary_stream")], handlers, [], 8, lost.append)
    frames = _Frames(fl)
    yield fl, frames, made, lost
    fl._stopping = True
    frames.sock.close()
    fl.stop(0)


def test_the_broker_writes_a_streams_answers_only_as_the_front_passes_them_on(link):
    fl, frames, made, _ = link
    frames.start(7, 0, b"req")
    got = [frames.read(2.0) for _ in range(WINDOW)]
    assert [(cid, kind) for cid, kind, _ in got] == [(7, MSG)] * WINDOW
    assert frames.read(0.5) is None  # nothing more without credit
    assert made["yielded"] <= WINDOW + 1
    frames.send(7, CREDIT, struct.pack("<I", 2))
    assert [frames.read(2.0)[1] for _ in range(2)] == [MSG, MSG] and frames.read(0.5) is None
    frames.send(7, CANCEL)  # the client went away: the handler's generator is closed
    assert made["closed"].wait(5) and made["yielded"] <= WINDOW + 3
    assert _wait(lambda: fl._calls == {})


def test_a_file_stream_is_handed_to_the_front_and_the_handler_told_what_came_of_it(link):
    fl, frames, made, _ = link
    frames.start(11, 3, b"req")
    cid, kind, payload = frames.read(2.0)
    assert (cid, kind) == (11, FILE)
    assert struct.unpack_from("<QQIII", payload) == (3, 40, 16, 4, 5)
    at, parts = struct.calcsize("<QQIII"), []
    for _ in range(3):
        n = struct.unpack_from("<I", payload, at)[0]
        parts.append(payload[at + 4:at + 4 + n])
        at += 4 + n
    assert parts == [b"/some/file", b"first", b"later"] and at == len(payload)
    assert frames.read(0.3) is None and not made["file_closed"].is_set()  # the handler waits for the front
    frames.send(11, SENT, struct.pack("<BQ", 2, 16) + struct.pack("<I", 2) + b"hm")
    assert frames.read(2.0)[1] == END
    assert made["outcome"] == ("short", 16, "hm")
    # the client goes while the front sends: the handler is closed, no END
    frames.start(12, 3, b"req")
    assert frames.read(2.0)[1] == FILE
    frames.send(12, CANCEL)
    assert made["file_closed"].wait(5) and _wait(lambda: fl._calls == {})
    assert frames.read(0.3) is None


def test_a_client_stream_is_handed_over_as_the_handler_takes_it(link):
    fl, frames, made, _ = link
    frames.start(9, 1)
    # the front may send nothing before the handler runs; then its window
    assert frames.read(2.0) == (9, CREDIT, struct.pack("<I", WINDOW))
    for i in range(3):
        frames.send(9, MSG, bytes([i]))
    credits = [frames.read(2.0) for _ in range(3)]  # then one credit per message the handler took
    assert credits == [(9, CREDIT, struct.pack("<I", 1))] * 3
    frames.send(9, CLOSE)
    assert frames.read(2.0)[1:] == (MSG, b"done") and frames.read(2.0)[1] == END
    assert made["taken"] == [b"\x00", b"\x01", b"\x02"]


def test_the_broker_is_told_when_its_front_goes(link):
    fl, frames, _, lost = link
    frames.start(3, 1)  # a call in flight
    frames.sock.close()
    assert _wait(lambda: lost != [])
    assert "front process" in lost[0]
    assert _wait(lambda: fl._calls == {} or all(c.cancelled.is_set() for c in fl._calls.values()))


def test_a_call_cancelled_before_a_thread_took_it_is_not_run(link):
    """As grpcio's server skips such a call: a publish whose client gave up waiting is not
    applied later behind its back."""
    fl, frames, made, _ = link
    for cid in range(20, 28):  # eight uploads hold the pool's eight threads
        frames.start(cid, 1)
    assert _wait(lambda: len([c for c in fl._calls.values() if c.method == 1]) == 8)
    frames.start(40, 2, b"late")
    frames.send(40, CANCEL)
    frames.start(41, 2, b"kept")
    for cid in range(20, 28):
        frames.send(cid, CLOSE)
    assert _wait(lambda: made["noted"] == [b"kept"])
    time.sleep(0.2)
    assert made["noted"] == [b"kept"]


def _file_payload(path, start, end, chunk, first=b"", later=b""):
    from graft_fed.broker.front import _FILE, _blobs

    fields = {f.name: f.number for f in pb.BundleChunk.DESCRIPTOR.fields}
    return _FILE.pack(start, end, chunk, fields["offset"], fields["data"]) + _blobs(os.fsencode(str(path)), first, later)


def test_the_front_makes_a_files_chunk_messages_as_the_broker_would(tmp_path):
    """_stream_file's hand-made messages parse as the BundleChunks the broker would send:
    any start, a last chunk shorter, an empty range as one empty message; a file shorter
    than said and a missing one are reported, not sent past."""
    import asyncio
    from concurrent import futures

    from graft_fed.broker.front import _SENT, _stream_file

    data = os.urandom(100_000)
    f = tmp_path / "b"
    f.write_bytes(data)
    first = pb.BundleChunk(digest="d" * 64, total_size=len(data), signature=b"sig").SerializeToString()
    later = pb.BundleChunk(digest="d" * 64, total_size=len(data)).SerializeToString()
    pool = futures.ThreadPoolExecutor(2)

    def run(payload):
        out, reports = [], []

        async def write(m):
            out.append(pb.BundleChunk.FromString(m))
        asyncio.run(_stream_file(write, payload, pool, reports.append))
        return out, [_SENT.unpack_from(r) for r in reports]
    out, rep = run(_file_payload(f, 0, len(data), 16_384, first, later))
    assert [c.offset for c in out] == list(range(0, len(data), 16_384)) and rep == [(0, len(data))]
    assert b"".join(c.data for c in out) == data and out[0].signature == b"sig" and not out[1].signature
    assert all(c.digest == "d" * 64 and c.total_size == len(data) for c in out)
    out, rep = run(_file_payload(f, 0, len(data), 16_384, later, later))
    assert out[0] == pb.BundleChunk(digest="d" * 64, total_size=len(data), offset=0, data=data[:16_384])
    out, rep = run(_file_payload(f, 40_000, 50_000, 4_096, later, later))
    assert [c.offset for c in out] == [40_000, 44_096, 48_192] and b"".join(c.data for c in out) == data[40_000:50_000]
    out, rep = run(_file_payload(f, 0, 0, 4_096, later, later))
    assert [(c.offset, c.data) for c in out] == [(0, b"")] and rep == [(0, 0)]  # an empty bundle: one empty chunk
    out, rep = run(_file_payload(f, 0, len(data) + 10, 65_536, later, later))
    assert rep == [(2, len(data))] and len(out) == 2  # short: what there was, then said
    out, rep = run(_file_payload(tmp_path / "none", 0, 10, 4_096))
    assert out == [] and rep == [(1, 0)]
    pool.shutdown()


def test_a_client_gone_mid_read_closes_the_file_after_the_read(tmp_path, monkeypatch):
    """The client goes while a chunk is being read in the pool: the front reports what went
    out (SENT, cancelled) and closes the descriptor only once the read returned, so the read
    never lands on a descriptor number reused meanwhile."""
    import asyncio
    from concurrent import futures

    from graft_fed.broker.front import _SENT, _stream_file

    f = tmp_path / "b"
    f.write_bytes(os.urandom(50_000))
    inode = os.stat(f).st_ino
    real, entered, release, seen = os.preadv, threading.Event(), threading.Event(), []

    def slow_preadv(fd, buffers, off):
        if off:  # the second chunk: the client goes meanwhile
            entered.set()
            assert release.wait(10)
        seen.append(os.fstat(fd).st_ino)
        return real(fd, buffers, off)
    monkeypatch.setattr(os, "preadv", slow_preadv)
    pool, reports = futures.ThreadPoolExecutor(2), []

    async def main():
        async def write(m):
            pass
        task = asyncio.ensure_future(_stream_file(write, _file_payload(f, 0, 50_000, 16_384), pool, reports.append))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    assert [_SENT.unpack_from(r) for r in reports] == [(4, 16_384)]
    release.set()
    pool.shutdown(wait=True)
    assert seen == [inode, inode]  # the second read still saw the file, open


def test_the_fronts_budget_holds_back_requests_beyond_it():
    import asyncio

    from graft_fed.broker.front import _Budget

    async def go():
        b = _Budget(100)
        await b.take(60)
        late = asyncio.ensure_future(b.take(50))  # 110 > 100: waits
        await asyncio.sleep(0.05)
        assert not late.done()
        b.give(60)
        await asyncio.wait_for(late, 1)
        assert b.used == 50
        b.give(50)
        big = await asyncio.wait_for(b.take(500), 1)  # larger than the budget: counts as all of it
        assert big == 100
        small = asyncio.ensure_future(b.take(1))
        await asyncio.sleep(0.05)
        assert not small.done()
        b.give(big)
        await asyncio.wait_for(small, 1)
        # in order: a small request does not pass one that waits before it
        first = asyncio.ensure_future(b.take(100))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(b.take(1))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        # a waiter that gives up lets the ones behind it through
        first.cancel()
        await asyncio.wait_for(second, 1)
        assert b.used == 2
        b.give(1)
        b.give(1)
        assert b.used == 0
    asyncio.run(go())


def test_a_ctrl_c_at_the_terminal_reaches_the_broker_not_the_front(fronted, prompts):
    """The front has a session of its own and ignores SIGINT and SIGTERM: only the broker
    stops it, with the grace it was given."""
    import signal

    os.kill(fronted.front.proc.pid, signal.SIGINT)
    os.kill(fronted.front.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert fronted.front.proc.poll() is None and not fronted.failed.is_set()
    assert os.getpgid(fronted.front.proc.pid) != os.getpgid(0)
    a = client(fronted, prompts, "a")
    assert a.publish(0, [summary(prompts[0], 1)]) == (1, 0)
    a.close()


def test_a_front_that_cannot_start_is_said_at_once(prompt_file, monkeypatch, tmp_path):
    from graft_fed.broker.front import FrontError
    from graft_fed.errors import ConfigError

    # a TLS file missing: the broker's own error names it, as without the front
    with pytest.raises(ConfigError, match=r"broker.tls_cert .*none.pem: cannot read it"):
        start_broker(broker_config(prompt_file, front_process=True, tls_cert=str(tmp_path / "none.pem"),
                                   tls_key=str(tmp_path / "none.key")))
    # a front that dies at start: said within seconds, not after the connect timeout
    monkeypatch.setattr("sys.executable", "/bin/false")
    t0 = time.monotonic()
    with pytest.raises(FrontError, match="exited at start"):
        start_broker(broker_config(prompt_file, front_process=True))
    assert time.monotonic() - t0 < 10


def test_metrics_show_the_fronts_memory(fronted, prompt_file):
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{fronted.http_port}/metrics", timeout=10).read().decode()
    rss = [line for line in body.splitlines() if line.startswith('graft_fed_front_memory_bytes{kind="resident_anon"}')]
    assert rss and float(rss[0].split()[-1]) > 1e6
    assert any(line.startswith("graft_fed_front_threads ") and float(line.split()[-1]) >= 1
               for line in body.splitlines())
    plain = start_broker(broker_config(prompt_file))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{plain.http_port}/metrics", timeout=10).read().decode()
        assert "graft_fed_front_" not in body
    finally:
        plain.stop()


# ----- long-polls parked: waiting without a thread --------------------------------------------------

@pytest.fixture()
def parking_link():
    """A link of two threads whose "Poll" parks until its wake-up (answering b"woken") or its
    deadline (b"late"), and whose "Note" answers at once."""
    from graft_fed.broker.front import FrontLink
    from graft_fed.broker.wakeups import Parked, Wake

    made = {"wake": Wake(), "released": [], "resumed": 0}

    def poll(request, context):
        assert context.parks  # the link's context says a long-poll may park
        timeout = float(request.decode())
        wake = made["wake"]

        def go_on():
            made["resumed"] += 1
            return b"woken" if wake.is_set() else b"late"
        parked = Parked(wake, timeout)
        parked.resume, parked.release = go_on, lambda: made["released"].append(request)
        return parked

    handlers = {"Poll": grpc.unary_unary_rpc_method_handler(poll),
                "Note": grpc.unary_unary_rpc_method_handler(lambda request, context: b"noted " + request)}
    fl = FrontLink("t.Svc", [("Poll", "unary_unary"), ("Note", "unary_unary")], handlers, [], 2, lambda _: None)
    frames = _Frames(fl)
    yield fl, frames, made
    fl._stopping = True
    frames.sock.close()
    fl.stop(0)


def _answers(frames, n, timeout=5.0):
    """The next `n` answers' (call id, message) pairs."""
    got = {}
    end = time.monotonic() + timeout
    while len([c for c, k in got if k == END]) < n and time.monotonic() < end:
        frame = frames.read(end - time.monotonic())
        if frame is None:
            break
        cid, kind, payload = frame
        got[(cid, kind)] = payload
    return {cid: payload for (cid, kind), payload in got.items() if kind == MSG}


def test_parked_long_polls_hold_no_thread_and_answer_when_woken(parking_link):
    fl, frames, made = parking_link
    for cid in range(100, 120):  # twenty long-polls on a link of two threads
        frames.start(cid, 0, b"30")
    assert _wait(lambda: len(fl._calls) == 20 and fl.pool.load() == (0, 0))  # parked: no thread busy
    frames.start(7, 1, b"x")  # so another call is served at once
    assert _answers(frames, 1) == {7: b"noted x"}
    assert made["resumed"] == 0
    made["wake"].set()
    assert _answers(frames, 20) == {cid: b"woken" for cid in range(100, 120)}
    assert _wait(lambda: fl._calls == {}) and len(fl._timers) == 0  # their deadlines cancelled
    assert made["released"] == []  # each ended by its own answer


def test_a_parked_call_answers_at_its_deadline_and_one_cancelled_is_released(parking_link):
    fl, frames, made = parking_link
    t0 = time.monotonic()  # before the call: its 0.3 s wait cannot end sooner than that after
    frames.start(1, 0, b"0.3")
    frames.start(2, 0, b"30")
    assert _wait(lambda: len(fl._calls) == 2)
    assert _answers(frames, 1) == {1: b"late"}
    assert 0.29 <= time.monotonic() - t0 < 3
    frames.send(2, CANCEL)  # the client gave up while it waited: its hold on the broker goes
    assert _wait(lambda: made["released"] == [b"30"] and fl._calls == {})
    assert made["resumed"] == 1 and len(fl._timers) == 0
    assert frames.read(0.3) is None  # nobody waits for an answer to the cancelled call


def test_the_timers_rebuild_their_heap_once_cancelled_entries_outnumber_the_live():
    from graft_fed.broker.front import _Timers

    timers, fired = _Timers(), []
    entries = [timers.add(60, lambda: None) for _ in range(3000)]
    for e in entries[:2500]:
        timers.cancel(e)
    assert len(timers) == 500 and len(timers._heap) < 3000  # rebuilt without the cancelled
    timers.add(0.05, lambda: fired.append(1))
    assert _wait(lambda: fired == [1], 5)
    timers.stop()


def test_a_brokers_waiting_long_polls_hold_none_of_its_threads(prompt_file, prompts):
    """Eleven GetMatches waiting for a round on a broker with 8 threads for them: all parked
    (no thread of the lane busy), and all answered once the last node publishes."""
    from concurrent import futures

    server = start_broker(broker_config(prompt_file, front_process=True, max_workers=16, max_long_polls=12))
    names = [f"n{i}" for i in range(12)]
    clients = [client(server, prompts, name) for name in names]
    lane = server.front.pools[1]
    assert lane.size == 8  # what server.py gives the GetMatches lane here
    try:
        for i, c in enumerate(clients[:-1]):
            c.publish(0, [summary(prompts[0], i % 3)])
        with futures.ThreadPoolExecutor(11) as ex:
            waiting = [ex.submit(c.get_matches, 0, 20.0) for c in clients[:-1]]
            assert _wait(lambda: server.fed.answers.long_polls() == 11)
            assert lane.load() == (0, 0)  # eleven waiting, no thread held, none queued
            page = render_metrics(server.fed, server.servicer, pools=server.front.pools)
            assert "\ngraft_fed_long_polls 11\n" in page and 'graft_fed_worker_threads_busy{pool="broker-lane0"} 0' in page
            clients[-1].publish(0, [summary(prompts[0], 2)])
            assert all(f.result(20).ready for f in waiting)
        assert _wait(lambda: server.front._calls == {}) and server.fed.answers.long_polls() == 0
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_a_long_poll_parks_again_for_its_bundles_and_answers_when_they_come(fronted, prompts):
    """Woken when its round is matched, a GetMatches that also waits for its bundles parks
    again (its resume raises Parked through the servicer to the link) and answers at the
    upload."""
    from concurrent import futures

    a, b, c = (client(fronted, prompts, name) for name in "abc")
    try:
        a.publish(0, [summary(prompts[0], 1)])
        b.publish(0, [summary(prompts[0], 0)])
        with futures.ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(b.get_matches, 0, 20.0, True)  # c has not published: parked for the round
            assert _wait(lambda: fronted.fed.answers.long_polls() == 1)
            c.publish(0, [summary(prompts[0], 2)])  # the round is matched: b is offered a's group of p0 (c's passed)
            time.sleep(0.3)
            assert not waiting.done() and fronted.fed.answers.long_polls() == 1  # parked again, for the bundle
            assert fronted.front.pools[1].load() == (0, 0)
            digest, stored = a.upload(record(prompts[0], 1), 0)
            assert stored and [o.digest for o in waiting.result(20).offers] == [digest]
        assert _wait(lambda: fronted.front._calls == {}) and fronted.fed.answers.long_polls() == 0
    finally:
        for x in (a, b, c):
            x.close()
