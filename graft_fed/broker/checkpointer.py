"""WAL checkpoints in a thread of their own, so that no commit pays for one.

In WAL mode every commit appends pages to the `-wal` file; a checkpoint copies them into the
database file and fsyncs it. By default SQLite runs it inside whichever commit pushes the
WAL past `wal_autocheckpoint` pages: at 64 nodes x 4,096 prompts a round writes about 39 MB
of summary blocks, so every second round one publish's group commit (or the round's match
set) also copied tens of megabytes and waited for their fsync. Here a thread with its own
connection runs a PASSIVE checkpoint (it never waits for, nor blocks, the writer or readers)
each time the WAL file has grown by `THRESHOLD_BYTES` since the last one, as often as
SQLite's default would (1,000 pages of 64 KiB), only not inside a commit; it looks at the
file's size every `poll_s`. SQLite starts the WAL over at the first write after a
checkpoint that left nothing uncopied, and `journal_size_limit` (`WAL_SIZE_LIMIT`) then
truncates the file, so its size falls back and counts again from there. Under writes that never
pause, the WAL keeps growing until the writer's own automatic checkpoint, kept as a safety
net at `SAFETY_BYTES`, runs in a commit; it finds most pages copied already. A checkpoint
every second, or on every poll while the file was large, ran during the publishes of
rounds that never reach the threshold (issue 13, seventeenth pass).

A checkpoint triggered by growth runs while commits append, so it rarely copies the last
frames, and SQLite starts the WAL over only after one that copied everything: at 64 nodes
x 4,096 prompts the file grew by about 38 MB a round to the safety size, and every seventh
round or so one commit (a publish's, or the match set's that every answer of the round
waits for) ran the safety net's checkpoint: 246 ms instead of 60-80 for the round's match
(issue 13, twenty-first pass). So the thread also checkpoints a WAL of at least
`IDLE_BYTES` that has frames left to copy and did not grow since its last look: the quiet
moment after a round's match, while the nodes train. A PASSIVE checkpoint copies the frames;
when it copied them all and no commit came meanwhile, a TRUNCATE one empties the file (it
holds writers off while it runs, which with nothing left to copy is the truncation, and gives
up at once when a writer or a reader of the WAL is busy). Durability is
unchanged: a commit is durable once the WAL is fsynced (synchronous=FULL); a checkpoint only
moves what is already durable.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger("graft_fed.broker")

#: the WAL's growth after which the thread checkpoints it (SQLite's default: 1,000 pages of 64 KiB)
THRESHOLD_BYTES = 64 << 20
#: the writer's own automatic checkpoint: only past this size, where the thread would have to
#: be far behind (set in pages: `safety_pages`)
SAFETY_BYTES = 256 << 20
#: the WAL file is truncated back to this size when SQLite starts it over
WAL_SIZE_LIMIT = 4 << 20
#: a WAL file at least this large, with frames left to copy, that did not grow between two
#: looks is checkpointed (so it starts over in a quiet moment)
IDLE_BYTES = 16 << 20


def safety_pages(page_size: int) -> int:
    return max(1000, SAFETY_BYTES // max(512, page_size))


class Checkpointer:
    """PASSIVE checkpoints of the WAL database at `path` each time its WAL file grew by
    `threshold_bytes`, and when a file of at least `idle_bytes` with frames left to copy did
    not grow since the last look (looked at every `poll_s`), in a daemon thread, until
    `stop`. `runs` counts the checkpoints, `idle_runs` those of the second kind, and
    `truncations` the TRUNCATE checkpoints that follow a quiet one which copied everything
    (each part of a checkpoint counted in `runs`, not another one); `last` is the last
    one's (frames in the WAL, frames of it in the database); a failure is logged and retried
    with a growing pause (the WAL keeps everything meanwhile), and `failures` counts them."""

    def __init__(self, path: str, threshold_bytes: int = THRESHOLD_BYTES, poll_s: float = 0.25,
                 idle_bytes: int = IDLE_BYTES) -> None:
        self.path = path
        self.threshold_bytes = threshold_bytes
        self.idle_bytes = idle_bytes
        self.idle_runs = 0
        self.poll_s = poll_s
        self.looks = 0  # times the thread looked at the WAL's size
        self.runs = 0
        self.truncations = 0
        self.last: tuple[int, int] = (0, 0)
        self.failures = 0
        self._stop = threading.Event()
        # where the WAL stood when this checkpointer was made, read here rather than in the
        # thread: a thread scheduled late would take frames committed meanwhile as copied
        self._start_mark = self.wal_bytes()
        self._thread = threading.Thread(target=self._loop, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conn = None
        mark = self._start_mark  # where in the file the last checkpoint's copied frames end
        frame = 0  # bytes per WAL frame: a page and its 24-byte header
        pause = self.poll_s
        try:
            seen = mark  # the file's size at the last look
            idle_at = -1  # its size at the last checkpoint for idleness (one per quiet spell)
            while not self._stop.wait(pause):
                size = self.wal_bytes()
                self.looks += 1
                mark = min(mark, size)  # SQLite started the WAL over: the file was truncated
                idle = size == seen and size >= self.idle_bytes and size > mark and size != idle_at
                seen = size
                if size - mark < self.threshold_bytes and not idle:
                    continue
                try:
                    if conn is None:
                        # no busy timeout: a PASSIVE checkpoint never waits
                        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=0.0)
                        conn.execute("PRAGMA synchronous=FULL")  # the database file fsynced after copying
                        conn.execute("PRAGMA cache_size=-1024")
                        frame = 24 + conn.execute("PRAGMA page_size").fetchone()[0]
                    quiet = idle and size - mark < self.threshold_bytes
                    logged, done = self.run_once(conn)
                    if quiet and 0 <= logged == done and self.wal_bytes() == size:
                        # All copied, and the database fsynced, without holding a writer off, and
                        # no commit since (it would have grown the file, or started it over and
                        # cut it to WAL_SIZE_LIMIT): the WAL starts over here, truncated, rather
                        # than in the next commit. TRUNCATE holds writers off while it runs, which
                        # with nothing left to copy is the file's truncation; a writer or a
                        # reader of the WAL busy makes it give up at once (busy timeout 0).
                        logged, done = self.run_once(conn, "TRUNCATE")
                    if quiet:
                        self.idle_runs += 1
                        idle_at = size
                    if done >= 0:  # -1: another connection's checkpoint was running; nothing known
                        # frames a commit was still appending when the checkpoint ran are not
                        # copied: they count as growth towards the next one, not as done
                        mark = min(self.wal_bytes(), 32 + done * frame)
                    pause = self.poll_s
                except Exception as exc:  # noqa: BLE001 - logged, retried; the WAL keeps everything
                    self.failures += 1
                    pause = min(30.0, max(self.poll_s, 2 * pause))
                    log.warning("broker state %s: a WAL checkpoint failed (%s: %s); retrying in %.1f s (nothing "
                                "acknowledged is lost: the WAL keeps it)", self.path, type(exc).__name__, exc, pause,
                                exc_info=not isinstance(exc, sqlite3.Error))
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

    def run_once(self, conn: sqlite3.Connection, mode: str = "PASSIVE") -> tuple[int, int]:
        """One checkpoint on `conn`: (frames in the WAL, frames of it now in the database)."""
        _busy, logged, done = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        if mode == "TRUNCATE":
            self.truncations += 1
        else:
            self.runs += 1
        self.last = (logged, done)
        return self.last

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
