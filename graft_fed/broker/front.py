"""The front: the broker's gRPC port served by a process of its own (`front_process: true`).

At a thousand nodes the broker's one interpreter is busy for a whole round, about half of
it in grpcio's per-call work (taking each call, each message and each completion) and half
in the handlers (issue 13). With the front, a second process (its own interpreter, on
another core) serves the port with grpc.aio, TLS included, and hands each call to the
broker over a Unix socket as a few frames; the broker runs the same handlers, behind the
same interceptors (the identity check, the request rate, the timing), in its thread pool
and writes the answer back. Nothing of the federation's logic or state is in the front.

Frames, both ways: <u32 payload length><u32 call id><u8 kind><payload>.

front -> broker
  START   <u8 method index>, then four strings each <u32 n><utf-8>: the client certificate's
          name and PEM (mutual TLS; else empty), the peer's address, the invocation metadata
          (JSON [[key, value], ...]); then the request, for methods with one request
  MSG     one message of a client stream (UploadBundle's chunks)
  CLOSE   the client stream ended
  CANCEL  the call ended at the client (cancelled, deadline passed, connection lost)
  CREDIT  <u32 n>: the front has sent on n more of the call's answer messages
  SENT    <u8 outcome><u64 bytes sent><u32 n><reason utf-8>: what a FILE came to (outcome:
          0 sent, 1 the file was missing, 2 it was shorter than said, 3 it could not be read,
          4 the client went first; a CANCEL follows)
broker -> front
  MSG     one answer message
  END     <u8 status code><u32 n><message utf-8><trailing metadata JSON>
  CREDIT  <u32 n>: the broker has taken n more of the call's stream messages
  FILE    <u64 start><u64 end><u32 chunk><u32 offset field><u32 data field>, then three byte
          strings each <u32 n><bytes>: a file's path, the first answer message's other fields
          and the later ones' (serialized protobuf). The front sends bytes [start, end) of
          the file as answer messages of at most `chunk` bytes (one empty message for none),
          each the fields given with the chunk's offset and bytes appended as the two field
          numbers, and answers SENT. A large fetch thus leaves from the front's own read of
          the bundle's file, not copied through the broker and the socket (a bundle file is
          immutable and named by its digest: bundlefiles.py)

Streams are flow-controlled both ways with a window of WINDOW messages per call, so a
transfer holds a few chunks in each process, whatever the bundle's size. The socket lives
in a private directory (mode 0700) and is the broker's only listener besides HTTP; the
front accepts no other connection to it. If the front exits, the broker stops (the
`graft-fed broker` command exits non-zero, for its supervisor to restart it); if the broker
exits, the front sees the socket close and exits too.

A long-poll (GetMatches) waits here without a thread: its handler answers Parked
(broker/wakeups.py) instead of sleeping, and the link holds the call until the round's or
the bundles' wake-up, the poll's deadline (one timer thread for all) or a CANCEL, then runs
it on a thread of its lane again. The front is told nothing of it: to the front the call
is simply not answered yet.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import json
import logging
import os
import queue
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Sequence

import grpc

from graft_fed.broker.heap import keep_chunk_buffers, limit_malloc_arenas
from graft_fed.broker.wakeups import Parked
from graft_fed.broker.workers import Workers
from graft_fed.errors import GraftFedError
from graft_fed.federation.protowire import varint
from graft_fed.federation.status import INTERNAL_MESSAGE
from graft_fed.federation.transport import server_credentials

log = logging.getLogger(__name__)

HEAD = struct.Struct("<IIB")
START, MSG, CLOSE, CANCEL, CREDIT, END, STOP, FILE, SENT = 1, 2, 3, 4, 5, 6, 7, 8, 9
_FILE = struct.Struct("<QQIII")
_SENT = struct.Struct("<BQ")
OUTCOMES = ("sent", "missing", "short", "failed", "cancelled")  # SENT's outcome byte, by index
WINDOW = 4  # stream messages in flight per call and direction
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _blobs(*values: bytes) -> bytes:
    """Byte strings, each <u32 n><bytes>."""
    return b"".join(_U32.pack(len(v)) + v for v in values)


def _strings(*values: str) -> bytes:
    return _blobs(*(v.encode() for v in values))


def _unblobs(payload: bytes, at: int, count: int) -> tuple[list[bytes], int]:
    """`count` byte strings of `_blobs` from offset `at`, and the offset after them."""
    out = []
    for _ in range(count):
        n = _U32.unpack_from(payload, at)[0]
        out.append(payload[at + 4:at + 4 + n])
        at += 4 + n
    return out, at


@dataclass
class FileStream:
    """What a server-streaming handler run behind the front may yield instead of messages:
    the messages made of bytes [start, end) of the file at `path`, `chunk` bytes each (one
    empty message for none), each `first` (the first) or `later` (the others), serialized
    fields of the answer message, with the chunk's offset as field `offset_field` (uint64)
    and its bytes as field `data_field` (bytes). The front reads the file and sends them;
    `outcome` then says what came of it ("sent", "missing", "short", "failed" with
    `reason`, or "cancelled" when the client went first) and `sent` how many of the bytes
    went out. The handler resumes only if the call goes on; when the client went, its
    generator is closed at the yield (a `finally` there still sees `sent`)."""

    path: str
    start: int
    end: int
    chunk: int
    first: bytes
    later: bytes
    offset_field: int
    data_field: int
    outcome: str = ""
    sent: int = 0
    reason: str = ""


def _end_payload(code: grpc.StatusCode, message: str, trailing: Sequence[tuple[str, str]] = ()) -> bytes:
    msg = message.encode()
    return bytes([code.value[0]]) + _U32.pack(len(msg)) + msg + (json.dumps(list(trailing)).encode() if trailing else b"")


def _parse_end(payload: bytes) -> tuple[grpc.StatusCode, str, list[tuple[str, str]]]:
    n = _U32.unpack_from(payload, 1)[0]
    message = payload[5:5 + n].decode(errors="replace")
    rest = payload[5 + n:]
    trailing = [(str(k), str(v)) for k, v in json.loads(rest)] if rest else []
    return _CODES.get(payload[0], grpc.StatusCode.UNKNOWN), message, trailing


# ----- the broker's side -----------------------------------------------------------------------

class _LinkGone(Exception):
    """The socket to the front failed: the front is gone (the reader tells the broker)."""


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class _Details:
    """What interceptors read of a call (grpc.HandlerCallDetails)."""

    method: str
    invocation_metadata: tuple


class _Call:
    def __init__(self, cid: int, method: int, peer_name: str, peer_pem: str, peer: str, metadata: tuple,
                 request: bytes) -> None:
        self.cid, self.method, self.peer_name, self.peer_pem, self.peer = cid, method, peer_name, peer_pem, peer
        self.metadata = metadata
        self.request = request
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # client-stream messages; None at the end
        self.credit = threading.Semaphore(WINDOW)  # answer messages the front may still take
        self.cancelled = threading.Event()
        self.trailing: tuple = ()
        self.serialize: Callable[[Any], bytes] = bytes  # the handler's, kept for a parked call's answer
        self.on_cancel: Callable[[], None] | None = None  # a parked call's wake-up (FrontLink._park)

    def cancel(self) -> None:
        self.cancelled.set()
        self.inbox.put(None)
        self.credit.release(WINDOW)
        on_cancel = self.on_cancel
        if on_cancel is not None:
            on_cancel()


class _Context:
    """What the handlers and interceptors use of a grpc.ServicerContext, for a call the
    front handed over."""

    #: a long-poll may answer Parked instead of waiting on its thread (FrontLink._park)
    parks = True

    def __init__(self, call: _Call) -> None:
        self._call = call

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)

    def auth_context(self) -> dict[str, list[bytes]]:
        """The client certificate's name and PEM, as the front's TLS saw them (mutual TLS)."""
        call, out = self._call, {}
        if call.peer_name:
            out["x509_common_name"] = [call.peer_name.encode()]
        if call.peer_pem:
            out["x509_pem_cert"] = [call.peer_pem.encode()]
        return out

    def peer(self) -> str:
        return self._call.peer

    def invocation_metadata(self) -> tuple:
        return self._call.metadata

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._call.trailing = tuple(metadata)

    def is_active(self) -> bool:
        return not self._call.cancelled.is_set()


def _intercepted(handler: Any, interceptors: Sequence[Any], details: _Details) -> Any:
    """The handler behind the interceptors, the first one outermost (as grpc's server
    applies them)."""
    def step(i: int) -> Callable[[Any], Any]:
        if i == len(interceptors):
            return lambda _details: handler
        return lambda d: interceptors[i].intercept_service(step(i + 1), d)
    return step(0)(details)


class _Timers:
    """Callbacks due at given times, run by one thread: the deadlines of parked calls. Most
    are woken before theirs, so a cancelled entry is only marked, and the heap is rebuilt
    without the marked ones once they outnumber the live ones."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[list] = []  # [when, seq, callback or None when cancelled]
        self._seq = 0
        self._dead = 0
        self._stopped = False
        self._thread: threading.Thread | None = None  # started by the first add

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap) - self._dead

    def add(self, delay_s: float, callback: Callable[[], None]) -> list:
        """Run `callback` in `delay_s` seconds (on the timers' thread); the entry, to cancel."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="broker-front-timers", daemon=True)
                self._thread.start()
            self._seq += 1
            entry = [time.monotonic() + delay_s, self._seq, callback]
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:
                self._cv.notify()
            return entry

    def cancel(self, entry: list) -> None:
        with self._cv:
            if entry[2] is None:
                return
            entry[2] = None
            self._dead += 1
            if self._dead > 1024 and self._dead * 2 > len(self._heap):
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)
                self._dead = 0

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                entry = heapq.heappop(self._heap)
                callback, entry[2] = entry[2], None
                if callback is None:
                    self._dead -= 1
                    continue
            try:
                callback()
            except Exception:  # noqa: BLE001 - one call's trouble must not stop every deadline
                log.exception("a parked call's deadline failed")


class FrontError(GraftFedError):
    """The front process did not start (its own error is in the broker's log, above)."""


def _exited_at_start(code: int | None) -> FrontError:
    return FrontError(f"the front process exited at start (status {code}); its error is above in this log")


def _socket_dir() -> str:
    """A private directory (mode 0700: only this user reaches the socket) whose socket path
    fits AF_UNIX's ~107 bytes however long TMPDIR is."""
    d = tempfile.mkdtemp(prefix="graft-fed-front-")
    if len(os.path.join(d, "broker.sock").encode()) > 100:
        os.rmdir(d)
        d = tempfile.mkdtemp(prefix="gff-", dir="/tmp")
    return d


class FrontLink:
    """The broker's end of the front: starts the front process, takes its calls from the
    socket and runs them on the broker's handlers in thread pools."""

    def __init__(self, service: str, methods: Sequence[tuple[str, str]], handlers: dict[str, Any],
                 interceptors: Sequence[Any], threads: int, on_lost: Callable[[str], None],
                 lanes: Sequence[tuple[Sequence[str], int]] = ()) -> None:
        """`lanes`: (methods, threads) each with a thread pool of its own; every other
        method runs on `threads` threads."""
        self.service, self.methods, self.handlers = service, list(methods), handlers
        self.interceptors = list(interceptors)
        self.on_lost = on_lost
        self._dir = _socket_dir()
        self.path = os.path.join(self._dir, "broker.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._sock: socket.socket | None = None
        self._write = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._timers = _Timers()  # parked long-polls' deadlines (its thread starts with the first)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        # grpcio's own server takes calls one at a time, which paces how many handlers run at
        # once; the front hands a round's thousand publishes over at once, and a thousand
        # threads contending for the interpreter made a round take seconds more (issue 13,
        # nineteenth pass). So the broker runs them on bounded pools, one per lane of calls
        # that must not take each other's threads (server.py says which).
        # (each started whole, the thread that went idle last serving next: broker/workers.py)
        self.pool = Workers(threads, "broker")
        self._pools = [self.pool]
        lane_of: dict[str, Workers] = {}
        for i, (names, size) in enumerate(lanes):
            lane = Workers(size, f"broker-lane{i}")
            self._pools.append(lane)
            lane_of.update({name: lane for name in names})
        self._pool_of = [lane_of.get(name, self.pool) for name, _ in methods]

    @property
    def pools(self) -> list[Workers]:
        """The worker pools the broker runs the front's calls on: the main one, then the lanes."""
        return list(self._pools)

    def start(self, listen: str, options: list, tls: tuple[str, str, str | None] | None,
              max_concurrent_rpcs: int, budget_bytes: int, timeout_s: float = 120.0,
              malloc_arena_max: int = 0, chunk_bytes: int = 0) -> int:
        """Start the front serving `listen`; returns its port. RuntimeError when it cannot
        listen there (what grpcio's own server raises), FrontError when it does not start.
        `malloc_arena_max` and `chunk_bytes`: the C heap's settings the broker has
        (broker/heap.py), for the front's own heap, where gRPC core's memory is."""
        spec = json.dumps({"listen": listen, "socket": self.path, "service": self.service, "methods": self.methods,
                           "options": options, "tls": list(tls) if tls else None,
                           "max_concurrent_rpcs": max_concurrent_rpcs, "budget_bytes": budget_bytes,
                           "malloc_arena_max": malloc_arena_max, "chunk_bytes": chunk_bytes})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # a session of its own: a Ctrl-C or a group's SIGTERM meant for the broker does not
        # reach it; the broker stops it (a STOP frame), and it exits when the broker is gone
        self.proc = subprocess.Popen([sys.executable, "-m", "graft_fed.broker.front", spec], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        try:
            self._connect(timeout_s)
            line = self._first_line(timeout_s)
        except BaseException:
            self._kill()
            raise
        if not line:
            raise _exited_at_start(self.proc.wait(10))
        if not line.isdigit():
            self._kill()
            # what grpcio raises for a port it cannot bind, so that callers say the same
            raise RuntimeError(f"Failed to bind to address {listen} (the front process: {line})")
        self.port = int(line)
        return self.port

    def serve(self) -> None:
        """Take the front's calls (until now they wait in the socket, as calls wait in gRPC
        for a server that is bound but not started)."""
        self._reader = threading.Thread(target=self._read, name="broker-front-link", daemon=True)
        self._reader.start()

    def _connect(self, timeout_s: float) -> None:
        assert self.proc is not None
        self._listener.settimeout(0.25)
        end = time.monotonic() + timeout_s
        while self._sock is None:
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                code = self.proc.poll()
                if code is not None:
                    raise _exited_at_start(code) from None
                if time.monotonic() > end:
                    raise FrontError(f"the front process did not connect within {timeout_s:.0f} s") from None
                continue
            sock.setblocking(True)
            if hasattr(socket, "SO_PEERCRED"):  # Linux: the peer must be the process started here
                pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))[0]
                if pid != self.proc.pid:
                    sock.close()
                    continue
            self._sock = sock
        # one front, one connection: the socket's name goes (nothing is left behind, even
        # after a SIGKILL) and nobody else can connect
        self._listener.close()
        os.unlink(self.path)
        os.rmdir(self._dir)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)

    def _first_line(self, timeout_s: float) -> str:
        """The front's one line on stdout: its port, or why it could not listen."""
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        try:
            if not select.select([out], [], [], timeout_s)[0]:
                raise FrontError(f"the front process did not say within {timeout_s:.0f} s whether it listens")
            return out.readline().decode(errors="replace").strip()
        finally:
            out.close()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop the front: it takes no new call and gives those in flight `grace` seconds
        (answered meanwhile, as grpcio's server.stop(grace) does), then exits."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None and self._sock is not None:
            try:
                grace = max(0.0, grace or 0.0)
                self._send(0, STOP, _F64.pack(grace))
                self.proc.wait(grace + 5)
            except (_LinkGone, subprocess.TimeoutExpired):
                pass
        self._kill()
        if self._reader is not None:
            self._reader.join(5)
        for call in list(self._calls.values()):
            call.cancel()
        if self._sock is not None:
            self._sock.close()
        self._listener.close()
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self._timers.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, cid: int, kind: int, payload: bytes, more: bytes = b"") -> None:
        frame = HEAD.pack(len(payload), cid, kind) + payload + more
        try:
            with self._write:
                assert self._sock is not None
                self._sock.sendall(frame)
        except OSError as exc:
            raise _LinkGone() from exc

    def _read(self) -> None:
        assert self._sock is not None
        rd = self._sock.makefile("rb", buffering=1 << 20)
        try:
            while True:
                head = rd.read(HEAD.size)
                if len(head) < HEAD.size:
                    break
                size, cid, kind = HEAD.unpack(head)
                payload = rd.read(size)
                if len(payload) < size:
                    break
                if kind == START:
                    call = self._start_call(cid, payload)
                    self._calls[cid] = call
                    self._pool_for(call).submit(self._run, call)
                    continue
                call = self._calls.get(cid)
                if call is None:
                    continue  # a call that ended meanwhile
                if kind == MSG:
                    call.inbox.put(payload)
                elif kind == CLOSE:
                    call.inbox.put(None)
                elif kind == CANCEL:
                    call.cancel()
                elif kind == CREDIT:
                    call.credit.release(_U32.unpack(payload)[0])
                elif kind == SENT:
                    call.inbox.put(payload)  # an answer stream's inbox holds nothing else
        except (OSError, ValueError, struct.error):
            pass
        finally:
            rd.close()
            for call in list(self._calls.values()):
                call.cancel()
            if not self._stopping:
                code = self.proc.poll() if self.proc is not None else None
                self.on_lost(f"the front process (gRPC on port {self.port}) exited"
                             + (f" with status {code}" if code is not None else "") + "; the broker stops")

    def _pool_for(self, call: _Call) -> Workers:
        """The pool of the call's lane (the main one for a method without a lane)."""
        pools = self._pool_of
        return pools[call.method] if call.method < len(pools) else self.pool

    @staticmethod
    def _start_call(cid: int, payload: bytes) -> _Call:
        raw, at = _unblobs(payload, 1, 4)
        parts = [b.decode(errors="replace") for b in raw]
        metadata = tuple((str(k), str(v)) for k, v in json.loads(parts[3])) if parts[3] else ()
        return _Call(cid, payload[0], parts[0], parts[1], parts[2], metadata, payload[at:])

    def _run(self, call: _Call, parked: Parked | None = None) -> None:
        """Run a call's handler, or go on with a parked one (`parked`: its wake-up or its
        deadline came, or the call was cancelled meanwhile)."""
        park: Parked | None = None
        try:
            if call.cancelled.is_set():
                if parked is not None:
                    parked.release()  # ended at the client while parked: nobody wants its answer
                return  # ended at the client before a thread took it (grpcio skips these too)
            if parked is not None:
                try:
                    out = parked.resume()
                except Parked as again:  # not answered yet (its bundles still awaited, say): it waits on
                    out = again
                park = self._unary_answer(call, out)
                return
            name, _kind = self.methods[call.method]
            ctx = _Context(call)
            handler = _intercepted(self.handlers[name], self.interceptors,
                                   _Details(f"/{self.service}/{name}", call.metadata))
            ser = call.serialize = handler.response_serializer or (lambda m: m)
            de = handler.request_deserializer or (lambda b: b)
            if handler.unary_unary:
                park = self._unary_answer(call, handler.unary_unary(de(call.request), ctx))
            elif handler.unary_stream:
                answers = handler.unary_stream(de(call.request), ctx)
                try:
                    for message in answers:
                        if isinstance(message, FileStream):
                            if not self._send_file(call, message):
                                return
                            continue
                        call.credit.acquire()  # a cancel releases the whole window: it wakes here
                        if call.cancelled.is_set():
                            return
                        self._send(call.cid, MSG, ser(message))
                finally:
                    close = getattr(answers, "close", None)
                    if close is not None:
                        close()
                self._end(call, grpc.StatusCode.OK, "")
            else:
                out = ser(handler.stream_unary(self._messages(call, de), ctx))
                self._end(call, grpc.StatusCode.OK, "", out)
        except _Aborted as exc:
            self._end(call, exc.code, exc.message)
        except grpc.RpcError:  # the client went away mid-stream (as grpc's own request iterator raises)
            self._end(call, grpc.StatusCode.CANCELLED, "the call was cancelled")
        except _LinkGone:
            pass  # the front is gone: _read tells the broker
        except Exception:  # noqa: BLE001 - the servicer maps its own; this is the link's last line
            log.exception("a call handed over by the front failed")
            self._end(call, grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        finally:
            if park is not None:
                self._park(call, park)
            else:
                self._calls.pop(call.cid, None)

    def _unary_answer(self, call: _Call, out: Any) -> Parked | None:
        """Send a unary handler's answer; a Parked one is returned instead, to park."""
        if isinstance(out, Parked):
            return out
        self._end(call, grpc.StatusCode.OK, "", call.serialize(out))
        return None

    def _park(self, call: _Call, parked: Parked) -> None:
        """Hold a long-poll without a thread: it goes back to its pool when its wake-up
        comes, when its deadline passes or when it is cancelled, whichever is first."""
        once = threading.Lock()
        entry: list = []

        def go_on() -> None:
            if not once.acquire(blocking=False):
                return
            call.on_cancel = None
            parked.wake.forget(go_on)
            if entry:
                self._timers.cancel(entry[0])
            try:
                self._pool_for(call).submit(self._run, call, parked)
            except RuntimeError:  # the link is stopping: its pools take nothing more
                parked.release()
                self._calls.pop(call.cid, None)

        call.on_cancel = go_on
        entry.append(self._timers.add(parked.timeout_s, go_on))
        parked.wake.when_set(go_on)  # at once, if it has come already
        if call.cancelled.is_set():  # cancelled before on_cancel was set: nobody else calls it
            go_on()

    def _send_file(self, call: _Call, stream: FileStream) -> bool:
        """Have the front send `stream`'s messages from the file; wait for what came of it
        (False: the call was cancelled meanwhile)."""
        self._send(call.cid, FILE, _FILE.pack(stream.start, stream.end, stream.chunk, stream.offset_field,
                                              stream.data_field)
                   + _blobs(os.fsencode(stream.path), stream.first, stream.later))
        got = call.inbox.get()
        if got is None:  # cancelled before the front said anything
            stream.outcome = "cancelled"
            return False
        outcome, stream.sent = _SENT.unpack_from(got)  # what went out counts, even if the client went
        stream.outcome = OUTCOMES[outcome] if outcome < len(OUTCOMES) else "failed"
        stream.reason = _unblobs(got, _SENT.size, 1)[0][0].decode(errors="replace")
        return stream.outcome != "cancelled" and not call.cancelled.is_set()

    def _messages(self, call: _Call, de: Callable[[bytes], Any]) -> Iterator[Any]:
        """A client stream's messages as the handler takes them: the front may send WINDOW
        once the handler asks for the first, and one more for each taken (nothing of a
        stream waits in the broker before a thread runs its handler)."""
        self._send(call.cid, CREDIT, _U32.pack(WINDOW))
        while True:
            data = call.inbox.get()
            if data is None:
                if call.cancelled.is_set():
                    raise grpc.RpcError()
                return
            self._send(call.cid, CREDIT, _U32.pack(1))
            yield de(data)

    def _end(self, call: _Call, code: grpc.StatusCode, message: str, answer: bytes | None = None) -> None:
        if call.cancelled.is_set():
            return  # nobody waits for it: the front forgot the call
        end = _end_payload(code, message, call.trailing)
        try:
            if answer is not None:
                self._send(call.cid, MSG, answer, HEAD.pack(len(end), call.cid, END) + end)
            else:
                self._send(call.cid, END, end)
        except _LinkGone:
            pass  # the front is gone: _read tells the broker


# ----- the front process ------------------------------------------------------------------------

async def _stream_file(write: Callable[[bytes], Any], payload: bytes, pool: futures.Executor,
                       report: Callable[[bytes], None]) -> None:
    """A FILE's messages, each written (`write`: the call's, awaited, so as fast as the
    client takes them) before the next chunk is read; `report` gets the SENT payload that
    says what came of it, also when the client goes (then the cancel is raised on)."""
    start, end, chunk, offset_field, data_field = _FILE.unpack_from(payload)
    (path, first, later), _ = _unblobs(payload, _FILE.size, 3)
    data_tag, offset_tag = varint(data_field << 3 | 2), varint(offset_field << 3)
    sent = 0

    def outcome(code: int, reason: str = "") -> None:
        report(_SENT.pack(code, sent) + _blobs(reason.encode(errors="replace")))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return outcome(1)
    except OSError as exc:
        return outcome(3, str(exc))
    buf = memoryview(bytearray(min(chunk, max(0, end - start))))  # one chunk, read into again and again
    reading: futures.Future | None = None
    try:
        off = start
        while True:
            want, got = min(chunk, end - off), 0
            if want:
                # in a thread: a read from a slow disk must not hold up every other call
                reading = pool.submit(os.preadv, fd, [buf[:want]], off)
                try:
                    got = await asyncio.wrap_future(reading)
                except OSError as exc:
                    return outcome(3, str(exc))
                if not got:
                    return outcome(2)
            # the message in one copy of the bytes: the fields, then the chunk as read
            await write(b"".join((first if off == start else later, offset_tag, varint(off), data_tag, varint(got),
                                  buf[:got])))
            sent += got
            off += got
            if off >= end:
                return outcome(0)
    except asyncio.CancelledError:
        outcome(4)
        raise
    finally:
        if reading is not None:  # after the read, which may still run (the client went mid-read)
            reading.add_done_callback(lambda _: os.close(fd))
        else:
            os.close(fd)


class _Budget:
    """Bytes the front has handed the broker and the broker has not taken yet (requests
    until their answer, stream messages until the broker takes them), at most `limit`:
    beyond it a request waits in the front, in order, rather than in the broker's memory.
    A request counts as at most `limit` (one larger still passes, alone)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit

    async def take(self, n: int) -> int:
        """Wait for `n` bytes of room; returns what to give back."""
        n = min(n, self.limit)
        if not self._waiters and self._fits(n):
            self.used += n
            return n
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give(n)  # granted, then cancelled before it could use it
            else:
                self._waiters.remove(entry)
                self._wake()  # a smaller one behind it may fit now
            raise
        return n

    def give(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self.used += n
                fut.set_result(None)


async def _serve(spec: dict) -> None:
    reader, writer = await asyncio.open_unix_connection(spec["socket"], limit=1 << 24)
    loop = asyncio.get_running_loop()
    calls: dict[int, asyncio.Queue] = {}
    budget = _Budget(int(spec["budget_bytes"]))
    files = futures.ThreadPoolExecutor(4, thread_name_prefix="front-files")  # FILE's reads
    last_id = 0

    def new_id() -> int:  # call ids wrap around, skipping those in flight
        nonlocal last_id
        while True:
            last_id = last_id % 0xFFFFFFFF + 1
            if last_id not in calls:
                return last_id

    def send(cid: int, kind: int, payload: bytes = b"") -> None:
        writer.write(HEAD.pack(len(payload), cid, kind) + payload)

    def open_call(index: int, context: grpc.aio.ServicerContext, request: bytes = b"") -> tuple[int, asyncio.Queue]:
        cid = new_id()
        q: asyncio.Queue = asyncio.Queue()
        calls[cid] = q
        auth = context.auth_context()
        names, pems = auth.get("x509_common_name") or [], auth.get("x509_pem_cert") or []
        metadata = [[m.key, m.value] for m in (context.invocation_metadata() or ()) if isinstance(m.value, str)]
        send(cid, START, bytes([index]) + _strings(names[0].decode(errors="replace") if names else "",
                                                   pems[0].decode(errors="replace") if pems else "",
                                                   context.peer() or "", json.dumps(metadata) if metadata else "")
             + request)
        return cid, q

    def close_call(cid: int, ended: bool) -> None:
        calls.pop(cid, None)
        if not ended and not writer.is_closing():
            send(cid, CANCEL)

    async def finish(context: grpc.aio.ServicerContext, payload: bytes) -> None:
        code, message, trailing = _parse_end(payload)
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)

    def unary_request(index: int, streamed: bool) -> Callable:
        """The handler of a method with one request: one answer, or (`streamed`) a stream of
        them written as the broker sends them, each credited once written."""
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes | None:
            held = await budget.take(len(request))
            try:
                cid, q = open_call(index, context, request)
                ended, answer = False, b""
                try:
                    while True:
                        kind, payload = await q.get()
                        if kind == MSG and streamed:
                            await context.write(payload)
                            send(cid, CREDIT, _U32.pack(1))
                        elif kind == FILE and streamed:
                            await _stream_file(context.write, payload, files, lambda p, c=cid: send(c, SENT, p))
                        elif kind == MSG:
                            answer = payload
                        elif kind == END:
                            ended = True
                            await finish(context, payload)
                            return None if streamed else answer
                finally:
                    close_call(cid, ended)
            finally:
                budget.give(held)
        return handle

    def stream_unary(index: int) -> Callable:
        async def handle(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
            cid, q = open_call(index, context)
            credit = asyncio.Semaphore(0)  # the broker grants WINDOW when its handler starts reading
            held: list[int] = []  # sizes of the messages sent, not yet taken by the broker

            async def pump() -> None:  # the client's messages to the broker, within its credit
                async for message in requests:
                    await credit.acquire()
                    held.append(await budget.take(len(message)))
                    send(cid, MSG, message)
                    await writer.drain()
                send(cid, CLOSE)

            def pumped(task: asyncio.Task) -> None:
                if not task.cancelled() and task.exception() is not None:
                    q.put_nowait((CANCEL, b""))  # the client's stream broke: end the call

            pumping = loop.create_task(pump())
            pumping.add_done_callback(pumped)
            ended, answer = False, b""
            try:
                while True:  # the broker may answer before the stream ends (a refusal)
                    kind, payload = await q.get()
                    if kind == CREDIT:
                        # the first grant comes before anything was sent; each later one says
                        # the broker took a message
                        for _ in range(_U32.unpack(payload)[0]):
                            credit.release()
                            if held:
                                budget.give(held.pop(0))
                    elif kind == MSG:
                        answer = payload
                    elif kind == END:
                        ended = True
                        pumping.cancel()
                        await finish(context, payload)
                        return answer
                    elif kind == CANCEL:
                        await context.abort(grpc.StatusCode.CANCELLED, "the upload's stream broke")
            finally:
                pumping.cancel()
                budget.give(sum(held))
                close_call(cid, ended)
        return handle

    kinds = {"unary_unary": (lambda i: unary_request(i, False), grpc.unary_unary_rpc_method_handler),
             "unary_stream": (lambda i: unary_request(i, True), grpc.unary_stream_rpc_method_handler),
             "stream_unary": (stream_unary, grpc.stream_unary_rpc_method_handler)}
    handlers = {name: kinds[kind][1](kinds[kind][0](i)) for i, (name, kind) in enumerate(spec["methods"])}
    server = grpc.aio.server(options=[tuple(o) for o in spec["options"]],
                             maximum_concurrent_rpcs=spec["max_concurrent_rpcs"])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(spec["service"], handlers),))
    tls = spec["tls"]
    try:
        port = (server.add_secure_port(spec["listen"], server_credentials(*tls)) if tls
                else server.add_insecure_port(spec["listen"]))
    except RuntimeError as exc:
        port, reason = 0, str(exc).split(";")[0]
    else:
        reason = f"cannot listen on {spec['listen']}"
    if not port:
        print(reason, flush=True)
        return
    await server.start()
    print(port, flush=True)
    sys.stdout = sys.stderr  # nothing more on the pipe the broker stopped reading

    stop_grace: list[float] = []

    async def read() -> None:
        try:
            while True:
                size, cid, kind = HEAD.unpack(await reader.readexactly(HEAD.size))
                payload = await reader.readexactly(size) if size else b""
                if kind == STOP:
                    stop_grace.append(_F64.unpack(payload)[0])
                    loop.create_task(server.stop(stop_grace[0]))  # answers still come meanwhile
                    continue
                q = calls.get(cid)
                if q is not None:
                    q.put_nowait((kind, payload))
        except (asyncio.IncompleteReadError, OSError):
            return  # the broker is gone, or closed the socket after a STOP

    reading = loop.create_task(read())
    stopped = loop.create_task(server.wait_for_termination())
    await asyncio.wait({reading, stopped}, return_when=asyncio.FIRST_COMPLETED)
    # asked to stop: the grace the broker gave; the broker gone: nothing can answer the calls
    await server.stop(stop_grace[0] if stop_grace and not reading.done() else 0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the broker stops the front, nobody else
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="front: %(levelname)s %(message)s")
    spec = json.loads(argv[0])
    # the broker's C heap settings, before gRPC core starts its threads (GLIBC_TUNABLES, with
    # the per-thread caches off, came in the environment)
    limit_malloc_arenas(spec.get("malloc_arena_max", 0))
    if spec.get("chunk_bytes"):
        keep_chunk_buffers(spec["chunk_bytes"])
    asyncio.run(_serve(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
