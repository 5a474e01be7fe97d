"""The broker's HTTP port under careless and hostile clients (broker/web.py): idle
connections time out, connections beyond the cap are answered 503 at once without a thread,
HEAD is answered without a body, and an address that cannot be had is a clear error."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest

from graft_fed.broker.web import serve_http
from graft_fed.errors import GraftFedError

ROUTES = {"/healthz": lambda: (b"ok\n", "text/plain")}


@pytest.fixture()
def http():
    servers = []

    def start(**kw):
        server = serve_http("127.0.0.1:0", ROUTES, **kw)
        servers.append(server)
        return server, server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _get(port, path="/healthz", method="GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, dict(r.headers), r.read()


def _idle(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /healthz HTTP/1.0\r\n")  # a request line, then nothing: a slow client
    return s


def test_connections_beyond_the_cap_get_503_at_once_and_a_freed_slot_serves_again(http):
    server, port = http(max_connections=2, timeout_s=30)
    # this server's connection threads, counted as each starts (the process's thread count
    # would also move with other tests' threads ending meanwhile)
    started: list[int] = []
    serve_one = server.process_request_thread
    server.process_request_thread = lambda *a: (started.append(1), serve_one(*a))
    idle = [_idle(port), _idle(port)]
    try:
        deadline = time.monotonic() + 10
        while len(started) < 2 and time.monotonic() < deadline:  # both taken by their threads
            time.sleep(0.01)
        assert len(started) == 2
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as busy:
            _get(port)
        assert busy.value.code == 503 and time.monotonic() - t0 < 2
        assert len(started) == 2  # refused without a thread of its own (one would count before answering)
        idle[0].close()
        _served_again(port)
    finally:
        for s in idle:
            s.close()


def test_an_idle_connection_is_closed_after_the_timeout(http):
    _, port = http(max_connections=1, timeout_s=0.5)
    s = _idle(port)
    try:
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the broker, nothing answered
        assert time.monotonic() - t0 < 4
    finally:
        s.close()
    _served_again(port)  # and its slot serves the next


def _served_again(port):
    deadline = time.monotonic() + 5
    while True:  # the slot comes back once its thread has finished with the connection
        try:
            assert _get(port)[0] == 200
            return
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline, "the freed slot never served"
            time.sleep(0.05)


def test_a_client_trickling_its_request_is_cut_at_the_deadline(http):
    """One byte every 0.2 s never lets a read time out; the request head's deadline still
    cuts the connection, and its slot serves the next client."""
    _, port = http(max_connections=1, timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError):
            for _ in range(50):  # 10 s of trickling, if nothing cut it
                s.sendall(b"X")
                time.sleep(0.2)
                s.setblocking(False)
                try:
                    if s.recv(1024) == b"":
                        raise ConnectionResetError("closed by the server")
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
        assert time.monotonic() - t0 < 4
    finally:
        s.close()
    _served_again(port)


def test_one_address_cannot_take_every_slot(http):
    _, port = http(max_connections=10, max_per_address=2, timeout_s=30)
    idle = [_idle(port), _idle(port)]
    try:
        time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as busy:  # the third from 127.0.0.1
            _get(port)
        assert busy.value.code == 503
        # another address (a probe's) is served meanwhile
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert other.recv(64).startswith(b"HTTP/1.0 200")
    finally:
        for s in idle:
            s.close()


def test_head_has_the_headers_and_no_body_unknown_paths_404(http):
    _, port = http()
    status, headers, body = _get(port, method="HEAD")
    assert status == 200 and headers["Content-Length"] == "3" and body == b""
    assert _get(port)[2] == b"ok\n"
    with pytest.raises(urllib.error.HTTPError) as missing:
        _get(port, "/nope")
    assert missing.value.code == 404


def test_an_address_that_cannot_be_had_says_what_to_do(http):
    _, port = http()
    with pytest.raises(GraftFedError, match=rf"cannot serve HTTP .* on 127.0.0.1:{port}: .*--set http="):
        serve_http(f"127.0.0.1:{port}", ROUTES)


def test_an_ipv6_address_is_served():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    server = serve_http("[::1]:0", ROUTES)
    try:
        with urllib.request.urlopen(f"http://[::1]:{server.server_address[1]}/healthz", timeout=5) as r:
            assert r.read() == b"ok\n"
    finally:
        server.shutdown()
        server.server_close()
