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
broker -> front
  MSG     one answer message
  END     <u8 status code><u32 n><message utf-8><trailing metadata JSON>
  CREDIT  <u32 n>: the broker has taken n more of the call's stream messages

Streams are flow-controlled both ways with a window of WINDOW messages per call, so a
transfer holds a few chunks in each process, whatever the bundle's size. The socket lives
in a private directory (mode 0700) and is the broker's only listener besides HTTP; the
front accepts no other connection to it. If the front exits, the broker stops (the
`graft-fed broker` command exits non-zero, for its supervisor to restart it); if the broker
exits, the front sees the socket close and exits too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Sequence

import grpc

log = logging.getLogger(__name__)

HEAD = struct.Struct("<IIB")
START, MSG, CLOSE, CANCEL, CREDIT, END = 1, 2, 3, 4, 5, 6
WINDOW = 4  # stream messages in flight per call and direction
_U32 = struct.Struct("<I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _strings(*values: str) -> bytes:
    out = []
    for v in values:
        b = v.encode()
        out.append(_U32.pack(len(b)) + b)
    return b"".join(out)


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

    def cancel(self) -> None:
        self.cancelled.set()
        self.inbox.put(None)
        self.credit.release(WINDOW)


class _Context:
    """What the handlers and interceptors use of a grpc.ServicerContext, for a call the
    front handed over."""

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


class FrontLink:
    """The broker's end of the front: starts the front process, takes its calls from the
    socket and runs them on the broker's handlers in a thread pool of `max_workers`."""

    def __init__(self, service: str, methods: Sequence[tuple[str, str]], handlers: dict[str, Any],
                 interceptors: Sequence[Any], max_workers: int, on_lost: Callable[[str], None],
                 long_polls: Sequence[str] = (), max_long_polls: int = 0) -> None:
        self.service, self.methods, self.handlers = service, list(methods), handlers
        self.interceptors = list(interceptors)
        self.on_lost = on_lost
        # Two pools. grpcio's own server takes calls one at a time, which paces how many
        # handlers run at once; the front hands a round's thousand publishes over at once, and
        # a thousand threads contending for the interpreter made a round take seconds more
        # (issue 13, nineteenth pass). Calls that wait (`long_polls`: GetMatches) get threads
        # of their own, up to `max_workers`; every other call one of the rest of the
        # broker's threads (max_workers - max_long_polls, at least 8), however many arrive.
        self.pool = futures.ThreadPoolExecutor(max_workers=max(8, max_workers - max_long_polls),
                                               thread_name_prefix="broker")
        self.waits = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="broker-wait")
        self._waiting = {i for i, (name, _) in enumerate(methods) if name in set(long_polls)}
        self._dir = tempfile.mkdtemp(prefix="graft-fed-front-")  # mode 0700: only this user reaches the socket
        self.path = os.path.join(self._dir, "broker.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._sock: socket.socket | None = None
        self._write = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._stopping = False
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, listen: str, options: list, tls: tuple[str, str, str | None] | None,
              max_concurrent_rpcs: int) -> int:
        """Start the front serving `listen`; returns its port. RuntimeError when it cannot
        listen there (as grpcio's own server), OSError when the front does not start."""
        spec = json.dumps({"listen": listen, "socket": self.path, "service": self.service, "methods": self.methods,
                           "options": options, "tls": list(tls) if tls else None,
                           "max_concurrent_rpcs": max_concurrent_rpcs})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "graft_fed.broker.front", spec], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, env=env)
        self._listener.settimeout(120)
        try:
            self._sock, _ = self._listener.accept()
        except OSError:
            self._kill()
            raise OSError("the front process did not connect to the broker") from None
        self._listener.close()  # one front, one connection: nobody else gets in
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        line = self.proc.stdout.readline() if self.proc.stdout else b""
        if not line.strip().isdigit():
            self._kill()
            # what grpcio raises for a port it cannot bind, so that callers say the same
            raise RuntimeError(f"Failed to bind to address {listen} (the front process: "
                               f"{line.decode(errors='replace').strip() or 'exited'})")
        self.port = int(line)
        threading.Thread(target=self._read, name="broker-front-link", daemon=True).start()
        return self.port

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace: float = 1.0) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the front stops taking calls and ends those in flight
            try:
                self.proc.wait(grace + 5)
            except subprocess.TimeoutExpired:
                self._kill()
        for call in list(self._calls.values()):
            call.cancel()
        if self._sock is not None:
            self._sock.close()
        self._listener.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.waits.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, cid: int, kind: int, payload: bytes, more: bytes = b"") -> None:
        frame = HEAD.pack(len(payload), cid, kind) + payload + more
        with self._write:
            assert self._sock is not None
            self._sock.sendall(frame)

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
                    (self.waits if call.method in self._waiting else self.pool).submit(self._run, call)
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
        except OSError:
            pass
        finally:
            for call in list(self._calls.values()):
                call.cancel()
            if not self._stopping:
                code = self.proc.poll() if self.proc is not None else None
                self.on_lost(f"the front process (gRPC on port {self.port}) exited"
                             + (f" with status {code}" if code is not None else "") + "; the broker stops")

    @staticmethod
    def _start_call(cid: int, payload: bytes) -> _Call:
        method, at = payload[0], 1
        parts = []
        for _ in range(4):
            n = _U32.unpack_from(payload, at)[0]
            parts.append(payload[at + 4:at + 4 + n].decode(errors="replace"))
            at += 4 + n
        metadata = tuple((str(k), str(v)) for k, v in json.loads(parts[3])) if parts[3] else ()
        return _Call(cid, method, parts[0], parts[1], parts[2], metadata, payload[at:])

    def _run(self, call: _Call) -> None:
        try:
            name, _kind = self.methods[call.method]
            ctx = _Context(call)
            handler = _intercepted(self.handlers[name], self.interceptors,
                                   _Details(f"/{self.service}/{name}", call.metadata))
            ser = handler.response_serializer or (lambda m: m)
            de = handler.request_deserializer or (lambda b: b)
            if handler.unary_unary:
                out = ser(handler.unary_unary(de(call.request), ctx))
                self._end(call, grpc.StatusCode.OK, "", out)
            elif handler.unary_stream:
                answers = handler.unary_stream(de(call.request), ctx)
                try:
                    for message in answers:
                        while not call.credit.acquire(timeout=1.0):
                            if call.cancelled.is_set():
                                break
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
        except Exception:  # noqa: BLE001 - the servicer maps its own; this is the link's last line
            log.exception("a call handed over by the front failed")
            self._end(call, grpc.StatusCode.INTERNAL, "internal error")
        finally:
            self._calls.pop(call.cid, None)

    def _messages(self, call: _Call, de: Callable[[bytes], Any]) -> Iterator[Any]:
        """A client stream's messages, each taken from the socket's frames; the front may send
        one more for each taken (its window)."""
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
        except OSError:
            pass  # the front is gone: _read tells the broker


