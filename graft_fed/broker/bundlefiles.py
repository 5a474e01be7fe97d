"""Bundle bytes as files: one file per bundle, named by its digest, in a directory beside
the SQLite state (`<db>-bundles/`), its index (size, provenance, age) a row of the state.

Why: SQLite wrote an upload's bytes twice (the WAL, then the database file at a
checkpoint), in 64 KiB pages each with its WAL frame and checksum, holding the state's
connection meanwhile: 44-48 ms (37 ms of CPU) for a 16 MiB bundle in 1 MiB chunks, against
14-15 ms (5-6 ms of CPU) as a file written, fsynced and renamed, and a row committed
(`bench/broker/results/bundle_files_micro.py.txt`, issue 13's seventeenth pass).

Durability, in this order: the bytes go to a temporary file (`.<random>.part`) as they
arrive; then (`prepare`, before the broker takes its lock to check the bundle against its
summary) the file is fsynced, renamed to its digest's name and the directory fsynced, and
only at commit the bundle's row commits (fsynced). An upload that stores nothing after its
rename (refused, a duplicate, a failed commit) deletes the file unless a row names it. A
crash before the row commits leaves a file no row names; one after leaves both. So at open
(`sweep`) temporary files and files no row names are deleted, and a row whose file is
missing or not of its size (a damaged volume, a backup of the database newer than that of
the directory) is dropped with a warning, its summaries losing the digest, as retention
would. A directory missing altogether while rows name files in it stops the start instead
(SqliteState): that is a volume not mounted or a database restored alone, and deleting
every row would make it permanent.

An upload's bytes are flushed to disk behind its writes (`PartFile`): once a mebibyte is
unflushed and no flush is under way, a background thread fdatasyncs the file while the
handler goes on receiving. Sealing then waits for that flush and fsyncs only the tail: for
16 MiB written in 1 MiB chunks at raw gRPC's pace, the disk's part after the last chunk
fell from 19-20 ms to 1.0-1.6 ms (`bench/broker/results/flush_behind_micro.py.txt`). A failure of a background flush is
raised by the next write or by the seal, never dropped (Linux reports a write-back error
to one fsync of a file description, not to every later one).

The files are immutable: a reader that opened one keeps reading it even if retention
deletes it meanwhile (POSIX), so a fetch needs no lock for its whole length.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

from graft_fed.errors import DataError
from graft_fed.federation.errors import StorageFull, Unavailable

log = logging.getLogger("graft_fed.broker")

_HEX = frozenset("0123456789abcdef")
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
FLUSH_BEHIND = 1 << 20  # unflushed bytes of an upload that start a background fdatasync
FLUSH_THREADS = 4  # at most this many uploads' flushes run at once (each waits for the disk)


def file_name(digest: str) -> str:
    """A bundle's file name: its digest when it is one (64 lowercase hex characters, as the
    broker computes them); any other key (tests' short names) hashed, under a prefix no digest
    has, so that no key can name a path outside the directory or collide with a digest."""
    if len(digest) == 64 and _HEX.issuperset(digest):
        return digest
    return "k-" + hashlib.sha256(digest.encode("utf-8", "surrogatepass")).hexdigest()


def storage_error(where: str, exc: OSError, what: str, kind: str = "bundle files") -> Exception:
    """The domain error for a failure of the filesystem of the bundle files (or of `kind`:
    the block files, blockfiles.py), as SqliteState's own."""
    if exc.errno in _NO_SPACE:
        log.error("broker %s %s: the disk is full (%s): %s refused, nothing of it stored. Free disk "
                  "space, or set retention (keep_rounds, max_bundle_gib)", kind, where, exc, what)
        return StorageFull("the broker's storage is full: nothing of this request was stored; retry later "
                           "(the operator must free disk space)")
    log.error("broker %s %s failed during a %s: %s", kind, where, what, exc)
    return Unavailable(f"the broker's storage failed during a {what}: retry later (details in the broker's log)")


class BundleFiles:
    """The directory of bundle files (created when missing, its parent then fsynced so the
    directory itself survives a crash). Opening it checks that the broker can write there:
    a directory restored with the wrong owner stops the start with the reason, rather than
    failing every upload later."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mu = threading.Lock()
        self._flusher: ThreadPoolExecutor | None = None
        self._closed = False
        try:
            if not os.path.isdir(path):
                os.makedirs(path, mode=0o700, exist_ok=True)
                sync_dir(os.path.dirname(os.path.abspath(path)))
            self.create().discard()
        except (OSError, StorageFull, Unavailable) as exc:
            cause = exc.__cause__ if isinstance(exc, (StorageFull, Unavailable)) and exc.__cause__ else exc
            raise DataError(f"broker bundle files {path!r}: cannot write there ({cause}); check that the directory "
                            "and its parent exist, belong to the broker's user and are writable (and that the disk "
                            "has space), or point the broker at another state file") from None

    def file(self, digest: str) -> str:
        return os.path.join(self.path, file_name(digest))

    def create(self) -> "PartFile":
        """A new temporary file, open for writing."""
        tmp = os.path.join(self.path, f".{secrets.token_hex(8)}.part")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise storage_error(self.path, exc, "write") from exc
        return PartFile(self, fd, tmp)

    def _flush(self, fd: int) -> Future | None:
        """A background fdatasync of `fd`; None once closed (the seal's fsync does it all)."""
        with self._mu:
            if self._closed:
                return None
            if self._flusher is None:
                self._flusher = ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="bundle-flush")
            return self._flusher.submit(os.fdatasync, fd)

    def close(self) -> None:
        """Stop the flush threads (after the flushes under way)."""
        with self._mu:
            self._closed = True
            flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.shutdown(wait=True)

    def remove(self, digests: Iterable[str]) -> None:
        """Delete bundles' files (after their rows were deleted); a missing one is no error."""
        for d in digests:
            try:
                os.unlink(self.file(d))
            except FileNotFoundError:
                pass
            except OSError as exc:  # a file no row names is deleted at the next open
                log.warning("broker bundle files %s: could not delete the file of bundle %s (%s)", self.path,
                            d[:16], exc)

    def open(self, digest: str) -> int | None:
        """A descriptor for reading the bundle's file; None when it is missing."""
        try:
            return os.open(self.file(digest), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage_error(self.path, exc, "read") from exc

    def sweep(self, held: dict[str, int]) -> list[str]:
        """At open: delete temporary files and files whose bundle `held` (digest -> size, of
        the rows that say their bytes are here) does not name; return the held digests whose
        file is missing or not of the row's size."""
        names = {file_name(d): d for d in held}
        present = set()
        try:
            entries = list(os.scandir(self.path))
        except OSError as exc:
            raise DataError(f"broker bundle files {self.path!r}: cannot list the directory ({exc}); check that it "
                            "belongs to the broker's user") from None
        stray = 0
        for e in entries:
            if e.name in names:
                try:
                    if e.stat(follow_symlinks=False).st_size == held[names[e.name]]:
                        present.add(e.name)
                        continue
                except OSError:
                    pass
                # not of its row's size: the row is dropped, and the file with it
            if e.name in names or _is_stored(e):
                try:
                    os.unlink(e.path)
                    stray += 1
                except OSError as exc:
                    log.warning("broker bundle files %s: could not delete %s (%s)", self.path, e.name, exc)
        if stray:
            log.info("broker bundle files %s: deleted %d file(s) of uploads a crash cut off", self.path, stray)
        return [d for name, d in names.items() if name not in present]

def _is_stored(entry: os.DirEntry) -> bool:
    """A file the sweep deletes unless a row names it: a temporary file, or a bundle's."""
    return entry.name.endswith(".part") or (entry.is_file(follow_symlinks=False) and (
        entry.name.startswith("k-") or (len(entry.name) == 64 and _HEX.issuperset(entry.name))))


def stored_files(path: str) -> list[str]:
    """The names of the bundle files (and temporary files) in the directory `path`; none
    when it is missing or not a directory. A new state checks this before its first open's
    sweep, which would delete every one of them (SqliteState)."""
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if _is_stored(e))
    except (FileNotFoundError, NotADirectoryError):
        return []


class PartFile:
    """A bundle's temporary file, open for writing, its bytes flushed to disk behind the
    writes (module docstring). Owned by one upload: not for concurrent use."""

    def __init__(self, files: BundleFiles, fd: int, tmp: str) -> None:
        self.files, self.path = files, tmp
        self.fd: int | None = fd
        self._unflushed = 0
        self._flush: Future | None = None

    def write(self, data) -> None:
        if self.fd is None:
            raise ValueError("this bundle file was sealed or discarded")
        view = memoryview(data).cast("B")
        try:
            while len(view):
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            raise storage_error(self.files.path, exc, "write") from exc
        self._unflushed += len(data)
        if self._unflushed >= FLUSH_BEHIND and (self._flush is None or self._flush.done()):
            self._settle()  # a failed flush fails the upload now
            self._flush = self.files._flush(self.fd)
            self._unflushed = 0

    def _settle(self, drop: bool = False) -> None:
        """Wait for the flush under way; raise its failure as the storage's. With `drop`, a
        flush not yet started (queued behind other uploads') is dropped instead: the
        caller's fsync covers its bytes, or the file goes."""
        flush, self._flush = self._flush, None
        if flush is None or (drop and flush.cancel()):
            return
        exc = flush.exception()
        if exc is not None:
            if isinstance(exc, OSError):
                raise storage_error(self.files.path, exc, "write") from exc
            raise exc

    def seal(self, digest: str) -> None:
        """Make the file durable as the bundle's file: fsync, close, rename over any file of
        that name (a leftover of a crash; the same digest, the same bytes), fsync the
        directory. The caller then commits the bundle's row. A failure discards the file."""
        if self.fd is None:
            raise ValueError("this bundle file was sealed or discarded")
        try:
            try:
                self._settle(drop=True)
                os.fsync(self.fd)
            finally:
                fd, self.fd = self.fd, None
                os.close(fd)
            os.replace(self.path, self.files.file(digest))
            sync_dir(self.files.path)
        except OSError as exc:
            self.discard()
            raise storage_error(self.files.path, exc, "write") from exc
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Drop the temporary file (an aborted or duplicate upload); a no-op once renamed."""
        try:
            self._settle(drop=True)
        except Exception:  # noqa: BLE001 - the file goes anyway
            pass
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a leftover is deleted at the next open
            log.warning("broker bundle files %s: could not delete %s (%s)", self.files.path, self.path, exc)


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
