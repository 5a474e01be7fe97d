"""An exclusive `flock` held by an open descriptor: how a run folder (one trainer or node per
run.output_dir), a broker's state directory (one broker per state) and an allowlist's folder
(one `broker nodes` edit at a time) are locked. Closing the descriptor, or the process's
end however it ends, releases the lock: nothing is left to clean up after a crash. Each
caller says in its own words what a held lock or a filesystem without flock means for it."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

#: errno values of a lock another open file holds (LOCK_NB)
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class LockHeld(Exception):
    """Another process (or another open of the same path) holds the lock."""


class LockUnsupported(OSError):
    """The path opened, but its filesystem would not lock it (no flock on some network shares)."""


def hold_exclusive(path: str | Path, wait: bool = False, lock_file: bool = False) -> int:
    """Open `path` and take an exclusive flock on it; returns the descriptor, whose close
    releases the lock. `path` is a directory, or with `lock_file` a file, created 0600 where
    missing. `wait`: block until the lock is free; else raise LockHeld at once where it is
    held; LockUnsupported where its filesystem will not lock it; the OSError of `open`
    where it cannot be opened. The descriptor is closed whenever no lock is held."""
    flags = os.O_RDWR | os.O_CREAT if lock_file else os.O_RDONLY | os.O_DIRECTORY
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError as exc:
        os.close(fd)
        if not wait and exc.errno in _HELD:
            raise LockHeld(str(path)) from None
        raise LockUnsupported(exc.errno, exc.strerror, str(path)) from None
    return fd
