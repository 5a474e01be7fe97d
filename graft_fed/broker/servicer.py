"""gRPC servicer: decode, call the handler, encode, map errors. Nothing else lives here.

Requests are parsed here, not by grpcio: `add_to_server` registers every method with a
deserializer that never raises (bytes that do not parse as the method's message become a
`Malformed` request, answered INVALID_ARGUMENT), so no request can get grpcio's own
INTERNAL ("Exception deserializing request!"). Every parsed request then passes the
uniform bounds of graft_fed/federation/limits.py before a handler sees it."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import abc
import logging
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import grpc

from graft_fed.broker.front import FileStream
from graft_fed.broker.handlers import Federation
from graft_fed.broker.publishing import Received
from graft_fed.broker.wakeups import Parked
from graft_fed.federation.codec import (ColumnsOnWire, OfferEncoder, chunk_bytes, manifest_from_pb, manifest_to_pb,
                                        match_result_to_wire, offers_wire, parse_chunk, parse_publish, privacy_from_pb,
                                        report_entries_from_pb, summaries_from_columns, summaries_from_pb,
                                        summaries_in_bulk, upload_requests_wire, wire_bytes)
from graft_fed.federation.errors import FederationError, InvalidArgument, ResourceExhausted, Unavailable
from graft_fed.federation.limits import (MAX_ERROR_MESSAGE, MAX_FETCHES_PER_NODE, MAX_PUBLISHES_PER_NODE,
                                         MAX_REPEATED, MAX_UPLOADS_PER_NODE, MIN_CHUNK_BYTES, check_message, clip)
from graft_fed.federation.status import INTERNAL_MESSAGE, to_status
from graft_fed.federation.transport import TIMING_KEY
from graft_fed.federation.signing import pem_to_der
from graft_fed.federation.summaryblock import SummaryBlock, SummaryBlockError
from graft_fed.proto import broker_pb2 as pb
from graft_fed.proto import broker_pb2_grpc as pb_grpc

log = logging.getLogger("graft_fed.broker")


SERVICE = "graft_fed.v1.Broker"
_CHUNK_FIELDS = {f.name: f.number for f in pb.BundleChunk.DESCRIPTOR.fields}


class Malformed:
    """A request whose bytes did not parse as its message (the handler answers INVALID_ARGUMENT)."""

    node_id = ""  # what the identity interceptor reads

    def __init__(self, message: str, error: str) -> None:
        self.message, self.error = message, error


def _parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError, ...: the client's bytes
            return Malformed(cls.DESCRIPTOR.name, type(exc).__name__)
    return parse


class RawPublish:
    """A PublishRequest with the bytes it was parsed from: its summaries are read in bulk
    from those bytes (federation/codec.py::summaries_in_bulk), and its columns, when
    `parse_publish` read them in place, are `on_wire` (the message then has none)."""

    __slots__ = ("message", "raw", "on_wire")

    def __init__(self, message: pb.PublishRequest, raw: bytes, on_wire: ColumnsOnWire | None = None) -> None:
        self.message, self.raw, self.on_wire = message, raw, on_wire

    @property
    def node_id(self) -> str:  # what the identity interceptor reads
        return self.message.node_id

    @property
    def has_columns(self) -> bool:
        return self.on_wire is not None or self.message.HasField("columns")

    @property
    def count(self) -> int:
        """How many summaries the publish carries (counted, not decoded)."""
        if self.on_wire is not None:
            return len(self.on_wire.ids)
        m = self.message
        return len(m.columns.prompt_ids) if m.HasField("columns") else len(m.summaries)


def _publish_parser(data: bytes) -> Any:
    try:
        message, on_wire = parse_publish(data)
    except Exception as exc:  # noqa: BLE001 - as _parser: the client's bytes
        return Malformed(pb.PublishRequest.DESCRIPTOR.name, type(exc).__name__)
    return RawPublish(message, data, on_wire)


class RawChunk:
    """An upload's BundleChunk with its data apart (`codec.parse_chunk`): `message` has no
    data, `data` is the chunk's bytes, read from the request once."""

    __slots__ = ("message", "data")

    def __init__(self, message: pb.BundleChunk, data: bytes) -> None:
        self.message, self.data = message, data

    @property
    def node_id(self) -> str:  # what the identity interceptor reads
        return self.message.node_id


def _chunk_parser(data: bytes) -> Any:
    try:
        return RawChunk(*parse_chunk(data))
    except Exception as exc:  # noqa: BLE001 - as _parser: the client's bytes
        return Malformed(pb.BundleChunk.DESCRIPTOR.name, type(exc).__name__)


