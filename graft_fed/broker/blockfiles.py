"""Summary blocks' bytes as files: one append-only file per round in a directory beside the
SQLite state (`<db>-blocks/r<round>`), each block's row in `summary_blocks` holding where
its bytes are (offset, length, CRC-32) instead of the bytes.

Why (issue 13): SQLite wrote every block twice, into the WAL at the commit and again into
the database file at a checkpoint, page by page, and most of a 64 x 4,096 publish's write
was that. A group commit of eight 480 KB blocks took 4.7 ms (2.8 ms of CPU), and a
checkpoint every eighth group 32 ms more (14 ms of CPU); appending the same bytes to a file
and fdatasyncing it, then committing eight small rows, took 3.7 ms (1.9 ms of CPU) with
nothing left for the checkpoint (`bench/broker/results/block_files_micro.py.txt`,
`block_files_micro.txt`).

Durability, in this order, under the state's lock (one group commit at a time): the
group's blocks are appended at the end of their rounds' files (the directory fsynced when a
file is opened for appending, so that a new file's name is durable), every file written is
fdatasynced, then the rows naming them are inserted and the transaction commits (fsynced).
A crash before the commit leaves bytes no row names at the end of a file: harmless, and cut
off at the next open (`sweep`, which also deletes the files of rounds no row names: a crash
between retention's commit and its deletions). Nothing is ever written over: a region a
committed row names never changes, so readers need no lock beyond the state's. A failed
commit or write leaves its bytes in place and the next append goes after them (truncating
could cut a commit SQLite reported failed but made durable): bytes no row names, which the
sweep cuts off at the next open when they are a file's last, and which otherwise stay
between two blocks until retention deletes the round's file.

A read checks the region against its row: a file missing, shorter than the row says or
whose bytes do not match the row's CRC-32 is a damaged block (`SummaryBlockError`, as a
damaged blob in the database is). The state fails the reads and writes of that node's round
with it, and reads across nodes skip it with an error in the log (state_sqlite.py). After
the open found a file missing or short, appends to it start where its rows end (a hole, not
an overwrite of what they name).

One broker per state: the directory is locked (an exclusive `flock` on its `.lock`, held
until `close` and released by the kernel when the process dies). Two processes appending at
their own idea of a file's end would write over each other's acknowledged blocks, and a
second open's sweep would cut off what the first is about to commit; the second open stops
with a DataError instead.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import zlib
from collections import OrderedDict
from typing import Sequence

from graft_fed.broker.bundlefiles import sync_dir, storage_error
from graft_fed.errors import DataError
from graft_fed.federation.summaryblock import SummaryBlockError
from graft_fed.fslock import LockHeld, LockUnsupported, hold_exclusive

log = logging.getLogger("graft_fed.broker")

_NAME = re.compile(r"r(0|-?[1-9][0-9]{0,18})\Z")  # file_name's spelling only: r7, not r007
#: round files kept open for appending: the rounds being published (asynchronous mode keeps
#: up to max(16, 2 x staleness + 4) rounds open; a file reopened costs an open and a close)
_OPEN_FILES = 64
LOCK_NAME = ".lock"
_IOV_MAX = 512  # buffers per pwritev (POSIX guarantees 16; Linux takes 1,024)


def file_name(round: int) -> str:
    return f"r{int(round)}"


def stored_files(path: str) -> list[str]:
    """The names of the round files in the directory `path` (those the sweep deletes unless
    a row names their round); none when it is missing or not a directory. A new state checks
    this before its first open's sweep, which would delete every one of them (SqliteState)."""
    try:
        return sorted(name for name in os.listdir(path) if _NAME.match(name))
    except (FileNotFoundError, NotADirectoryError):
        return []


