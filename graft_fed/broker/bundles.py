"""Bundles: uploads (checked before the bytes, then chunk by chunk by broker/uploads.py,
then against their summary before the digest is attached), each node's storage quota, and
fetches of the bundles a receiver was granted (broker/grants.py)."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from typing import Callable, Iterator, Sequence

from graft_fed.broker.context import Context, Part
from graft_fed.broker.ratelimit import QuotaWarnings
from graft_fed.broker.state_rows import lower_counts
from graft_fed.broker.uploads import BundleUpload
from graft_fed.broker.wakeups import bundles_key
from graft_fed.core.records import GroupRecord
from graft_fed.federation.bundles import digest_of, is_digest
from graft_fed.federation.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from graft_fed.federation.limits import MAX_DIGESTS_PER_CALL, clip
from graft_fed.federation.signing import ProvenanceError, common_name, load_certificate_der, verify_signature

log = logging.getLogger("graft_fed.broker")

#: bundles from before the broker's start whose stored bytes were checked against their
#: digest, intact or damaged, remembered at most (then forgotten together, and checked again
#: at their next fetch)
MAX_CHECKED = 4096
CHECK_WAIT_S = 120.0  # how long a fetch waits for another fetch's read of the same bundle


class _Check:
    """A read of a bundle's stored bytes in progress (Bundles._check_intact)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.replaced = False  # an upload of the bundle completed meanwhile


def _remember(seen: set[str], digest: str) -> None:
    if len(seen) >= MAX_CHECKED:
        seen.clear()
    seen.add(digest)