# ----- the front process ------------------------------------------------------------------------

def _credentials(tls: list | None) -> grpc.ServerCredentials | None:
    if not tls:
        return None
    from graft_fed.federation.transport import server_credentials

    return server_credentials(tls[0], tls[1], tls[2])


async def _serve(spec: dict) -> None:
    reader, writer = await asyncio.open_unix_connection(spec["socket"], limit=1 << 24)
    loop = asyncio.get_running_loop()
    calls: dict[int, asyncio.Queue] = {}
    next_id = iter(range(1, 2**32)).__next__

    def send(cid: int, kind: int, payload: bytes = b"") -> None:
        writer.write(HEAD.pack(len(payload), cid, kind) + payload)

    def open_call(index: int, context: grpc.aio.ServicerContext, request: bytes = b"") -> tuple[int, asyncio.Queue]:
        cid = next_id()
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

    def unary_unary(index: int) -> Callable:
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            cid, q = open_call(index, context, request)
            ended, answer = False, b""
            try:
                while True:
                    kind, payload = await q.get()
                    if kind == MSG:
                        answer = payload
                    elif kind == END:
                        ended = True
                        await finish(context, payload)
                        return answer
            finally:
                close_call(cid, ended)
        return handle

    def unary_stream(index: int) -> Callable:
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            cid, q = open_call(index, context, request)
            ended = False
            try:
                while True:
                    kind, payload = await q.get()
                    if kind == MSG:
                        await context.write(payload)
                        send(cid, CREDIT, _U32.pack(1))
                    elif kind == END:
                        ended = True
                        await finish(context, payload)
                        return
            finally:
                close_call(cid, ended)
        return handle

    def stream_unary(index: int) -> Callable:
        async def handle(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
            cid, q = open_call(index, context)
            credit = asyncio.Semaphore(WINDOW)

            async def pump() -> None:  # the client's messages to the broker, WINDOW ahead at most
                async for message in requests:
                    await credit.acquire()
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
                        for _ in range(_U32.unpack(payload)[0]):
                            credit.release()
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
                close_call(cid, ended)
        return handle

    kinds = {"unary_unary": (unary_unary, grpc.unary_unary_rpc_method_handler),
             "unary_stream": (unary_stream, grpc.unary_stream_rpc_method_handler),
             "stream_unary": (stream_unary, grpc.stream_unary_rpc_method_handler)}
    handlers = {name: kinds[kind][1](kinds[kind][0](i)) for i, (name, kind) in enumerate(spec["methods"])}
    server = grpc.aio.server(options=[tuple(o) for o in spec["options"]],
                             maximum_concurrent_rpcs=spec["max_concurrent_rpcs"])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(spec["service"], handlers),))
    creds = _credentials(spec["tls"])
    try:
        port = server.add_secure_port(spec["listen"], creds) if creds else server.add_insecure_port(spec["listen"])
    except RuntimeError as exc:
        port, reason = 0, str(exc).split(";")[0]
    else:
        reason = f"cannot listen on {spec['listen']}"
    if not port:
        print(reason, flush=True)
        return
    await server.start()
    print(port, flush=True)

    async def read() -> None:
        try:
            while True:
                size, cid, kind = HEAD.unpack(await reader.readexactly(HEAD.size))
                payload = await reader.readexactly(size) if size else b""
                q = calls.get(cid)
                if q is not None:
                    q.put_nowait((kind, payload))
        except (asyncio.IncompleteReadError, OSError):
            return  # the broker is gone

    stopped = asyncio.Event()
    try:
        import signal

        loop.add_signal_handler(signal.SIGTERM, stopped.set)
    except (NotImplementedError, RuntimeError):
        pass
    reading = loop.create_task(read())
    waiting = loop.create_task(stopped.wait())
    await asyncio.wait({reading, waiting}, return_when=asyncio.FIRST_COMPLETED)
    # asked to stop: the calls in flight get a second; the broker gone: nothing can answer them
    await server.stop(1.0 if waiting.done() else 0)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="front: %(levelname)s %(message)s")
    asyncio.run(_serve(json.loads(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
