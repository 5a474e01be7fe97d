"""WAL checkpoints in a thread of their own, so that no commit pays for one.

In WAL mode every commit appends pages to the `-wal` file; a checkpoint copies them into the
database file and fsyncs it. By default SQLite runs it inside whichever commit pushes the
WAL past `wal_autocheckpoint` pages: at 64 nodes x 4,096 prompts a round writes about 39 MB
of summary blocks, so every second round one publish's group commit (or the round's match
set) also copied tens of megabytes and waited for their fsync. Here a thread with its own
connection runs a PASSIVE checkpoint (it never waits for, nor blocks, the writer or readers)
once the WAL holds `THRESHOLD_BYTES`, as often as SQLite's default would (1,000 pages of
64 KiB), only not inside a commit. It reads the WAL's size from the file every `poll_s`:
`journal_size_limit` (`WAL_SIZE_LIMIT`) truncates the file when SQLite starts it over after a
checkpoint, so its size is what was written since, give or take that limit. A checkpoint
every second instead cost the 1,000 x 128 cell, whose two rounds never reach the threshold,
a checkpoint and an fsync of the database a second during its publishes (issue 13,
seventeenth pass). The writer's own automatic checkpoint stays as a safety net at a much
larger WAL (`SAFETY_BYTES`), should this thread fall behind. Durability is unchanged: a
commit is durable once the WAL is fsynced (synchronous=FULL); a checkpoint only moves what is
already durable.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger("graft_fed.broker")

#: the WAL's size at which the thread checkpoints it (SQLite's default: 1,000 pages of 64 KiB)
THRESHOLD_BYTES = 64 << 20
#: the writer's own automatic checkpoint: only past this size, where the thread would have to
#: be far behind (set in pages: `safety_pages`)
SAFETY_BYTES = 256 << 20
#: the WAL file is truncated back to this size when SQLite starts it over
WAL_SIZE_LIMIT = 4 << 20


def safety_pages(page_size: int) -> int:
    return max(1000, SAFETY_BYTES // max(512, page_size))


class Checkpointer:
    """PASSIVE checkpoints of the WAL database at `path` once its WAL file reaches
    `threshold_bytes` (looked at every `poll_s`), in a daemon thread, until `stop`. `runs` counts the checkpoints, `last` is the last one's (frames in
    the WAL, frames of it in the database); a failure is logged and the next run tries again
    (the WAL keeps everything meanwhile)."""

    def __init__(self, path: str, threshold_bytes: int = THRESHOLD_BYTES, poll_s: float = 0.25) -> None:
        self.path = path
        self.threshold_bytes = threshold_bytes
        self.poll_s = poll_s
        self.runs = 0
        self.last: tuple[int, int] = (0, 0)
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conn = None
        try:
            while not self._stop.wait(self.poll_s):
                if self.wal_bytes() < self.threshold_bytes:
                    continue
                try:
                    if conn is None:
                        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                               timeout=30.0)
                        conn.execute("PRAGMA synchronous=FULL")  # the database file fsynced after copying
                        conn.execute("PRAGMA cache_size=-1024")
                    self.run_once(conn)
                except sqlite3.Error as exc:
                    self.failures += 1
                    log.warning("broker state %s: a WAL checkpoint failed (%s); retrying in %.1f s (nothing "
                                "acknowledged is lost: the WAL keeps it)", self.path, exc, self.poll_s)
                    if conn is not None:
                        conn.close()
                        conn = None
        finally:
            if conn is not None:
                conn.close()

    def wal_bytes(self) -> int:
        try:
            return os.stat(self.path + "-wal").st_size
        except OSError:
            return 0

    def run_once(self, conn: sqlite3.Connection) -> tuple[int, int]:
        """One PASSIVE checkpoint on `conn`: (frames in the WAL, frames of it now in the database)."""
        _busy, logged, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.runs += 1
        self.last = (logged, done)
        return self.last

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
