"""A bundle on its way into the broker, a chunk at a time (issue 13).

`Federation.begin_upload` runs the checks that need no bytes (session, privacy, quarantine,
quota, signature) and returns a `BundleUpload`. Each chunk is then hashed, checked
(`federation.bundles.BundleStream`: UTF-8, JSON, escapes, as far as the bytes go) and
written into the state (`BrokerState.begin_bundle`) as it arrives, so the broker holds one
chunk of an upload, never the bundle. `finish` checks the digest and the record against
its summary and commits the bundle (durable when it returns); anything refused, and
`abort` (an upload cut off), leaves nothing stored. (Hashing and writing in a thread of
the upload's own, beside the check, measured no faster on the 2-core bench machine.)
"""

from __future__ import annotations

import hashlib
from typing import Callable

from graft_fed.broker.state import BundleWriter
from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.federation.bundles import BundleStream
from graft_fed.federation.errors import InvalidArgument


class BundleUpload:
    """`store(upload, record)`: the Federation's end of an upload (the record against its
    summary, the commit); the record's long strings stand in (see BundleStream)."""

    def __init__(self, store: Callable[["BundleUpload", GroupRecord], bool], writer: BundleWriter, node_id: str,
                 prompt_id: str, round: int, digest: str, size: int, signature: bytes, signer_cert: bytes,
                 release: Callable[[], None] | None = None) -> None:
        self.store, self.writer = store, writer
        self._release = release  # gives back what begin_upload reserved of the node's quota, once
        self.node_id, self.prompt_id, self.round, self.digest, self.size = node_id, prompt_id, round, digest, size
        self.signature, self.signer_cert = signature, signer_cert
        self.check = BundleStream(digest)

    def write(self, data: bytes) -> None:
        if self.check.size + len(data) > self.size:
            raise InvalidArgument(f"more than the {self.size} bytes declared for bundle {self.digest[:12]}...")
        try:
            self.check.feed(data)
        except RecordError as exc:
            raise InvalidArgument(f"bundle rejected: {exc}") from None
        self.writer.write(data)

    def finish(self) -> bool:
        """Check the digest and the record, then store: True when stored, False when the
        broker held the bundle already."""
        if self.check.size != self.size:
            raise InvalidArgument(f"bundle {self.digest[:12]}... ended after {self.check.size} of {self.size} bytes")
        if self.check.sha256() != self.digest:
            raise InvalidArgument(f"bundle bytes do not hash to the declared digest {self.digest[:12]}...")
        try:
            rec = self.check.finish()
        except RecordError as exc:
            raise InvalidArgument(f"bundle rejected: {exc}") from None
        self.writer.prepare(self.digest)  # the disk's part (fsync, rename), before the broker's lock
        try:
            return self.store(self, rec)  # once stored, the state counts the bytes
        finally:
            self._give_back()

    def abort(self) -> None:
        """Drop what was written; a no-op once stored."""
        try:
            self.writer.abort()
        finally:
            self._give_back()

    def _give_back(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