class Bundles(Part):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._warned_unverifiable = False
        # bytes of the uploads in flight, per node, counted against its quota until they
        # are stored (then the state counts them) or dropped
        self._in_flight: Counter[str] = Counter()
        self._in_flight_lock = threading.Lock()
        self._near_quota = QuotaWarnings("max_node_bundle_mib", "uploads", mib=True)
        # bundles from before this broker's start whose stored bytes hash to their digest, and
        # those that did not (each is read whole at its first fetch: _check_intact)
        self._intact: set[str] = set()
        self._damaged: set[str] = set()
        self._checks: dict[str, _Check] = {}  # the reads in progress, by digest
        self._checked_lock = threading.Lock()

    def has_bundles(self, node_id: str, session_id: str, digests: Sequence[str]) -> list[str]:
        if len(digests) > MAX_DIGESTS_PER_CALL:
            raise InvalidArgument(f"{len(digests)} digests in one call; at most {MAX_DIGESTS_PER_CALL}")
        for d in digests:
            if not is_digest(d):
                raise InvalidArgument(f"malformed digest {clip(d, 70)}: expected 64 lowercase hex digits")
        # neither waits for the broker's lock: a session check, then a read of the state
        self.registry.touch(node_id, session_id)
        held = self.state.has_bundles(digests)
        with self._checked_lock:  # a copy found damaged is not held: its source sends it again
            return [d for d in held if d not in self._damaged] if self._damaged else held

    def upload_allowed(self, node_id: str, session_id: str) -> None:
        """Checks that need no payload, run before receiving the chunks (without the broker's
        lock, as a heartbeat's session check)."""
        node = self.registry.touch(node_id, session_id)
        if node.privacy == "summaries_only":
            raise PermissionDenied(f"node {clip(node_id)} declared privacy summaries_only; it uploads no trajectories")
        if node_id in self.ctx.quarantined():
            raise PermissionDenied(f"node {clip(node_id)} is quarantined: receivers rejected too many of its groups "
                                   "(claimed rewards did not re-verify); the operator can release it")

    def begin_upload(self, node_id: str, session_id: str, prompt_id: str, round: int, digest: str, size: int,
                     signature: bytes = b"", signer_cert: bytes = b"") -> BundleUpload:
        """Start storing a node's bundle of `size` bytes, which then come a chunk at a time
        (broker/uploads.py: hashed, checked and written as they arrive). The checks that need
        no bytes run here. With `signer_cert` (the node's mTLS certificate, DER) a signature
        must verify for this node and digest and is stored with the bytes for receivers to
        check; without a certificate to check it against (no mutual TLS) a signature is
        dropped and the bundle stored unsigned."""
        self.upload_allowed(node_id, session_id)
        if not is_digest(digest):
            raise InvalidArgument(f"malformed digest {clip(digest, 70)}: expected 64 lowercase hex digits")
        if signature and signer_cert:
            try:
                cert = load_certificate_der(signer_cert)
                if common_name(cert) != node_id:
                    raise ProvenanceError(f"the client certificate is {common_name(cert)!r}'s, not {clip(node_id)}'s")
                verify_signature(cert, node_id, digest, signature)
            except ProvenanceError as exc:
                raise InvalidArgument(f"bundle signature rejected: {exc}. Sign with the key of the certificate "
                                      "this connection presents") from None
        elif signature:
            if not self._warned_unverifiable:
                log.warning("node %s signs its bundles but this broker does not use mutual TLS, so it has no "
                            "certificate to relay with them: bundles are stored unsigned (set client_ca)", node_id)
                self._warned_unverifiable = True
            signature = b""
        else:
            signer_cert = b""
        release = self._reserve(node_id, size)  # the last check: nothing after it refuses
        try:
            writer = self.state.begin_bundle()
        except BaseException:
            if release is not None:
                release()
            raise
        return BundleUpload(self._store_upload, writer, node_id, prompt_id, round, digest, size, signature,
                            signer_cert, release)

    def _reserve(self, node_id: str, size: int) -> Callable[[], None] | None:
        """Count an upload of `size` bytes against the node's quota (`max_node_bundle_mib`)
        from its start: the bytes of the bundles it uploaded that the state still holds (the
        state's count, lowered when retention drops some, counted again after a restart) and
        those of its uploads still in flight (two at once each passed a check made before
        either was stored). Returns what gives them back (None without a quota)."""
        quota = self.cfg.max_node_bundle_mib * 2**20
        if not quota:
            return None
        with self._in_flight_lock:
            held = self.state.bundle_bytes_held(node_id) + self._in_flight[node_id]
            if held + size > quota:
                raise ResourceExhausted(
                    f"node {clip(node_id)} exceeded its bundle storage quota of {self.cfg.max_node_bundle_mib} MiB "
                    f"(broker.max_node_bundle_mib): the broker holds {held / 2**20:.1f} MiB of bundles it uploaded (or "
                    f"is receiving) and this one is {size / 2**20:.1f} MiB. Retention (broker.keep_rounds, "
                    "broker.max_bundle_gib) frees them; the operator can raise the quota")
            self._in_flight[node_id] += size
            self._near_quota.note(node_id, held + size, quota)  # admitted: near the quota, the operator is told

        def release() -> None:
            with self._in_flight_lock:
                lower_counts(self._in_flight, {node_id: size})
        return release

    def put_bundle(self, node_id: str, session_id: str, prompt_id: str, round: int, digest: str,
                   data: bytes, signature: bytes = b"", signer_cert: bytes = b"") -> bool:
        """Store a node's bundle whole: begin_upload, its bytes in chunks, finish."""
        upload = self.begin_upload(node_id, session_id, prompt_id, round, digest, len(data), signature, signer_cert)
        try:
            view, chunk = memoryview(data), self.cfg.chunk_kib * 1024
            for off in range(0, len(data), chunk):
                upload.write(view[off:off + chunk])
            return upload.finish()
        finally:
            upload.abort()  # a no-op once finished

    def _store_upload(self, up: BundleUpload, rec: GroupRecord) -> bool:
        """The end of an upload whose bytes hashed to its digest and hold `rec`: check the
        record against its summary, commit the bytes, attach the digest, wake the waiters.

        The state's reads and writes happen outside the broker's lock (the state serialises
        its own), so that concurrent uploads share the state's group commits (with each
        other and with publishes) instead of queueing one commit at a time behind that lock
        (issue 13, eighteenth pass). Retention (prune, under the lock) racing an upload at
        worst drops a bundle just stored, as it would a moment later (its file is deleted
        only once no row names it); a bundle whose summary retention dropped before the
        commit is not stored at all (NotFound: nothing could grant it, and it would count
        against the node's quota); the digest is attached only to a summary the state still
        holds, and not put back into a round index that a prune cleared meanwhile."""
        node_id, round, prompt_id = up.node_id, up.round, up.prompt_id
        summary = self.ctx.summary(node_id, round, prompt_id)
        if summary is None:
            raise NotFound(f"node {clip(node_id)} published no summary for prompt {clip(prompt_id)} in round {round}")
        if (rec.prompt_id != prompt_id or rec.k != summary.k or rec.n != summary.n
                or list(rec.mean_logprobs) != list(summary.mean_logprobs)
                or list(rec.lengths) != list(summary.lengths) or rec.step != summary.policy_version):
            raise InvalidArgument("the bundle does not hold the group its summary describes "
                                  "(prompt id, k, n, lengths, step or mean log-probs differ)")
        generation = self.index.generation  # a prune after this clears the index: see set_digest
        # the bundle's row and its digest on the summary in one commit (a state on disk)
        stored, attached = up.writer.commit_attached(up.digest, up.signature, up.signer_cert, node_id, round,
                                                     prompt_id)
        if not stored and not attached:
            raise NotFound(f"node {clip(node_id)}'s summary for prompt {clip(prompt_id)} in round {round} was pruned "
                           "by retention while its bundle arrived; nothing was stored")
        self._stored_again(up.digest)
        with self.cond:
            if stored:
                self.counters["bundles_signed" if up.signature else "bundles_unsigned"] += 1
            self.counters["bundles_stored" if stored else "bundles_duplicate"] += 1
            self.counters["bundle_bytes_in"] += up.size
        if attached:
            self.index.set_digest(round, node_id, prompt_id, up.digest, since=generation)
        self.wakeups.wake(bundles_key(self.cfg.mode, round))
        return stored

    def get_bundle(self, node_id: str, session_id: str, digest: str) -> bytes:
        return self.fetch_bundle(node_id, session_id, digest)[0]

    def fetch_bundle(self, node_id: str, session_id: str, digest: str) -> tuple[bytes, bytes, bytes]:
        """(bytes, producer's signature, producer's certificate DER) of a bundle the node was
        matched to; the last two are empty for an unsigned bundle."""
        self._check_grant(node_id, session_id, digest)
        data = self.state.get_bundle(digest)
        provenance = self.state.bundle_provenance(digest)
        if data is None or provenance is None:
            raise NotFound(f"no bundle {digest[:12]}... (pruned by retention?)")
        self._check_intact(digest, data)
        self.counters["bundle_bytes_out"] += len(data)
        return data, provenance[0], provenance[1]

    def open_bundle(self, node_id: str, session_id: str, digest: str) -> tuple[int, bytes, bytes]:
        """fetch_bundle without the bytes: (size, signature, certificate DER) of a bundle the
        node was matched to, whose bytes `stream_bundle` then yields a chunk at a time (a
        fetch holds one chunk in memory, not the bundle)."""
        self._check_grant(node_id, session_id, digest)
        size = self.state.bundle_size(digest)
        provenance = self.state.bundle_provenance(digest)
        if size is None or provenance is None:
            raise NotFound(f"no bundle {digest[:12]}... (pruned by retention?)")
        return size, provenance[0], provenance[1]

    def check_stored(self, digest: str) -> None:
        """Before a granted fetch streams a bundle (within the node's bound on fetches in
        flight): NotFound for a damaged copy (`_check_intact`)."""
        self._check_intact(digest)

    def _check_intact(self, digest: str, data: bytes | None = None) -> None:
        """Refuse to serve a bundle from before this broker's start whose stored bytes no
        longer hash to its digest (a restore gone wrong, a volume damaged while the broker was
        down, a hand edit): NOT_FOUND, which a node takes as that offer's failure, and the
        operator is told (log, graft_fed_bundles_damaged_total); `has_bundles` no longer
        counts it held, so its source uploads it again, which replaces the copy. Before,
        nothing re-read what was stored: receivers found the damage as a digest mismatch,
        reported the groups undelivered, and the source looked like it withheld them. Such a
        bundle is read whole at its first fetch (a chunk, broker.chunk_kib, in memory at a
        time; the reads and the hashing release the interpreter; fetches that come meanwhile
        wait for that one read), and what it found is remembered (up to MAX_CHECKED bundles
        each way). The bundles this broker stored itself were hashed on their way in and are
        not read again: reading each at its first fetch cost a 16 MiB fetch 0.53x and 0.58x of
        raw gRPC against 0.76x and 0.97x in the same pairs (docs/performance.md). A receiver
        still checks every bundle's digest itself. `data`: the bytes, when the caller read
        them whole."""
        with self._checked_lock:
            if digest in self._intact:
                return
            if digest in self._damaged:
                raise self._damaged_copy(digest)
        if not self.state.bundle_held_at_open(digest):
            return
        with self._checked_lock:
            check = self._checks.get(digest)
            mine = check is None
            if mine:
                check = self._checks[digest] = _Check()
        if not mine:  # another fetch is reading it: its verdict stands for this one too
            check.done.wait(CHECK_WAIT_S)
            with self._checked_lock:
                if digest in self._damaged:
                    raise self._damaged_copy(digest)
            return
        try:
            if data is not None:
                found = digest_of(data)
            else:
                chunks = self.state.iter_bundle(digest, self.cfg.chunk_kib * 1024)  # memory: a chunk, as a fetch
                if chunks is None:
                    raise NotFound(f"no bundle {digest[:12]}... (pruned by retention while it was being fetched)")
                h = hashlib.sha256()
                for piece in chunks:
                    h.update(piece)
                found = h.hexdigest()
        except BaseException:
            with self._checked_lock:
                self._checks.pop(digest, None)
            check.done.set()
            raise
        with self._checked_lock:
            self._checks.pop(digest, None)
            # a copy uploaded again while this one was read (`_stored_again`) replaced what was read
            damaged = found != digest and not check.replaced
            if not damaged:
                _remember(self._intact, digest)
            else:
                first = digest not in self._damaged
                _remember(self._damaged, digest)
        check.done.set()
        if not damaged:
            return
        if first:
            with self.cond:
                self.counters["bundles_damaged"] += 1
            log.error("bundle %s: the broker's stored copy no longer hashes to its digest (sha256 %s): a damaged "
                      "volume or a restore gone wrong? It is not served, nor counted held, so its source uploads it "
                      "again. Check the disk (and restore the bundles directory from a backup if others are "
                      "damaged)", digest, found)
        raise self._damaged_copy(digest)

    def _stored_again(self, digest: str) -> None:
        """An upload of `digest` completed: its bytes were hashed on their way in and now are
        the stored copy (a new one, or one that replaced the file of a copy held already)."""
        with self._checked_lock:
            self._damaged.discard(digest)
            check = self._checks.get(digest)
            if check is not None:
                check.replaced = True

    @staticmethod
    def _damaged_copy(digest: str) -> NotFound:
        return NotFound(f"bundle {digest[:12]}... cannot be served: the broker's copy is damaged (its operator is "
                        "told in the broker's log)")

    def stream_bundle(self, digest: str, chunk: int) -> Iterator[bytes]:
        """The chunks of a bundle `open_bundle` granted; NotFound when it was pruned meanwhile."""
        chunks = self.state.iter_bundle(digest, chunk)
        if chunks is None:
            raise NotFound(f"no bundle {digest[:12]}... (pruned by retention while it was being fetched)")
        for data in chunks:
            self.counters["bundle_bytes_out"] += len(data)
            yield data

    def bundle_file(self, digest: str) -> tuple[str, int] | None:
        """(path, size) of a bundle `open_bundle` granted, when its bytes are a file a reader
        may open itself (BrokerState.bundle_file); None otherwise."""
        return self.state.bundle_file(digest)

    def bytes_sent(self, count: int) -> None:
        """Bytes of a bundle another process (the front) sent from its file."""
        self.counters["bundle_bytes_out"] += count

    def file_unsent(self, digest: str, outcome: str, reason: str = "") -> None:
        """What a fetch streamed from the bundle's file by the front came to, when not all of
        it went out: the error the fetch ends with, the state's (BrokerState.bundle_file_error);
        "sent" and "cancelled" end as they are."""
        if outcome not in ("sent", "cancelled"):
            raise self.state.bundle_file_error(digest, outcome, reason)

    def _check_grant(self, node_id: str, session_id: str, digest: str) -> None:
        if not is_digest(digest):
            raise InvalidArgument("digest must be 64 lowercase hex digits")
        self.registry.touch(node_id, session_id)
        if not self.grants.allowed(node_id, digest):
            if not self.state.has_bundles([digest]):
                raise NotFound(f"no bundle {digest[:12]}...")
            raise PermissionDenied(f"node {clip(node_id)} was not matched to bundle {digest[:12]}...; ask for "
                                   "matches first")
