"""A fault-injecting TCP proxy on loopback, to put between a node and the broker.

    proxy = FaultProxy("127.0.0.1:50551").start()   # nodes connect to proxy.address
    proxy.set("delay", delay_s=0.05, jitter_s=0.02)   # every chunk held 50-70 ms (order kept)
    proxy.set("drop")                                 # blackhole: nothing forwarded either way
    proxy.set("drop", direction="down")               # requests arrive, answers never come back
    proxy.set("reset")                                # every connection closed with a TCP RST
    proxy.schedule([("drop", 2.0), ("pass", None)])   # 2 s of drop, then recover
    proxy.close()

Modes, and what they do to connections that are open and ones that arrive:

- ``pass``: bytes are forwarded as they come.
- ``delay``: each chunk read from one side is written to the other ``delay_s`` plus a
  uniform ``[0, jitter_s)`` later, in order (a chunk never overtakes an earlier one).
- ``drop``: a network partition. Open connections stall: nothing is read or forwarded, so
  the bytes wait in the kernel's buffers (as TCP would retransmit them) and flow again
  when the mode changes back. New connections are accepted and blackholed: what the client
  sends is read and discarded, nothing reaches the upstream, and they are reset when the
  partition ends (their lost bytes cannot be replayed).
- ``reset``: every open connection is closed with an RST (SO_LINGER 0) on both sides, and
  every new one is reset as soon as it is accepted.

``direction`` limits ``delay`` and ``drop`` to one way: "up" (client to upstream) or
"down" (upstream to client); with one way dropped, new connections are not blackholed but
stall in that direction only. "down" is the lost-acknowledgement fault: the broker applies
a request whose answer the node never sees, and the node's retry must not duplicate it.

Threads only (one accept thread, one pump thread per direction of each connection), so a
synchronous test drives it directly. `stats` counts connections, resets, blackholed
connections and bytes in each direction.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import threading
import time
from collections import Counter, deque
from typing import Sequence

MODES = ("pass", "delay", "drop", "reset")
_POLL_S = 0.02


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _rst(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Conn:
    """One proxied connection: client socket, upstream socket (None when blackholed)."""

    def __init__(self, proxy: "FaultProxy", client: socket.socket, upstream: socket.socket | None) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self._lock = threading.Lock()
        self.closed = False
        self._open_pumps = 0

    def reset(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        _rst(self.client)
        if self.upstream is not None:
            _rst(self.upstream)
        self.proxy._forget(self)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.upstream):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        self.proxy._forget(self)

    def pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        """Forward src -> dst under the proxy's current mode until src ends or a reset."""
        queue: deque[tuple[float, bytes]] = deque()
        last_due = 0.0
        eof = False
        try:
            while not self.closed:
                mode, delay, jitter = self.proxy._settings(direction)
                if mode == "reset":
                    self.proxy._count("reset_open")
                    self.reset()
                    return
                now = time.monotonic()
                if mode != "drop":
                    while queue and queue[0][0] <= now:
                        data = queue.popleft()[1]
                        dst.sendall(data)
                        self.proxy._count(f"bytes_{direction}", len(data))
                if eof and not queue:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                if mode == "drop" or eof:
                    time.sleep(_POLL_S)  # stalled: read nothing, forward nothing
                    continue
                timeout = min(_POLL_S, max(0.0, queue[0][0] - now)) if queue else _POLL_S
                readable, _, _ = select.select([src], [], [], timeout)
                if not readable:
                    continue
                data = src.recv(65536)
                if not data:
                    eof = True
                    continue
                mode, delay, jitter = self.proxy._settings(direction)  # the mode when the bytes arrived
                due = time.monotonic() + (delay + self.proxy._rng.uniform(0.0, jitter) if mode == "delay" else 0.0)
                last_due = max(last_due, due)
                queue.append((last_due, data))
        except (OSError, ValueError):  # ValueError: select on a socket another thread closed
            self.reset()  # one side broke: the other sees the connection die too
        finally:
            with self._lock:
                self._open_pumps -= 1
                done = self._open_pumps == 0
            if done:
                self.close()

    def blackhole(self) -> None:
        """Read and discard what the client sends; reset the client when the partition ends."""
        try:
            while not self.closed:
                if self.proxy._settings("up")[0] != "drop":
                    self.reset()
                    return
                readable, _, _ = select.select([self.client], [], [], _POLL_S)
                if readable:
                    data = self.client.recv(65536)
                    if not data:
                        self.close()
                        return
                    self.proxy._count("bytes_dropped", len(data))
        except (OSError, ValueError):
            self.close()


