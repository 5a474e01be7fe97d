"""The node's side of the wire: a gRPC client of the broker, heartbeats on their own thread.

Every failed call comes out as a domain error of graft_fed.federation.errors (the status
code mapped by graft_fed.federation.status), so the node's logic never sees grpc."""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import grpc

from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.errors import ConfigError
from graft_fed.federation.errors import FederationError, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from graft_fed.federation.bundles import decode_bundle, digest_of, encode_bundle
from graft_fed.federation.codec import (PRIVACY_CODES, chunk_bytes, columns_to_pb, manifest_from_pb, manifest_to_pb,
                                        match_result_from_pb, report_entries_to_pb, summary_to_pb, wire_bytes)
from graft_fed.federation.limits import MAX_DIGESTS_PER_CALL, MIN_CHUNK_BYTES
from graft_fed.federation.manifest import Manifest
from graft_fed.federation.messages import MatchResult, ReportEntry, SummaryRow
from graft_fed.federation.signing import BundleSigner, ProvenanceVerifier, common_name, load_certificate_der
from graft_fed.federation.status import from_rpc_error
from graft_fed.federation.transport import channel_credentials, check_plaintext, grpc_options
from graft_fed.proto import broker_pb2 as pb
from graft_fed.proto import broker_pb2_grpc as pb_grpc

log = logging.getLogger("graft_fed.node")

#: Codes after which a state-changing call is retried with the same request tag: the broker
#: was not reached or the reply was lost (UNAVAILABLE), or the same request is still being
#: processed (ABORTED). A deadline that expired is not retried: the step goes on as GRPO.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


#: The calls after which the broker has checked the node's session and marked it alive, as a
#: heartbeat does (broker: registry.touch): one answered stands in for a heartbeat. Not
#: GetStatus or ReportScalars, which do not mark it.
LIVENESS_RPCS = frozenset({"Join", "Heartbeat", "PublishSummaries", "GetMatches", "HasBundles", "UploadBundle",
                           "FetchBundle", "ReportCompatibility"})


def new_tag() -> pb.RequestTag:
    """A fresh replay-protection tag: 128 random bits and the send time (docs/security.md)."""
    return pb.RequestTag(request_id=secrets.token_hex(16), sent_at_ms=int(time.time() * 1000))


class Backoff:
    """Exponential backoff with full jitter between reconnection attempts."""

    def __init__(self, base_s: float = 1.0, cap_s: float = 60.0, rng: random.Random | None = None) -> None:
        self.base, self.cap = base_s, cap_s
        self.failures = 0
        self.next_at = 0.0
        self.rng = rng or random.Random()

    def ready(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self) -> float:
        self.failures += 1
        delay = self.rng.uniform(0, min(self.cap, self.base * 2 ** (self.failures - 1)))
        self.next_at = time.monotonic() + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.next_at = 0.0


class DeliveryError(RecordError):
    """A fetched bundle's bytes did not arrive as its digest names them (too big for this
    node, chunks that do not add up, cut short, another digest). The broker hashed them at
    upload: not the source's doing, so reported as undelivered, not as rejected."""


#: upload_missing stops after this many refusals before the first bundle taken
REFUSED_BEFORE_GIVING_UP = 16


class BundlesRefused(InvalidArgument):
    """upload_missing: the broker refused some of the bundles, each for itself
    (INVALID_ARGUMENT, NOT_FOUND); the others were uploaded."""

    def __init__(self, message: str, sent: int, refused: int) -> None:
        super().__init__(message)
        self.sent = sent
        self.refused = refused


#: What upload_missing raises for bundles the broker refused (some, or all from one on), each
#: with `sent` and `refused`: the broker answered, so not a lost broker
UPLOAD_REFUSALS = (BundlesRefused, PermissionDenied, ResourceExhausted)


@dataclass(frozen=True)
class FetchedBundle:
    record: GroupRecord
    signer: str  # the verified producer, "" when the bundle was not (or could not be) verified



def _interval_s(ms: int) -> float:
    """A heartbeat interval the broker sent, in seconds (at least 50 ms)."""
    return max(0.05, ms / 1000.0)

def broker_stub(channel: grpc.Channel) -> pb_grpc.BrokerStub:
    """The generated stub, except that UploadBundle takes each chunk as a message or as its
    wire bytes (`codec.chunk_bytes`: the data copied once rather than twice)."""
    stub = pb_grpc.BrokerStub(channel)
    stub.UploadBundle = channel.stream_unary("/graft_fed.v1.Broker/UploadBundle", request_serializer=wire_bytes,
                                             response_deserializer=pb.UploadResponse.FromString)
    return stub


