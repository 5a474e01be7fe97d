"""gRPC servicer: decode, call the handler, encode, map errors. Nothing else lives here."""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import grpc

from graft_fed.broker.handlers import Federation
from graft_fed.federation.codec import (manifest_from_pb, manifest_to_pb, match_result_to_pb, privacy_from_pb,
                                        report_entries_from_pb, summaries_from_pb)
from graft_fed.federation.errors import FederationError, InvalidArgument, ResourceExhausted
from graft_fed.federation.status import INTERNAL_MESSAGE, to_status
from graft_fed.federation.signing import pem_to_der
from graft_fed.proto import broker_pb2 as pb
from graft_fed.proto import broker_pb2_grpc as pb_grpc

log = logging.getLogger("graft_fed.broker")


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


def _rpc(method: Callable) -> Callable:
    """Map domain errors to status codes; anything unexpected becomes a sanitised INTERNAL."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: "BrokerServicer", request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return method(self, request, context)
        except FederationError as exc:
            code, message = to_status(exc)
            self.stats.observe(name, code, time.perf_counter() - t0)
            context.abort(code, message)
        except Exception:  # noqa: BLE001 - the last line of defence: never leak internals
            log.exception("%s failed", name)
            code = grpc.StatusCode.INTERNAL
            self.stats.observe(name, code, time.perf_counter() - t0)
            context.abort(code, INTERNAL_MESSAGE)
        finally:
            if code == grpc.StatusCode.OK:
                self.stats.observe(name, code, time.perf_counter() - t0)
    return wrapper


class BrokerServicer(pb_grpc.BrokerServicer):
    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.stats = RpcStats()
        self.chunk = fed.cfg.chunk_kib * 1024
        self.max_bundle = fed.cfg.max_bundle_mib * 2**20

    @_rpc
    def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinResponse:
        if not request.HasField("manifest"):
            raise InvalidArgument("JoinRequest.manifest is required")
        with self.fed.replay.admit("Join", request.node_id, *_tag(request)):
            session, current = self.fed.join(request.node_id, request.model_id, request.tokenizer_id,
                                             manifest_from_pb(request.manifest), privacy_from_pb(request.privacy),
                                             request.resume_round)
        return pb.JoinResponse(session_id=session, manifest=manifest_to_pb(self.fed.manifest), current_round=current,
                               heartbeat_interval_ms=int(self.fed.cfg.heartbeat_interval_s * 1000))

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context: Any) -> pb.LeaveResponse:
        with self.fed.replay.admit("Leave", request.node_id, *_tag(request)):
            self.fed.leave(request.node_id, request.session_id)
        return pb.LeaveResponse()

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        with self.fed.replay.admit("Heartbeat", request.node_id, *_tag(request)):
            current, online = self.fed.heartbeat(request.node_id, request.session_id, request.round)
        return pb.HeartbeatResponse(current_round=current, online_nodes=online)

    @_rpc
    def PublishSummaries(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        rows = summaries_from_pb(request)
        for s in request.summaries:
            if s.round != request.round:
                raise InvalidArgument("every summary's round must equal the request's round")
        with self.fed.replay.admit("PublishSummaries", request.node_id, *_tag(request)):
            accepted, dups = self.fed.publish(request.node_id, request.session_id, request.round, rows)
        return pb.PublishResponse(accepted=accepted, duplicates=dups)

    @_rpc
    def GetMatches(self, request: pb.MatchRequest, context: Any) -> pb.MatchResponse:
        res = self.fed.get_matches(request.node_id, request.session_id, request.round, request.wait_ms / 1000.0)
        return match_result_to_pb(res)

    @_rpc
    def UploadBundle(self, request_iterator: Iterator[pb.BundleChunk], context: Any) -> pb.UploadResponse:
        first: pb.BundleChunk | None = None
        parts: list[bytes] = []
        received = 0
        ticket, applied = None, False
        try:
            for chunk in request_iterator:
                if first is None:
                    first = chunk
                    if chunk.total_size > self.max_bundle:
                        raise ResourceExhausted(f"bundle of {chunk.total_size} bytes exceeds the broker's limit "
                                                f"of {self.max_bundle} bytes")
                    ticket = self.fed.replay.begin("UploadBundle", chunk.node_id, *_tag(chunk))
                    self.fed.upload_allowed(chunk.node_id, chunk.session_id)
                elif (chunk.digest, chunk.total_size, chunk.node_id, chunk.prompt_id, chunk.round) != (
                        first.digest, first.total_size, first.node_id, first.prompt_id, first.round):
                    raise InvalidArgument("every chunk of one upload must carry the same digest, size, node, prompt "
                                          "and round")
                if len(chunk.data) > self.chunk:
                    raise InvalidArgument(f"chunk of {len(chunk.data)} bytes exceeds the chunk size {self.chunk}")
                if chunk.offset != received:
                    raise InvalidArgument(f"chunk offset {chunk.offset} but {received} bytes received so far")
                received += len(chunk.data)
                if received > first.total_size:
                    raise InvalidArgument("chunks exceed the declared total_size")
                parts.append(chunk.data)
            if first is None:
                raise InvalidArgument("empty upload: send at least one chunk")
            if received != first.total_size:
                raise InvalidArgument(f"upload ended after {received} of {first.total_size} bytes")
            pem = context.auth_context().get("x509_pem_cert") or []  # the mTLS client certificate, if any
            stored = self.fed.put_bundle(first.node_id, first.session_id, first.prompt_id, first.round, first.digest,
                                         b"".join(parts), signature=first.signature,
                                         signer_cert=pem_to_der(pem[0]) if pem else b"")
            applied = True
        finally:
            self.fed.replay.end(ticket, applied)
        return pb.UploadResponse(digest=first.digest, stored=stored)

    @_rpc
    def HasBundles(self, request: pb.HasBundlesRequest, context: Any) -> pb.HasBundlesResponse:
        return pb.HasBundlesResponse(present=self.fed.has_bundles(request.node_id, request.session_id,
                                                                  list(request.digests)))

    def FetchBundle(self, request: pb.FetchBundleRequest, context: Any) -> Iterator[pb.BundleChunk]:
        t0 = time.perf_counter()
        try:
            data, signature, cert = self.fed.fetch_bundle(request.node_id, request.session_id, request.digest)
        except FederationError as exc:
            code, message = to_status(exc)
            self.stats.observe("FetchBundle", code, time.perf_counter() - t0)
            context.abort(code, message)
        self.stats.observe("FetchBundle", grpc.StatusCode.OK, time.perf_counter() - t0)
        for off in range(0, max(1, len(data)), self.chunk):
            yield pb.BundleChunk(digest=request.digest, total_size=len(data), offset=off,
                                 data=data[off:off + self.chunk], signature=signature if off == 0 else b"",
                                 signer_cert=cert if off == 0 else b"")

    @_rpc
    def ReportCompatibility(self, request: pb.CompatibilityReport, context: Any) -> pb.ReportResponse:
        with self.fed.replay.admit("ReportCompatibility", request.node_id, *_tag(request)):
            accepted, dups = self.fed.report(request.node_id, request.session_id, request.round,
                                             report_entries_from_pb(request))
        return pb.ReportResponse(accepted=accepted, duplicates=dups)

    @_rpc
    def GetStatus(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        st = self.fed.status()
        return pb.StatusResponse(
            manifest=manifest_to_pb(st["manifest"]), current_round=st["current_round"],
            nodes=[pb.StatusResponse.Node(**n) for n in st["nodes"]],
            pairs=[pb.StatusResponse.Pair(**p) for p in st["pairs"]],
            bundles=st["bundles"], bundle_bytes=st["bundle_bytes"])

    #: the live page's scalar store (graft_fed/broker/live.py), set by the BrokerServer
    scalars: Any = None

    @_rpc
    def ReportScalars(self, request: pb.ScalarsRequest, context: Any) -> pb.ScalarsResponse:
        values = {s.name: s.value for s in request.scalars}
        if self.scalars is not None:
            self.scalars.validate(values)
            self.fed._node(request.node_id, request.session_id, touch=False)  # a live session, or UNAUTHENTICATED
            self.scalars.record(request.node_id, request.step, values)
        return pb.ScalarsResponse()