class FaultProxy:
    """TCP proxy from ``host:port`` (port 0 = ephemeral) to ``upstream`` with injectable faults."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, seed: int = 0) -> None:
        self.upstream = _split(upstream)
        self._mode, self._delay, self._jitter, self._direction = "pass", 0.0, 0.0, "both"
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._conns: set[_Conn] = set()
        self.stats: Counter[str] = Counter()
        self.history: list[tuple[float, str]] = []  # (monotonic time, mode) of every change
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(_POLL_S * 5)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._schedule_gen = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    # ----- control ------------------------------------------------------------------------------
    def set(self, mode: str, delay_s: float = 0.0, jitter_s: float = 0.0, direction: str = "both") -> None:
        """Switch mode now (cancels a running schedule)."""
        with self._lock:
            self._schedule_gen += 1
        self._apply(mode, delay_s, jitter_s, direction)

    def _apply(self, mode: str, delay_s: float = 0.0, jitter_s: float = 0.0, direction: str = "both") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if direction not in ("both", "up", "down"):
            raise ValueError(f"direction must be both, up or down, got {direction!r}")
        if delay_s < 0 or jitter_s < 0:
            raise ValueError("delay_s and jitter_s must be >= 0")
        with self._lock:
            self._mode, self._delay, self._jitter, self._direction = mode, float(delay_s), float(jitter_s), direction
            self.history.append((time.monotonic(), mode))

    def schedule(self, steps: Sequence[tuple]) -> threading.Thread:
        """Apply (mode, seconds[, delay_s, jitter_s, direction]) steps one after another on a thread; the
        last step's mode stays (its seconds may be None). A later `set` or `schedule` cancels it."""
        for step in steps:
            if step[0] not in MODES:
                raise ValueError(f"mode must be one of {MODES}, got {step[0]!r}")
        with self._lock:
            self._schedule_gen += 1
            gen = self._schedule_gen

        def run() -> None:
            for i, step in enumerate(steps):
                mode, seconds, *rest = step
                with self._lock:
                    if self._schedule_gen != gen:
                        return
                self._apply(mode, *rest)
                if seconds is None or i == len(steps) - 1:
                    return
                if self._stop.wait(seconds):
                    return

        t = threading.Thread(target=run, name="faultproxy-schedule", daemon=True)
        t.start()
        return t

    def fail_for(self, seconds: float, mode: str = "drop") -> threading.Thread:
        """`mode` for `seconds`, then pass."""
        return self.schedule([(mode, seconds), ("pass", None)])

    # ----- internals ------------------------------------------------------------------------------
    def _settings(self, direction: str = "both") -> tuple[str, float, float]:
        """(mode, delay, jitter) as they apply to bytes going `direction` (up or down)."""
        with self._lock:
            if self._mode == "reset" or self._direction in ("both", direction):
                return self._mode, self._delay, self._jitter
            return "pass", 0.0, 0.0

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="faultproxy")
        t.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._count("connections")
            with self._lock:
                mode, one_way = self._mode, self._direction != "both"
            if mode == "reset":
                self._count("reset_at_accept")
                _rst(client)
                continue
            if mode == "drop" and not one_way:
                self._count("blackholed")
                conn = _Conn(self, client, None)
                with self._lock:
                    self._conns.add(conn)
                self._spawn(conn.blackhole)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5.0)
            except OSError:
                self._count("upstream_refused")
                _rst(client)  # as the client would see a refused connection
                continue
            upstream.settimeout(None)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, client, upstream)
            conn._open_pumps = 2
            with self._lock:
                self._conns.add(conn)
            self._spawn(conn.pump, client, upstream, "up")
            self._spawn(conn.pump, upstream, client, "down")

    def start(self) -> "FaultProxy":
        t = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        for t in self._threads:
            t.join(timeout=2)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