def parsed(request: Any) -> Any:
    """The request, checked against the uniform bounds; InvalidArgument when it is malformed.
    A publish's summaries and columns, and a report's entries, are only counted here:
    PublishSummaries checks them in bulk, ReportCompatibility as it reads them (federation/codec.py)."""
    if isinstance(request, Malformed):
        raise InvalidArgument(f"the request does not parse as a {request.message} ({request.error})")
    if isinstance(request, RawPublish):
        check_message(request.message, shallow=("summaries", "columns"))
        return request
    if isinstance(request, RawChunk):
        check_message(request.message)  # (its data is bounded by the upload: UploadBundle)
        return request
    if isinstance(request, pb.CompatibilityReport):
        # its entries are counted here and checked as the broker reads them, in a work slot
        # (codec.report_entries_from_pb): a field-by-field walk of a thousand entries took
        # about 4 ms of the interpreter per report, in every reporting node's thread at once
        check_message(request, shallow=("entries",))
        return request
    check_message(request)
    return request


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    context.abort(code, message if len(message) <= MAX_ERROR_MESSAGE else message[:MAX_ERROR_MESSAGE - 3] + "...")


class InFlight:
    """Calls of one kind in flight per node, bounded: a node streaming slowly (or not reading
    what it fetches) holds a worker thread per call, so it may hold only a few."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self._n: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, node_id: str) -> Iterator[None]:
        with self._lock:
            if self._n[node_id] >= self.limit:
                raise ResourceExhausted(f"node {clip(node_id)} already has {self.limit} {self.what} in flight; "
                                        "wait for them to finish")
            self._n[node_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._n[node_id] -= 1
                if not self._n[node_id]:
                    del self._n[node_id]


def _tag(request: Any) -> tuple[str, int]:
    """(request id, send time in ms) of a state-changing request, ("", 0) when it has no tag."""
    return (request.tag.request_id, request.tag.sent_at_ms) if request.HasField("tag") else ("", 0)


class RpcStats:
    """Per-RPC call counts, status codes and latencies for /metrics."""

    BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, float("inf"))

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.hist: dict[str, list[int]] = defaultdict(lambda: [0] * len(self.BUCKETS))
        self.sum: dict[str, float] = defaultdict(float)

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.calls[(method, code.name)] += 1
        self.sum[method] += seconds
        for i, b in enumerate(self.BUCKETS):
            if seconds <= b:
                self.hist[method][i] += 1


class TimingInterceptor(grpc.ServerInterceptor):
    """Answers a unary call that asks for it (request metadata TIMING_KEY) with the broker's
    times in its trailing metadata: when the serving thread took the call (this runs there),
    when a worker entered the handler chain, when the handler returned. Calls that do not ask
    pass through untouched. Placed first, so "entered" is before the identity check."""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not handler.unary_unary or not any(
                k == TIMING_KEY for k, _ in details.invocation_metadata or ()):
            return handler
        picked = time.time_ns()
        inner = handler.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            entered = time.time_ns()
            response = inner(request, context)
            context.set_trailing_metadata(((TIMING_KEY, f"{picked},{entered},{time.time_ns()}"),))
            return response
        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


def _mapped(stats: "RpcStats", name: str, context: grpc.ServicerContext, t0: float, step: Callable[[], Any]) -> Any:
    """step(), its domain errors mapped to status codes and anything unexpected to a
    sanitised INTERNAL (the call aborted, the failure counted in `stats`)."""
    try:
        return step()
    except Parked:
        raise  # not an error: the call waits on without a thread (_continued)
    except FederationError as exc:
        code, message = to_status(exc)
        stats.observe(name, code, time.perf_counter() - t0)
        _abort(context, code, message)
    except SummaryBlockError as exc:
        # raised only for stored bytes (what the broker wrote no longer decodes, or a block
        # file no longer holds what its row says): as for a damaged match set or bundle
        # file, the operator reads what in the log, the caller is told the storage failed
        # (UNAVAILABLE, retried), never a bare INTERNAL
        log.error("%s: a stored summary block is damaged (a damaged volume, or a restored backup whose block files "
                  "are older than its database?): %s", name, exc)
        code, message = to_status(Unavailable("the broker's storage failed reading stored summaries: retry later "
                                              "(details in the broker's log)"))
        stats.observe(name, code, time.perf_counter() - t0)
        _abort(context, code, message)
    except Exception:  # noqa: BLE001 - the last line of defence: never leak internals
        log.exception("%s failed", name)
        stats.observe(name, grpc.StatusCode.INTERNAL, time.perf_counter() - t0)
        _abort(context, grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _rpc(method: Callable) -> Callable:
    """A handler with one answer: its request checked first (a stream's messages are
    checked one by one), its errors mapped (_mapped), its call counted."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: "BrokerServicer", request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        try:
            return _counted(self.stats, name, context, t0, lambda: method(
                self, request if isinstance(request, abc.Iterator) else parsed(request), context))
        except Parked as parked:  # the answer the front's link holds and resumes (broker/front.py)
            return _continued(parked, lambda resume: _counted(self.stats, name, context, t0, resume))
    return wrapper