class BrokerClient:
    def __init__(self, address: str, node_id: str, max_message_mib: int = 16, rpc_timeout_s: float = 10.0,
                 chunk_kib: int = 1024, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, insecure: bool = False,
                 require_signatures: bool | None = None, retries: int = 2,
                 revoked_certs: str | None = None, max_bundle_mib: int = 64) -> None:
        """`require_signatures`: refuse peer bundles whose producer's signature cannot be
        checked; None (the default) = required when this node uses mutual TLS (it has a
        certificate and key). Verifying needs `tls_ca`, the federation CA.
        `revoked_certs`: the CA's revoked.json; bundles signed with a listed certificate are
        refused, however long ago they were signed.
        `retries`: how often a publish, upload, report or leave is sent again, with the same
        request tag, after UNAVAILABLE or ABORTED (short jittered backoff).
        `max_bundle_mib`: a fetched bundle announced larger, or whose chunks do not add up, is
        refused (DeliveryError) before it is buffered."""
        self.address = address
        self.retries = retries
        self._rows_only = False  # set when the broker predates summary columns
        self._retry_rng = random.Random()
        #: retries the broker answered ALREADY_EXISTS: the first attempt was applied, its reply lost
        self.applied_on_retry = 0
        self.node_id = node_id
        self.timeout = rpc_timeout_s
        self.chunk = chunk_kib * 1024
        self.max_bundle = max_bundle_mib * 2**20  # the largest bundle a fetch may announce
        self._told_bundle_limit = False  # said at join that the broker stores larger ones
        self.broker_max_bundle = 0  # the largest bundle the broker stores, from Join (0: not said)
        # The node paces its own reconnection attempts (Backoff below); keep gRPC's channel-level
        # backoff short so a broker that is back is seen at the node's next attempt. Not
        # `grpc.min_reconnect_backoff_ms`: gRPC also takes it as the shortest time a connection
        # attempt may take (20 s by default), and at 200 ms a TLS handshake over a link of 100 ms
        # each way never completed (the first call failed: "Handshake read failed"). The
        # channel keeps its own connections: by default gRPC shares them between every channel
        # of the process to the same address, so a new client of a broker that just started
        # where an unreachable one was (a restart; a port the kernel handed out again) got
        # the old connection's backoff and failed its first call at once with that
        # connection's last error ("Connection refused").
        options = grpc_options(max_message_mib) + [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.use_local_subchannel_pool", 1)]
        if tls_ca is not None:
            self.channel = grpc.secure_channel(address, channel_credentials(tls_ca, tls_cert, tls_key),
                                               options=options)
        else:
            check_plaintext(address, insecure, f"node {node_id}")
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = broker_stub(self.channel)
        # Provenance: sign what this node produces with its mTLS key; check what it receives
        # against the federation CA (graft_fed/federation/signing.py).
        self.signer = BundleSigner(tls_cert, tls_key) if tls_cert and tls_key else None
        if revoked_certs and not tls_ca:
            raise ConfigError(f"node {node_id}: a revocation list needs federation.tls_ca (revocations are "
                              "checked on signatures, which are checked against the CA)")
        self.verifier = ProvenanceVerifier(tls_ca, revoked_certs) if tls_ca else None
        self.require_signatures = self.signer is not None if require_signatures is None else require_signatures
        if self.require_signatures and self.verifier is None:
            raise ConfigError(f"node {node_id}: federation.require_signatures needs federation.tls_ca (the "
                              "federation CA that issued the nodes' certificates) to check signatures against")
        self._warned_unsigned = False
        self.session = ""
        self.round = 0
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        #: the interval this client heartbeats at (Join's, then what heartbeat answers say)
        self.heartbeat_interval_s = 0.0
        #: when (time.monotonic) the latest call that the broker answered and counted as a
        #: sign of life was sent (LIVENESS_RPCS); a heartbeat is due one interval after it
        self._alive_sent = 0.0
        #: heartbeats sent, and heartbeats not sent because another call had shown the node alive
        self.heartbeats_sent = 0
        self.heartbeats_skipped = 0
        self.session_lost = threading.Event()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the channel is connected (it backs off after a broker outage)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            return True
        except grpc.FutureTimeoutError:
            return False

    # ----- session ------------------------------------------------------------------------------
    def join(self, model_id: str, tokenizer_id: str, manifest: Manifest, privacy: str,
             resume_round: int, node_secret: str = "") -> tuple[Manifest, int, float]:
        resp = self._once("Join", pb.JoinRequest(node_id=self.node_id, model_id=model_id, tokenizer_id=tokenizer_id,
                                                 manifest=manifest_to_pb(manifest), privacy=PRIVACY_CODES[privacy],
                                                 resume_round=resume_round, tag=new_tag(), node_secret=node_secret),
                          self.timeout)
        self.session = resp.session_id
        self.session_lost.clear()
        self.heartbeat_interval_s = _interval_s(resp.heartbeat_interval_ms)
        self.broker_max_bundle = resp.max_bundle_mib * 2**20
        if self.broker_max_bundle > self.max_bundle and not self._told_bundle_limit:
            self._told_bundle_limit = True
            log.warning("node %s: the broker stores bundles of up to %d MiB and this node fetches at most %d "
                        "(federation.max_bundle_mib): peers' larger groups will be skipped, reported as undelivered",
                        self.node_id, resp.max_bundle_mib, self.max_bundle // 2**20)
        self._start_heartbeats()
        return manifest_from_pb(resp.manifest), resp.current_round, self.heartbeat_interval_s

    def _start_heartbeats(self) -> None:
        self._stop_heartbeats()
        self._hb_stop = threading.Event()
        stop, session = self._hb_stop, self.session

        def beat() -> None:
            # Its own thread: a long training step never looks like death to the broker. Every
            # call in LIVENESS_RPCS marks the node alive at the broker as a heartbeat does, so
            # a heartbeat is sent only after an interval without one of those (at 1,000 nodes x
            # 128 prompts the broker served 445-569 heartbeats a run instead of 1,076-1,435;
            # issue 13, docs/performance.md).
            wait = self.heartbeat_interval_s
            while not stop.wait(wait):
                wait = self.heartbeat_interval_s
                quiet = time.monotonic() - self._alive_sent
                if quiet < wait:
                    self.heartbeats_skipped += 1
                    wait = max(0.01, wait - quiet)
                    continue
                sent = time.monotonic()
                try:
                    resp = self.stub.Heartbeat(pb.HeartbeatRequest(node_id=self.node_id, session_id=session,
                                                                   round=self.round, tag=new_tag()),
                                               timeout=self.timeout)
                    self.heartbeats_sent += 1
                    self.answered("Heartbeat", sent)
                    if resp.heartbeat_interval_ms:  # the broker's cadence grows with the federation
                        self.heartbeat_interval_s = wait = _interval_s(resp.heartbeat_interval_ms)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        # only this thread's session: one a re-join has replaced meanwhile is
                        # refused too, and the new one must not read as lost (a second re-join)
                        if not stop.is_set() and self.session == session:
                            self.session_lost.set()
                        return
                    log.debug("heartbeat failed: %s", exc.code())

        self._hb_thread = threading.Thread(target=beat, name=f"heartbeat-{self.node_id}", daemon=True)
        self._hb_thread.start()

    def _stop_heartbeats(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
            self._hb_thread = None

    def leave(self) -> None:
        self._stop_heartbeats()
        if self.session:
            try:
                req = pb.LeaveRequest(node_id=self.node_id, session_id=self.session, tag=new_tag())
                self._call("Leave", lambda: req, self.timeout)
            except FederationError as exc:
                log.info("leave failed (%s); the broker will see this node go offline", exc.status)
        self.session = ""

    def close(self) -> None:
        self._stop_heartbeats()
        self.channel.close()

    def answered(self, rpc: str, sent: float) -> None:
        """Its `rpc` call sent at `sent` (time.monotonic) was answered: when the broker marked
        the node alive for it (LIVENESS_RPCS), the next heartbeat is due an interval later.
        Every call of this client reports here; a caller of `stub` itself may too."""
        if rpc in LIVENESS_RPCS:
            self._alive_sent = max(self._alive_sent, sent)

    def _once(self, rpc: str, request: Any, timeout: float) -> Any:
        """One unary call; a failure comes out as the matching domain error."""
        sent = time.monotonic()
        try:
            resp = getattr(self.stub, rpc)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, rpc) from None
        self.answered(rpc, sent)
        return resp

    def _call(self, rpc: str, request: Callable[[], Any], timeout: float) -> Any | None:
        """One state-changing call, retried with the same request (and so the same tag) after
        UNAVAILABLE or ABORTED. A retry answered ALREADY_EXISTS means the broker applied an
        earlier attempt whose reply was lost: success, returned as None."""
        sent = time.monotonic()  # every attempt is later: the broker saw the node alive after it
        for attempt in range(self.retries + 1):
            try:
                resp = getattr(self.stub, rpc)(request(), timeout=timeout)
                self.answered(rpc, sent)
                return resp
            except grpc.RpcError as exc:
                if attempt and exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    log.info("%s of node %s: an earlier attempt was applied (its reply was lost)", rpc, self.node_id)
                    self.applied_on_retry += 1
                    self.answered(rpc, sent)
                    return None
                if exc.code() not in RETRYABLE or attempt == self.retries:
                    raise from_rpc_error(exc, rpc) from None
                delay = self._retry_rng.uniform(0.05, min(2.0, 0.2 * 2 ** attempt))
                log.debug("%s of node %s failed (%s); retrying in %.2fs", rpc, self.node_id, exc.code().name, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    # ----- rounds -------------------------------------------------------------------------------
    def publish(self, round: int, summaries: Sequence[SummaryRow | pb.GroupSummary]) -> tuple[int, int]:
        columns = columns_to_pb(summaries) if summaries and not self._rows_only else None
        if columns is not None and all(s.round == round for s in summaries):
            req = pb.PublishRequest(node_id=self.node_id, session_id=self.session, round=round, columns=columns,
                                    tag=new_tag())
            resp = self._call("PublishSummaries", lambda: req, self.timeout)
            if resp is None:  # applied by an attempt whose reply was lost: every summary is held
                return 0, len(summaries)
            if resp.accepted + resp.duplicates:
                return resp.accepted, resp.duplicates
            # nothing acknowledged of a non-empty publish: a broker from before columns,
            # which ignored them; from now on this node sends summaries one message each
            log.info("broker %s does not read summary columns; node %s sends them one by one", self.address,
                     self.node_id)
            self._rows_only = True
        msgs = [s if isinstance(s, pb.GroupSummary) else summary_to_pb(s) for s in summaries]
        req = pb.PublishRequest(node_id=self.node_id, session_id=self.session, round=round, summaries=msgs,
                                tag=new_tag())
        resp = self._call("PublishSummaries", lambda: req, self.timeout)
        if resp is None:  # applied by an attempt whose reply was lost: every summary is held
            return 0, len(msgs)
        return resp.accepted, resp.duplicates

    def get_matches(self, round: int, wait_s: float, wait_for_bundles: bool = False) -> MatchResult:
        """The round's matches, long-polling up to `wait_s` (and, with `wait_for_bundles`, until
        every offered bundle is uploaded)."""
        resp = self._once("GetMatches", pb.MatchRequest(node_id=self.node_id, session_id=self.session, round=round,
                                                        wait_ms=int(wait_s * 1000), wait_for_bundles=wait_for_bundles),
                          wait_s + self.timeout)
        return match_result_from_pb(resp)

    # ----- bundles ------------------------------------------------------------------------------
    def has_bundles(self, digests: Sequence[str]) -> set[str]:
        """The digests the broker holds, asked MAX_DIGESTS_PER_CALL at a time (what one call
        may name; a round of more informative groups was refused whole)."""
        present: set[str] = set()
        digests = list(digests)
        for lo in range(0, len(digests), MAX_DIGESTS_PER_CALL):
            resp = self._once("HasBundles", pb.HasBundlesRequest(
                node_id=self.node_id, session_id=self.session, digests=digests[lo:lo + MAX_DIGESTS_PER_CALL]),
                self.timeout)
            present.update(resp.present)
        return present

    def upload(self, record: GroupRecord, round: int) -> tuple[str, bool]:
        data = encode_bundle(record)
        return self._upload_bytes(data, digest_of(data), record.prompt_id, round)

    def _upload_bytes(self, data: bytes, digest: str, prompt_id: str, round: int) -> tuple[str, bool]:
        signature = self.signer.sign(self.node_id, digest) if self.signer is not None else b""
        tag = new_tag()

        def chunks() -> Iterator[bytes]:  # each chunk's wire bytes: its data copied once (chunk_bytes)
            view = memoryview(data)
            for off in range(0, max(1, len(data)), self.chunk):
                first = off == 0
                header = pb.BundleChunk(digest=digest, total_size=len(data), offset=off, node_id=self.node_id,
                                        session_id=self.session, prompt_id=prompt_id, round=round,
                                        signature=signature if first else b"", tag=tag if first else None)
                yield chunk_bytes(header, view[off:off + self.chunk])

        resp = self._call("UploadBundle", chunks, self.timeout * 3)
        return digest, resp is not None and resp.stored

    def upload_missing(self, records: Iterable[tuple[GroupRecord, int]]) -> int:
        """Upload the bundles the broker does not hold yet; returns the number sent. Each
        record is encoded once, for its digest and, if needed, for the upload. A bundle the
        broker refuses for itself (INVALID_ARGUMENT: say, it does not match the summary this
        node published for its prompt; NOT_FOUND: that summary is pruned) does not stop the
        others, unless the first REFUSED_BEFORE_GIVING_UP are all refused (then the rest
        would most likely be too, for a reason that is not theirs: a setting that differs).
        One larger than the broker stores (JoinResponse.max_bundle_mib) is not sent: refused.
        Then BundlesRefused says how many were not taken and how many went. PERMISSION_DENIED
        (this node may upload nothing now: quarantined) and RESOURCE_EXHAUSTED (its bundle
        quota is used up, the broker's disk is full, too many uploads in flight) are raised
        at once, with the same two counts as `sent` and `refused`."""
        items = []
        for rec, rnd in records:
            data = encode_bundle(rec)
            items.append((rec.prompt_id, rnd, data, digest_of(data)))
        present = self.has_bundles([d for *_, d in items])
        missing = [item for item in items if item[3] not in present]
        sent, refused = 0, []
        for prompt_id, rnd, data, digest in missing:
            if not sent and len(refused) >= REFUSED_BEFORE_GIVING_UP:
                break
            if self.broker_max_bundle and len(data) > self.broker_max_bundle:  # not sent: it would be refused
                refused.append(InvalidArgument(f"the bundle for prompt {prompt_id[:40]!r} is {len(data)} bytes, more "
                                               f"than the broker stores ({self.broker_max_bundle // 2**20} MiB, its "
                                               f"max_bundle_mib)"))
                continue
            try:
                self._upload_bytes(data, digest, prompt_id, rnd)
            except (InvalidArgument, NotFound) as exc:  # that bundle only
                refused.append(exc)
                continue
            except (PermissionDenied, ResourceExhausted) as exc:  # every other would be refused the same
                exc.sent, exc.refused = sent, len(missing) - sent
                raise
            sent += 1
        if refused:
            raise BundlesRefused(f"the broker refused {len(refused)} of the {len(refused) + sent} bundles uploaded"
                                 + (f" ({len(missing) - sent - len(refused)} more not tried)"
                                    if len(refused) + sent < len(missing) else "")
                                 + f"; the first: {refused[0]}", sent=sent, refused=len(missing) - sent)
        return sent

    def fetch(self, digest: str, source: str | None = None) -> GroupRecord:
        return self.fetch_bundle(digest, source).record

    def fetch_bundle(self, digest: str, source: str | None = None) -> "FetchedBundle":
        """Download a bundle and check it: size, digest, record, and its producer's signature
        (`source`: the node the broker names as the producer; None = whoever signed it).
        Raises DeliveryError (a RecordError) for bytes that do not arrive as the digest names
        them, ProvenanceError (another) for a signature that fails, a certificate not issued
        by this node's CA or naming another node, or an unsigned bundle where signatures are
        required, and RecordError for a record that does not decode."""
        parts, size, signature, cert = [], None, b"", b""
        received = 0
        sent = time.monotonic()
        call = self.stub.FetchBundle(pb.FetchBundleRequest(node_id=self.node_id, session_id=self.session,
                                                           digest=digest), timeout=self.timeout * 3)
        try:
            for chunk in call:
                if size is None:
                    self.answered("FetchBundle", sent)  # the broker checked the session, marked the node alive
                    signature, cert = chunk.signature, chunk.signer_cert
                    size = chunk.total_size
                    if size > self.max_bundle:  # a hostile broker must not make the node buffer without end
                        call.cancel()
                        raise DeliveryError(f"bundle {digest[:12]} announced as {size} bytes, more than this node "
                                            f"accepts ({self.max_bundle}; federation.max_bundle_mib sets it)")
                piece = chunk.data  # read once: protobuf copies a bytes field at each access
                if chunk.total_size != size or chunk.offset != received or received + len(piece) > size:
                    call.cancel()
                    raise DeliveryError(f"bundle {digest[:12]} arrived with inconsistent chunks (offset "
                                        f"{chunk.offset}, {received} bytes so far, total {size})")
                # a broker sends chunks of broker.chunk_kib (>= 16 KiB); a bundle it holds as the
                # upload's pieces (each >= 16 KiB but the last) may add one shorter chunk per
                # piece. So before each chunk there are at most 2 per 16 KiB received: more, or an
                # empty one, is a trickle that would hold this node in the fetch until its deadline
                if not piece or len(parts) > 2 * (received // MIN_CHUNK_BYTES):
                    call.cancel()
                    what = ("an empty chunk" if not piece else
                            f"more chunks than its bytes need ({len(parts) + 1} for {received + len(piece)} bytes)")
                    raise DeliveryError(f"bundle {digest[:12]} arrived in {what}, at {received} of {size} bytes; a "
                                        f"broker sends at most 2 chunks per {MIN_CHUNK_BYTES // 1024} KiB, none empty")
                received += len(piece)
                parts.append(piece)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "FetchBundle") from None
        data = b"".join(parts)
        if size is None or len(data) != size:
            raise DeliveryError(f"bundle {digest[:12]} arrived truncated ({len(data)} of {size} bytes)")
        got = digest_of(data)
        if got != digest:
            raise DeliveryError(f"bundle digest mismatch: expected {digest}, got {got}")
        signer = ""
        if self.verifier is not None and (signature or cert or self.require_signatures):
            # present signatures are always checked; absent ones are refused when required
            if source is None:
                source = common_name(load_certificate_der(cert)) if cert else ""
            signer = self.verifier.verify(source, digest, signature, cert)
        elif not self._warned_unsigned:
            log.warning("node %s: a peer bundle arrived unsigned (or this node has no federation CA to check "
                        "signatures), so it cannot verify who produced it; use mutual TLS (docs/security.md)",
                        self.node_id)
            self._warned_unsigned = True
        return FetchedBundle(record=decode_bundle(data, digest), signer=signer)

    def report(self, round: int, entries: Sequence[ReportEntry | pb.CompatibilityReport.Entry]) -> None:
        msgs = [e if isinstance(e, pb.CompatibilityReport.Entry) else report_entries_to_pb([e])[0] for e in entries]
        if msgs:
            req = pb.CompatibilityReport(node_id=self.node_id, session_id=self.session, round=round, entries=msgs,
                                         tag=new_tag())
            self._call("ReportCompatibility", lambda: req, self.timeout)

    def status(self) -> pb.StatusResponse:
        return self._once("GetStatus", pb.StatusRequest(), self.timeout)

    # ----- live page ------------------------------------------------------------------------------
    #: metrics-row key -> the scalar name the broker's live page plots
    SCALAR_KEYS = {"reward": "reward", "frac_all_fail": "all_fail", "graft/replaced": "groups_received",
                   "eval/pass@1": "heldout_pass1", "eval/stderr": "heldout_stderr"}

    def report_scalars(self, step: int, row: dict[str, Any]) -> bool:
        """Send a few scalars of a training step (its metrics row: reward, all-fail share,
        peer groups received, held-out pass@1 when evaluated) for the live page. Best effort:
        never raises; False when not sent. A broker that predates ReportScalars answers
        UNIMPLEMENTED once, after which this node stops sending."""
        if getattr(self, "_scalars_unsupported", False) or not self.session:
            return False
        scalars = []
        for key, name in self.SCALAR_KEYS.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
                    and abs(value) != float("inf"):
                scalars.append(pb.Scalar(name=name, value=float(value)))
        if not scalars:
            return False
        try:
            self.stub.ReportScalars(pb.ScalarsRequest(node_id=self.node_id, session_id=self.session, step=int(step),
                                                      scalars=scalars), timeout=min(self.timeout, 2.0))
            return True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._scalars_unsupported = True
                log.info("broker %s does not take step scalars (an older broker); not sending them", self.address)
            else:
                log.debug("scalars of step %d not sent: %s", step, exc.code().name)
            return False
