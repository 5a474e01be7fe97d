"""WAL checkpoints in a thread of their own, so that no commit pays for one.

In WAL mode every commit appends pages to the `-wal` file; a checkpoint copies them into the
database file and fsyncs it. By default SQLite runs it inside whichever commit pushes the
WAL past `wal_autocheckpoint` pages: at 64 nodes x 4,096 prompts a round writes about 39 MB
of summary blocks, so every second round one publish's group commit (or the round's match
set) also copied tens of megabytes and waited for their fsync. Here a thread with its own
connection runs a PASSIVE checkpoint (it never waits for, nor blocks, the writer or readers)
every `interval_s`; the writer's automatic checkpoint stays as a safety net at a much larger
WAL (`SAFETY_PAGES`), should this thread fall behind. Durability is unchanged: a commit is
durable once the WAL is fsynced (synchronous=FULL); the checkpoint only moves what is
already durable. `journal_size_limit` truncates a WAL that grew large once it is reset.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("graft_fed.broker")

#: the writer's own automatic checkpoint: only past this many WAL pages (256 MiB at the
#: state's 64 KiB pages), where the checkpointer thread would have to be far behind
SAFETY_PAGES = 4096
#: the WAL file is truncated back to this size when it is reset after growing beyond it
WAL_SIZE_LIMIT = 64 << 20


class Checkpointer:
    """PASSIVE checkpoints of the WAL database at `path` every `interval_s`, in a daemon
    thread, until `stop`. `runs` counts the checkpoints, `last` is the last one's (frames in
    the WAL, frames of it in the database); a failure is logged and the next run tries again
    (the WAL keeps everything meanwhile)."""

    def __init__(self, path: str, interval_s: float = 1.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self.runs = 0
        self.last: tuple[int, int] = (0, 0)
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conn = None
        try:
            while not self._stop.wait(self.interval_s):
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
                                "acknowledged is lost: the WAL keeps it)", self.path, exc, self.interval_s)
                    if conn is not None:
                        conn.close()
                        conn = None
        finally:
            if conn is not None:
                conn.close()

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
