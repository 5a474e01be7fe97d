"""The broker's HTTP port: /metrics, /healthz, /api/status and the live page (`/`).

What reaches it is not authenticated (Prometheus and a browser inside the operator's
network), so it is bounded against a careless or hostile client: at most `max_connections`
connections are served at once (at most `max_per_address` from one address, so one client
cannot hold them all and fail the orchestrator's /healthz probe), each by a thread of its
own, and one more is answered 503 and closed at once rather than queued; a connection whose
request line and headers are not in within `timeout_s` is cut, however slowly it trickles
them, and each later read or write waits at most `timeout_s`. Without the cap, idle
connections held a thread and a file descriptor each for ever: about 490 of them under a
limit of 512 descriptors left the gRPC port unable to accept a node (its accept loop
spinning on EMFILE). One request per connection (HTTP/1.0), GET and HEAD.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from graft_fed.errors import GraftFedError

log = logging.getLogger("graft_fed.broker")

#: path -> a function giving (body, content type); called for each GET or HEAD
Routes = dict[str, Callable[[], tuple[bytes, str]]]

MAX_CONNECTIONS = 32
MAX_PER_ADDRESS = 8
TIMEOUT_S = 10.0

_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, family: int, max_connections: int,
                 max_per_address: int) -> None:
        self.address_family = family
        self._max, self._max_per_address = max_connections, max_per_address
        self._lock = threading.Lock()
        self._open = 0
        self._by_address: dict[str, int] = {}
        super().__init__(address, handler)

    def _take(self, host: str) -> bool:
        with self._lock:
            if self._open >= self._max or self._by_address.get(host, 0) >= self._max_per_address:
                return False
            self._open += 1
            self._by_address[host] = self._by_address.get(host, 0) + 1
            return True

    def _give_back(self, host: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._by_address.pop(host) - 1
            if left:
                self._by_address[host] = left

    def process_request(self, request: socket.socket, client_address: tuple) -> None:  # type: ignore[override]
        host = str(client_address[0])
        if not self._take(host):
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread of its own
        except BaseException:
            self._give_back(host)
            raise

    def handle_error(self, request: object, client_address: tuple) -> None:
        """A client that went away or was cut (its deadline): nothing to print. Anything
        else is logged, not printed to stderr."""
        if not isinstance(sys.exc_info()[1], OSError):
            log.exception("the HTTP port failed to answer %s", client_address[0])

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(str(client_address[0]))


def _handler(routes: Routes, timeout_s: float) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # each read and write (StreamRequestHandler sets it on the socket)

        def setup(self) -> None:
            super().setup()
            # the request line and headers within timeout_s in all: a client trickling a byte
            # at a time would otherwise hold its connection (and a slot) for ever
            self._head = threading.Timer(timeout_s, self._cut)
            self._head.daemon = True
            self._head.start()

        def _cut(self) -> None:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def finish(self) -> None:
            self._head.cancel()
            super().finish()

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(body_too=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body_too=False)

        def _answer(self, body_too: bool) -> None:
            self._head.cancel()  # the head is in
            route = routes.get(self.path.split("?", 1)[0])
            body, ctype, code = (*route(), 200) if route is not None else (b"not found\n", "text/plain", 404)
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            if ctype.startswith("text/html"):
                # the page loads nothing from elsewhere and talks only to this origin
                self.send_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; "
                                 "style-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'")
            self.end_headers()
            if body_too:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def serve_http(address: str, routes: Routes, max_connections: int = MAX_CONNECTIONS,
               timeout_s: float = TIMEOUT_S, max_per_address: int = MAX_PER_ADDRESS) -> ThreadingHTTPServer:
    """Listen on `address` (HOST:PORT, an IPv6 host in brackets) and serve `routes` from a
    thread of its own; a GraftFedError that says how to fix it when the address cannot be
    had. The caller stops it with shutdown() and server_close()."""
    host, _, port = address.rpartition(":")
    family = socket.AF_INET
    if host.startswith("[") and host.endswith("]"):
        host, family = host[1:-1], socket.AF_INET6
    try:
        server = _Server((host, int(port)), _handler(routes, timeout_s), family, max_connections, max_per_address)
    except OSError as exc:  # EADDRINUSE, EADDRNOTAVAIL, an unknown host name
        raise GraftFedError(f"cannot serve HTTP (/metrics, /healthz) on {address}: {exc.strerror or exc}; choose "
                            "another with --set http=HOST:PORT, or turn it off with --set http=''") from None
    threading.Thread(target=server.serve_forever, name="broker-http", daemon=True).start()
    return server