class BlockFiles:
    """The directory of round files (created when missing, its parent then fsynced). Opening
    it checks that the broker can write there. `append` is for one caller at a time (the
    state's group commit, under its lock); `read` for any."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fds: OrderedDict[int, list[int]] = OrderedDict()  # round -> [fd, end] of files open for appending
        self._floor: dict[int, int] = {}  # round -> where its rows end, for files the sweep found missing or short
        self._unsynced: set[int] = set()  # rounds whose file was created and the directory not yet fsynced since
        self._mu = threading.Lock()
        self._lock_fd: int | None = None
        try:
            if not os.path.isdir(path):
                os.makedirs(path, mode=0o700, exist_ok=True)
            sync_dir(os.path.dirname(os.path.abspath(path)))  # the directory's own name, durable
            probe = os.path.join(path, ".probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
            os.close(fd)
            os.unlink(probe)
            self._lock_fd = hold_exclusive(os.path.join(path, LOCK_NAME), lock_file=True)
        except LockHeld:
            raise DataError(f"broker block files {path!r}: another broker process has this state open (its "
                            f"{LOCK_NAME} is locked). Run one broker per state file: stop the other one, or "
                            "point this one at another state file") from None
        except LockUnsupported as exc:
            raise DataError(f"broker block files {path!r}: cannot lock {LOCK_NAME} ({exc.strerror}); the directory "
                            "must be on a filesystem with flock (a local disk, not every network share)") from None
        except OSError as exc:
            raise DataError(f"broker block files {path!r}: cannot write there ({exc}); check that the directory "
                            "and its parent exist, belong to the broker's user and are writable (and that the disk "
                            "has space), or point the broker at another state file") from None

    def file(self, round: int) -> str:
        return os.path.join(self.path, file_name(round))

    def _appender(self, round: int) -> list[int]:
        got = self._fds.get(round)
        if got is not None:
            self._fds.move_to_end(round)
            return got
        if self._lock_fd is None:
            raise OSError(errno.EBADF, "the block files are closed")
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.file(round), flags | os.O_CREAT | os.O_EXCL, 0o600)
            self._unsynced.add(round)
        except FileExistsError:
            fd = os.open(self.file(round), flags)
        try:
            # a new file's name must survive a crash as its bytes will: the directory is
            # fsynced after a creation (and at every later open of that file until one such
            # fsync succeeded)
            if round in self._unsynced:
                sync_dir(self.path)
                self._unsynced.discard(round)
            # past what rows name, also where the sweep found the file short (a hole there)
            entry = self._fds[round] = [fd, max(os.fstat(fd).st_size, self._floor.get(round, 0))]
        except BaseException:
            os.close(fd)
            raise
        return entry

    def _close_oldest(self) -> None:
        """Keep _OPEN_FILES files open (after an append: one may span more rounds)."""
        while len(self._fds) > _OPEN_FILES:
            _, (old, _end) = self._fds.popitem(last=False)
            os.close(old)

    def append(self, items: Sequence[tuple[int, bytes | Sequence]]) -> list[tuple[int, int, int]]:
        """Append each (round, data) at the end of its round's file and make them durable
        (fdatasync of every file written); (offset, length, CRC-32) of each, in order. `data`
        is bytes, or a block's encoding as the buffers that make it (SummaryBlock.to_parts),
        written in order with one pwritev. A failure raises the storage's error (StorageFull,
        Unavailable); what it wrote is left for the sweep."""
        out: list[tuple[int, int, int]] = []
        written: dict[int, list[int]] = {}
        with self._mu:
            try:
                for round, data in items:
                    entry = written.get(round) or self._appender(round)
                    written[round] = entry
                    fd, off = entry
                    parts = [memoryview(p).cast("B") for p in ((data,) if isinstance(data, (bytes, bytearray,
                                                                                          memoryview)) else data)]
                    entry[1] = at = _pwrite_parts(fd, parts, off)
                    crc = 0
                    for p in parts:
                        crc = zlib.crc32(p, crc)
                    out.append((off, at - off, crc))
                for fd, _ in written.values():
                    os.fdatasync(fd)
                self._close_oldest()
            except OSError as exc:
                for round in written:  # re-read each file's end when next opened
                    fd_end = self._fds.pop(round, None)
                    if fd_end is not None:
                        try:
                            os.close(fd_end[0])
                        except OSError:
                            pass
                raise storage_error(self.path, exc, "write", "block files") from exc
        return out

    def read(self, round: int, offset: int, length: int, crc: int, what: str) -> bytes:
        """The bytes of a block stored at (offset, length) of the round's file; a
        SummaryBlockError naming `what` when they are missing or not what the row says."""
        try:
            fd = os.open(self.file(round), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise SummaryBlockError(f"{what}: its file {self.file(round)!r} is missing") from None
        except OSError as exc:
            raise storage_error(self.path, exc, "read", "block files") from exc
        try:
            data = _pread_all(fd, offset, length)
        except OSError as exc:
            raise storage_error(self.path, exc, "read", "block files") from exc
        finally:
            os.close(fd)
        if len(data) != length:
            raise SummaryBlockError(f"{what}: its file {self.file(round)!r} ends before the block's {length} bytes "
                                    f"at offset {offset}")
        if zlib.crc32(data) != crc:
            raise SummaryBlockError(f"{what}: its {length} bytes at offset {offset} of {self.file(round)!r} do not "
                                    "match the checksum stored with its row (the file was damaged)")
        return data

    def remove_below(self, cutoff: int) -> None:
        """Delete the files of rounds before `cutoff` (after their rows were deleted); one
        that cannot be deleted now is logged and deleted at the next open. Never raises: the
        rows' deletion has committed."""
        with self._mu:
            for round in [r for r in self._fds if r < cutoff]:
                try:
                    os.close(self._fds.pop(round)[0])
                except OSError:
                    pass
            for round in [r for r in self._floor if r < cutoff]:
                del self._floor[round]
            try:
                on_disk = self._rounds_on_disk()
            except DataError as exc:
                log.warning("%s; the files of rounds before %d are deleted at the next open", exc, cutoff)
                return
            for round in on_disk:
                if round < cutoff:
                    self._unlink(round)

    def _unlink(self, round: int) -> None:
        try:
            os.unlink(self.file(round))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("broker block files %s: could not delete %s (%s)", self.path, file_name(round), exc)

    def _rounds_on_disk(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise DataError(f"broker block files {self.path!r}: cannot list the directory ({exc}); check that it "
                            "belongs to the broker's user") from None
        return [int(m.group(1)) for m in map(_NAME.match, names) if m is not None]

    def sweep(self, ends: dict[int, int]) -> dict[int, int]:
        """At open, given the end of the last block rows name in each round's file: delete the
        files of rounds no row names, cut off bytes past that end (appended by a group whose
        commit did not happen); return {round: bytes missing} for files missing or shorter
        than their rows say (those blocks read as damaged)."""
        short: dict[int, int] = {}
        cut = deleted = 0
        with self._mu:
            on_disk = set(self._rounds_on_disk())
            for round in sorted(on_disk - set(ends)):
                self._unlink(round)
                deleted += 1
            for round, end in sorted(ends.items()):
                if round not in on_disk:
                    short[round] = end
                    continue
                path = self.file(round)
                try:
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode):
                        raise DataError(f"broker block files {self.path!r}: {file_name(round)} is not a regular "
                                        "file (a directory, a link or a device is never written there); move it "
                                        "aside and restore the round's file from a backup, or delete it to drop "
                                        "that round's publishes")
                    size = st.st_size
                    if size > end:
                        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
                        try:
                            os.ftruncate(fd, end)
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                        cut += 1
                    elif size < end:
                        short[round] = end - size
                except OSError as exc:
                    raise DataError(f"broker block files {self.path!r}: cannot check {file_name(round)} ({exc}); "
                                    "check that the directory and its files belong to the broker's user") from None
            self._floor = {round: ends[round] for round in short}
        if deleted or cut:
            log.info("broker block files %s: deleted %d file(s) of rounds no row names and cut the end off %d "
                     "(bytes of publishes a crash or a failed commit left unstored)", self.path, deleted, cut)
        return short

    def close(self) -> None:
        """Close the files and release the directory's lock; an append after raises (the
        storage's Unavailable)."""
        with self._mu:
            while self._fds:
                _, (fd, _end) = self._fds.popitem()
                try:
                    os.close(fd)
                except OSError:
                    pass
            if self._lock_fd is not None:
                try:
                    os.close(self._lock_fd)  # releases the flock
                except OSError:
                    pass
                self._lock_fd = None


def _pwrite_parts(fd: int, parts: list[memoryview], at: int) -> int:
    """Write the buffers, in order, at `at` (one pwritev, another for what a short write
    left); the offset after them."""
    parts = [p for p in parts if len(p)]
    while parts:
        n = os.pwritev(fd, parts[:_IOV_MAX], at)
        if n <= 0:
            raise OSError(errno.EIO, "a write of a block file made no progress")
        at += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if n:
            parts[0] = parts[0][n:]
    return at


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    parts, got = [], 0
    while got < length:
        part = os.pread(fd, length - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)