def _counted(stats: RpcStats, name: str, context: grpc.ServicerContext, t0: float, step: Callable[[], Any]) -> Any:
    """step()'s answer, its errors mapped (_mapped) and the call counted once it has one; a
    Parked step is not counted yet."""
    answer = _mapped(stats, name, context, t0, step)
    stats.observe(name, grpc.StatusCode.OK, time.perf_counter() - t0)
    return answer


def _continued(parked: Parked, then: Callable[[Callable[[], Any]], Any]) -> Parked:
    """`parked` whose answer, when it comes, is `then(resume)` with its own resume, however
    often it parks again on the way (each time raised, as wakeups.Parked says)."""
    inner = parked.resume

    def resume() -> Any:
        try:
            return then(inner)
        except Parked as again:
            raise _continued(again, then) from None
    parked.resume = resume
    return parked


class BrokerServicer(pb_grpc.BrokerServicer):
    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.stats = RpcStats()
        self.chunk = fed.cfg.chunk_kib * 1024
        self.max_bundle = fed.cfg.max_bundle_mib * 2**20
        self.uploads = InFlight(MAX_UPLOADS_PER_NODE, "uploads")
        self.fetches = InFlight(MAX_FETCHES_PER_NODE, "fetches")
        self.publishes = InFlight(MAX_PUBLISHES_PER_NODE, "publishes")

    @_rpc
    def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinResponse:
        if not request.HasField("manifest"):
            raise InvalidArgument("JoinRequest.manifest is required")
        with self.fed.replay.admit("Join", request.node_id, *_tag(request)):
            session, current = self.fed.join(request.node_id, request.model_id, request.tokenizer_id,
                                             manifest_from_pb(request.manifest), privacy_from_pb(request.privacy),
                                             request.resume_round, request.node_secret)
        return pb.JoinResponse(session_id=session, manifest=manifest_to_pb(self.fed.manifest), current_round=current,
                               heartbeat_interval_ms=self._heartbeat_ms(), max_bundle_mib=self.fed.cfg.max_bundle_mib)

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context: Any) -> pb.LeaveResponse:
        with self.fed.replay.admit("Leave", request.node_id, *_tag(request)):
            self.fed.leave(request.node_id, request.session_id)
        return pb.LeaveResponse()

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        with self.fed.replay.admit("Heartbeat", request.node_id, *_tag(request)):
            current, online = self.fed.heartbeat(request.node_id, request.session_id, request.round)
        return pb.HeartbeatResponse(current_round=current, online_nodes=online,
                                    heartbeat_interval_ms=self._heartbeat_ms())

    def _heartbeat_ms(self) -> int:
        """The interval nodes are told to heartbeat at now (the broker's cadence), on the wire."""
        return int(self.fed.heartbeat_interval_s() * 1000)

    @_rpc
    def PublishSummaries(self, raw: RawPublish, context: Any) -> pb.PublishResponse:
        request = raw.message
        # Decoded, checked and stored by the publish queue's thread, this one asleep meanwhile
        # (`publish_queue`: broker/publishqueue.py), else by this thread; the answer, or the
        # error, is this publish's own. What is refused without decoding is refused here,
        # first: a publish without the node's live session, one with more summaries than a
        # round allows, and a node's publish beyond its few in flight (each holds a thread).
        self.fed.check_session(request.node_id, request.session_id)
        count = raw.count
        if count <= MAX_REPEATED:  # beyond, the codec refuses it first, in check_message's words, decoding nothing
            self.fed.check_count(count)
        with self.publishes.hold(request.node_id):
            accepted, dups = self.fed.publish_received(Received(request.node_id, request.session_id, request.round,
                                                            lambda: self._prepare_publish(raw)))
        return pb.PublishResponse(accepted=accepted, duplicates=dups)

    def _prepare_publish(self, raw: RawPublish) -> tuple[SummaryBlock, Callable[[bool], None]]:
        """A publish's summaries as a checked block and its replay ticket's end (run in a work
        slot, by the publish queue's thread or this publish's own)."""
        request = raw.message
        if raw.has_columns:
            if request.summaries:
                raise InvalidArgument("a publish carries summaries or columns, not both")
            bulk = summaries_from_columns(request, raw.raw, raw.on_wire)
            if not bulk.within_bounds():
                raise InvalidArgument("columns.policy_versions: a value does not fit a signed 64-bit integer")
        else:
            bulk = summaries_in_bulk(request, raw.raw)
            if bulk is None or not bulk.within_bounds():
                check_message(request)  # the summaries one by one: raises what a bound says
                bulk = None
        if bulk is not None:
            if not bulk.rounds_are(request.round):
                raise InvalidArgument("every summary's round must equal the request's round")
            block = bulk.block
            # the checks change nothing: a replay of an accepted publish passes them and is
            # refused below as before
            self.fed.check_block(request.node_id, request.round, block)
        else:
            for s in request.summaries:
                if s.round != request.round:
                    raise InvalidArgument("every summary's round must equal the request's round")
            block = self.fed.check_rows(request.node_id, request.round, summaries_from_pb(request))
        ticket = self.fed.replay.begin("PublishSummaries", request.node_id, *_tag(request))
        return block, lambda stored: self.fed.replay.end(ticket, stored)

    @_rpc
    def GetMatches(self, request: pb.MatchRequest, context: Any) -> bytes:
        # the answer leaves as bytes: its offers were encoded once per round (see the codec).
        # A call the front handed over waits without a thread (`parks`): parked, then resumed
        # by the front's link (broker/front.py) when its round or bundles wake it
        try:
            res = self.fed.get_matches(request.node_id, request.session_id, request.round, request.wait_ms / 1000.0,
                                       wait_for_bundles=request.wait_for_bundles,
                                       encode=(OfferEncoder, upload_requests_wire, offers_wire),
                                       park=getattr(context, "parks", False))
        except Parked as parked:
            raise _continued(parked, lambda resume: match_result_to_wire(resume())) from None
        return match_result_to_wire(res)

    @_rpc
    def UploadBundle(self, request_iterator: Iterator[RawChunk], context: Any) -> pb.UploadResponse:
        with contextlib.ExitStack() as stack:
            return self._upload(request_iterator, context, stack)

    def _upload(self, request_iterator: Iterator[RawChunk], context: Any,
                stack: contextlib.ExitStack) -> pb.UploadResponse:
        first: pb.BundleChunk | None = None
        upload = None  # the chunks go into it as they arrive: the servicer holds one at a time
        received = last = 0
        ticket, applied = None, False
        min_chunk = min(MIN_CHUNK_BYTES, self.chunk)
        try:
            for request in request_iterator:
                raw = parsed(request)
                chunk, data = raw.message, raw.data
                if first is None:
                    first = chunk
                    if chunk.total_size > self.max_bundle:
                        raise ResourceExhausted(f"bundle of {chunk.total_size} bytes exceeds the broker's limit "
                                                f"of {self.max_bundle} bytes")
                    ticket = self.fed.replay.begin("UploadBundle", chunk.node_id, *_tag(chunk))
                    self.fed.upload_allowed(chunk.node_id, chunk.session_id)
                    stack.enter_context(self.uploads.hold(chunk.node_id))
                    pem = context.auth_context().get("x509_pem_cert") or []  # the mTLS client certificate, if any
                    upload = self.fed.begin_upload(chunk.node_id, chunk.session_id, chunk.prompt_id, chunk.round,
                                                   chunk.digest, chunk.total_size, signature=chunk.signature,
                                                   signer_cert=pem_to_der(pem[0]) if pem else b"")
                    stack.callback(upload.abort)  # whatever ends the call: nothing of a refused upload stays
                else:
                    if (chunk.digest, chunk.total_size, chunk.node_id, chunk.prompt_id, chunk.round) != (
                            first.digest, first.total_size, first.node_id, first.prompt_id, first.round):
                        raise InvalidArgument("every chunk of one upload must carry the same digest, size, node, "
                                              "prompt and round")
                    if last < min_chunk:  # a trickle of tiny chunks would hold a thread for hours
                        raise InvalidArgument(f"a chunk of {last} bytes that is not the last; every chunk but the "
                                              f"last carries at least {min_chunk} bytes")
                if len(data) > self.chunk:
                    raise InvalidArgument(f"chunk of {len(data)} bytes exceeds the chunk size {self.chunk}")
                if chunk.offset != received:
                    raise InvalidArgument(f"chunk offset {chunk.offset} but {received} bytes received so far")
                received += len(data)
                last = len(data)
                if received > first.total_size:
                    raise InvalidArgument("chunks exceed the declared total_size")
                upload.write(data)
            if first is None:
                raise InvalidArgument("empty upload: send at least one chunk")
            if received != first.total_size:
                raise InvalidArgument(f"upload ended after {received} of {first.total_size} bytes")
            stored = upload.finish()
            applied = True
        finally:
            self.fed.replay.end(ticket, applied)
        return pb.UploadResponse(digest=first.digest, stored=stored)

    @_rpc
    def HasBundles(self, request: pb.HasBundlesRequest, context: Any) -> pb.HasBundlesResponse:
        return pb.HasBundlesResponse(present=self.fed.has_bundles(request.node_id, request.session_id,
                                                                  list(request.digests)))

    def FetchBundle(self, request: pb.FetchBundleRequest, context: Any) -> Iterator[bytes]:
        return self._fetch(request, context, from_file=False)

    def fetch_through_front(self, request: pb.FetchBundleRequest, context: Any) -> Iterator[Any]:
        """FetchBundle behind the front process: a bundle whose bytes are a file is sent by
        the front from the file (a FileStream), not read here and copied through the socket."""
        return self._fetch(request, context, from_file=True)

    def _fetch(self, request: pb.FetchBundleRequest, context: Any, from_file: bool) -> Iterator[Any]:
        t0 = time.perf_counter()

        def opened() -> tuple[Any, int, bytes, bytes]:
            checked = parsed(request)
            return checked, *self.fed.open_bundle(checked.node_id, checked.session_id, checked.digest)
        request, size, signature, cert = _mapped(self.stats, "FetchBundle", context, t0, opened)
        hold = self.fetches.hold(request.node_id)
        _mapped(self.stats, "FetchBundle", context, t0, hold.__enter__)
        try:
            # a bundle from before the broker's start is read whole at its first fetch: within
            # the node's bound on fetches in flight (broker/bundles.py, _check_intact)
            _mapped(self.stats, "FetchBundle", context, t0, lambda: self.fed.check_stored_bundle(request.digest))
            where = _mapped(self.stats, "FetchBundle", context, t0,
                            lambda: self.fed.bundle_file(request.digest)) if from_file else None
            self.stats.observe("FetchBundle", grpc.StatusCode.OK, time.perf_counter() - t0)
            if where is not None:
                stream = FileStream(
                    where[0], 0, size, self.chunk,
                    first=pb.BundleChunk(digest=request.digest, total_size=size, signature=signature,
                                         signer_cert=cert).SerializeToString(),
                    later=pb.BundleChunk(digest=request.digest, total_size=size).SerializeToString(),
                    offset_field=_CHUNK_FIELDS["offset"], data_field=_CHUNK_FIELDS["data"])
                try:
                    yield stream
                finally:  # also when the client went (the generator closed at the yield)
                    self.fed.bytes_sent(stream.sent)
                try:
                    self.fed.file_unsent(request.digest, stream.outcome, stream.reason)
                except FederationError as exc:
                    _abort(context, *to_status(exc))
                return
            # one chunk read from the state at a time: memory per fetch is bounded by the chunk
            chunks = self.fed.stream_bundle(request.digest, self.chunk)
            off = 0
            while True:
                try:
                    data = next(chunks, None)
                except FederationError as exc:
                    code, message = to_status(exc)
                    _abort(context, code, message)
                if data is None:
                    break
                yield chunk_bytes(pb.BundleChunk(digest=request.digest, total_size=size, offset=off,
                                                 signature=signature if off == 0 else b"",
                                                 signer_cert=cert if off == 0 else b""), data)
                off += len(data)
        finally:
            hold.__exit__(None, None, None)

    @_rpc
    def ReportCompatibility(self, request: pb.CompatibilityReport, context: Any) -> pb.ReportResponse:
        with self.fed.replay.admit("ReportCompatibility", request.node_id, *_tag(request)):
            accepted, dups = self.fed.report(request.node_id, request.session_id, request.round,
                                             report_entries_from_pb(request))
        return pb.ReportResponse(accepted=accepted, duplicates=dups)

    @_rpc
    def GetStatus(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        st = self.fed.status(max_pairs=self.fed.cfg.max_pairs_shown)
        return pb.StatusResponse(
            manifest=manifest_to_pb(st["manifest"]), current_round=st["current_round"],
            nodes=[pb.StatusResponse.Node(**n) for n in st["nodes"]],
            pairs=[pb.StatusResponse.Pair(**p) for p in st["pairs"]], pairs_total=st["pairs_total"],
            bundles=st["bundles"], bundle_bytes=st["bundle_bytes"], max_node_summaries=st["max_node_summaries"],
            max_node_bundle_bytes=st["max_node_bundle_bytes"])

    #: the live page's scalar store (graft_fed/broker/live.py), set by the BrokerServer
    scalars: Any = None

    @_rpc
    def ReportScalars(self, request: pb.ScalarsRequest, context: Any) -> pb.ScalarsResponse:
        values = {s.name: s.value for s in request.scalars}
        if self.scalars is not None:
            self.scalars.validate(values)
            self.fed.check_session(request.node_id, request.session_id)  # a live session, or UNAUTHENTICATED
            self.scalars.record(request.node_id, request.step, values)
        return pb.ScalarsResponse()


#: method -> (kind, request message, response message), as in protos/graft_fed/v1/broker.proto
METHODS: dict[str, tuple[str, Any, Any]] = {
    "Join": ("unary_unary", pb.JoinRequest, pb.JoinResponse),
    "Leave": ("unary_unary", pb.LeaveRequest, pb.LeaveResponse),
    "Heartbeat": ("unary_unary", pb.HeartbeatRequest, pb.HeartbeatResponse),
    "PublishSummaries": ("unary_unary", pb.PublishRequest, pb.PublishResponse),
    "GetMatches": ("unary_unary", pb.MatchRequest, pb.MatchResponse),
    "UploadBundle": ("stream_unary", pb.BundleChunk, pb.UploadResponse),
    "HasBundles": ("unary_unary", pb.HasBundlesRequest, pb.HasBundlesResponse),
    "FetchBundle": ("unary_stream", pb.FetchBundleRequest, pb.BundleChunk),
    "ReportCompatibility": ("unary_unary", pb.CompatibilityReport, pb.ReportResponse),
    "GetStatus": ("unary_unary", pb.StatusRequest, pb.StatusResponse),
    "ReportScalars": ("unary_unary", pb.ScalarsRequest, pb.ScalarsResponse),
}


#: methods whose requests are read by a parser of their own (the rest: `_parser`)
_parsers = {"PublishSummaries": _publish_parser, "UploadBundle": _chunk_parser}


def add_to_server(servicer: BrokerServicer, server: grpc.Server) -> None:
    """Register the servicer's methods with deserializers that never raise (see the module
    docstring): the replacement for the generated add_BrokerServicer_to_server.

    Registered methods, not a generic handler: grpcio's serving thread keeps one request for
    a new call outstanding per registered method and one for all generic ones, and takes the
    next call of that kind only once it has taken the last (with the interpreter). Behind one
    generic request, a heartbeat that arrives with a burst of 64 publishes waits for the
    serving thread to take all 64 first; with a request of its own it is taken at once
    (issue 13, docs/performance.md, forty-first pass). A method the service lacks still
    reaches grpcio's generic request and is answered UNIMPLEMENTED."""
    server.add_registered_method_handlers(SERVICE, method_handlers(servicer))


def method_handlers(servicer: BrokerServicer, front: bool = False) -> dict[str, grpc.RpcMethodHandler]:
    """The servicer's methods by name, as grpc method handlers (add_to_server's, and, with
    `front`, what the front hands its calls to: broker/front.py, where FetchBundle may
    answer with a FileStream)."""
    factories = {"unary_unary": grpc.unary_unary_rpc_method_handler,
                 "stream_unary": grpc.stream_unary_rpc_method_handler,
                 "unary_stream": grpc.unary_stream_rpc_method_handler}
    own = {"FetchBundle": servicer.fetch_through_front} if front else {}
    handlers = {name: factories[kind](own.get(name) or getattr(servicer, name),
                                      request_deserializer=_parsers.get(name) or _parser(req),
                                      response_serializer=wire_bytes)
                for name, (kind, req, _) in METHODS.items()}
    return handlers
