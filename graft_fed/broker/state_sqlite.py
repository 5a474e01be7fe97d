"""`BrokerState` in one SQLite file: the broker's default, durable state.

- WAL journal with `synchronous=FULL`: a method that returned has its transaction fsynced
  in the WAL, so a crash (process or machine) after it returns loses nothing, and a crash
  before leaves the previous state.
- One connection (`check_same_thread=False`) behind one re-entrant lock: every method,
  read or write, holds the lock, and every mutating method is exactly one
  `BEGIN IMMEDIATE ... COMMIT` transaction, rolled back when anything in it raises.
- Group commit for publishes: concurrent `put_summaries` / `put_summary_block` calls share
  one transaction and so one fsync, and a handful of statements: one read of what the
  group's (node, round)s already hold, one multi-row INSERT of all the group's blocks, one
  of their node rows (each statement hands the interpreter back and must win it again
  behind the threads still parsing, so their number, not their size, is what a group
  costs). The blocks are normalised, deduplicated and encoded by their callers before
  they queue; a call that fails while the group is planned (a damaged stored block of its
  node and round) fails alone. Should a batched statement fail for any other reason than
  the storage, the group is written again one call at a time, each in its own savepoint,
  so that only the call that fails fails. None returns before the shared COMMIT is
  durable, and a failure of the COMMIT itself fails every call of the group (none of them
  is stored).
- A bundle's bytes are a file of their own beside the database (`<db>-bundles/<digest>`,
  broker/bundlefiles.py), fsynced and renamed before the bundle's row commits; its row is
  the index. Files no row names are deleted at open, rows whose file is missing dropped.
- The database file is created 0600 (SQLite gives its -wal and -shm files the same mode):
  it holds live session ids. An existing one readable by group or others is tightened to
  0600 at open, with a warning.
- A new (missing or empty) database beside bundle or block files of a previous one (a
  database lost or emptied, its directories not) stops the start, deleting nothing: the
  sweeps at open would otherwise take every one of those files for a crash's leftover.
- A file the broker cannot read and write (permissions, a read-only mount) stops the start
  with that reason, never with advice to move the data aside.
- The state is bound to one federation (`bind_manifest`, state.py): the manifest's
  identifying fields are stored in `meta` (key `manifest`, JSON) the first time and a
  broker configured for another federation is refused.
- The schema is created on first open; a `meta` table holds `schema_version`. A file of
  an older version is migrated in place (one transaction); a file of a newer version, or a
  file that is not a SQLite database, raises `DataError` naming the file and what to do.
- A file that SQLite opens but whose pages are damaged fails `PRAGMA quick_check` at open:
  `DataError` naming the file and what to do, never a silently empty or partial state.
  At run time, a write the disk cannot take (SQLITE_FULL) raises `StorageFull`
  (RESOURCE_EXHAUSTED to the caller) and any other storage failure `Unavailable`; the
  transaction is rolled back, so what was acknowledged before is intact, and reads go on.
- Float columns carry no declared type (a `REAL` column turns -0.0 into 0.0) and NaN is
  stored as the text 'nan' (SQLite turns a NaN into NULL). A publish's summaries are one
  blob of little-endian columns (federation/summaryblock.py) and a synchronous round's
  matches another (broker/matchset.py). So every float reads back bit for bit (NaN as a NaN).

See docs/broker-state.md for the schema and the contract.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from graft_fed.broker import blockfiles, bundlefiles
from graft_fed.broker.blockfiles import BlockFiles
from graft_fed.broker.bundlefiles import BundleFiles, PartFile, storage_error
from graft_fed.broker.checkpointer import WAL_SIZE_LIMIT, Checkpointer, safety_pages
from graft_fed.broker.reportblock import decode_report_columns, encode_report_columns
from graft_fed.broker.sqlite_schema import SCHEMA_VERSION, create, db2f, f2db, migrate
from graft_fed.broker.state import (BrokerState, BundleWriter, CompatRow, MatchRow, NodeRow, ReportRow, RoundRow,
                                    SummaryHead, SummaryRow)
from graft_fed.broker.state_rows import (
    as_float, as_int, as_str, bundles_to_drop, check_prune_args, fold_compat, lower_counts, norm_blob, norm_block,
    norm_bytes, norm_compat_args, norm_digests, norm_match, norm_node, norm_pairs, norm_prompt_ids, norm_round,
    norm_summary, opt_int, opt_str, prune_cutoff, report_segments, summary_key, ReportSegment,
)
from graft_fed.errors import DataError
from graft_fed.federation.messages import ReportColumns
from graft_fed.federation.summaryblock import SummaryBlock, SummaryBlockError, facts_of, group_rows
from graft_fed.federation.errors import NotFound, StorageFull, Unavailable

log = logging.getLogger("graft_fed.broker")

PAGE_SIZE = 65536
# what a summary block's row says of its bytes: the bytes, or where they are in its round's file
_BLOCK_BYTES = "data, file_offset, file_length, file_crc"

_MATCH_COLS = "round, receiver, prompt_id, source, source_round"
_NODE_COLS = "node_id, model_id, tokenizer_id, privacy, state, session_id, round, last_seen, published"
_COMPAT_COLS = "source, receiver, groups, mean_s, admitted_fraction, rejected, undelivered"


# Primary result codes that mean the database itself failed (not the statement's input).
_STORAGE_FAILURES = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB,
                     sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
                     sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_PROTOCOL}


def _is_storage_failure(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _STORAGE_FAILURES


def _storage_failed(exc: BaseException) -> bool:
    """A failure of the storage (SQLite's or the block files'), not of one caller's data: it
    fails the whole group commit."""
    return isinstance(exc, (StorageFull, Unavailable)) or (isinstance(exc, sqlite3.Error)
                                                            and _is_storage_failure(exc))


_PERMISSION_CODES = {sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM}
_DAMAGE_CODES = {sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT}


def _access_problem(path: str) -> str | None:
    """Why this process cannot read and write the state file and create its -wal and -shm
    files beside it, as far as statvfs(2) and access(2) tell (a read-only mount stops root
    too); None when nothing says so."""
    where = os.path.dirname(os.path.abspath(path))
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return f"{where} is on a read-only mount"
    except OSError:
        pass
    for p in (path, path + "-wal", path + "-shm"):
        if os.path.exists(p) and not os.access(p, os.R_OK | os.W_OK):
            return f"{p} is not readable and writable by this process (uid {os.geteuid()})"
    if os.path.isdir(where) and not os.access(where, os.W_OK | os.X_OK):
        return f"its directory {where} is not writable by this process (uid {os.geteuid()})"
    return None


def _tighten(path: str) -> None:
    """The state file, -wal and -shm readable or writable by group or others (a file from
    before graft-fed created it 0600, or copied in): made 0600, with a warning. The database
    holds live session ids, which let a caller act as a node where mutual TLS is off."""
    for p in (path, path + "-wal", path + "-shm"):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o077:
            continue
        mode = stat.S_IMODE(st.st_mode)
        try:
            os.chmod(p, mode & 0o700)
        except OSError as exc:
            log.warning("broker state %s: mode %04o lets other users read it (it holds live session ids), and it "
                        "could not be tightened (%s): chmod 600 it", p, mode, exc)
            continue
        log.warning("broker state %s: mode %04o let other users read it (it holds live session ids): tightened to "
                    "%04o", p, mode, mode & 0o700)


def _json(values: list) -> str:
    return json.dumps(values, separators=(",", ":"))  # repr of a float round-trips exactly


_READ_FAILED = "the broker's storage failed during a read: retry later (details in the broker's log)"

#: bound parameters per statement (SQLite's default limit before 3.32 is 999)
_MAX_PARAMS = 999


def _spans(count: int, per: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) spans of `count` items for statements of a row each: `per` rows at most, and
    the rest in powers of two (37 -> 32, 4, 1). Every distinct row count is a statement of
    its own in the connection's cache of prepared statements, which keeps each (up to
    `cached_statements`): with any count, a broker's SQLite memory grew for most of an hour
    (issue 13, fifteenth pass); with these, a head has at most a few shapes."""
    lo = 0
    while count - lo >= per:
        yield lo, lo + per
        lo += per
    while lo < count:
        size = 1 << ((count - lo).bit_length() - 1)
        yield lo, lo + size
        lo += size


class _Job:
    """One caller's part of a group commit: its blocks (normalised, each with its encoding),
    and the node row to write with them (its `published` count raised by what is stored);
    or an uploaded bundle's row, (digest, size, signature, certificate, the node that
    uploaded it or ''), whose file is in place (result: 1 when stored, 0 when the digest was
    held); or a digest to attach to a held summary, (node, round, prompt id, digest) (result: 1 when attached, 0 when no such
    summary is held); or both, the row and then the attachment (result: stored; attached:
    attached), so that an upload waits for one commit. Concurrent uploads thus share commits with each other and with
    publishes (issue 13, eighteenth pass)."""

    __slots__ = ("blocks", "encoded", "node", "bundle", "attach", "done", "lead", "result", "attached", "error",
                 "added")

    def __init__(self, blocks: list[SummaryBlock], encoded: list[list], node: NodeRow | None,
                 bundle: tuple[str, int, bytes, bytes, str] | None = None,
                 attach: tuple[str, int, str, str] | None = None) -> None:
        self.blocks, self.encoded, self.node = blocks, encoded, node
        self.bundle, self.attach = bundle, attach
        self.done = threading.Event()
        self.lead = False  # woken to commit the next group rather than with a result
        self.result: Any = None
        self.attached = 0  # a bundle's job with `attach`: whether the digest was attached
        self.error: BaseException | None = None
        self.added: list[tuple[str, int]] = []  # (node, summaries) of each block it wrote


def _filter(round: int | None, receiver: str | None, source: str | None) -> tuple[str, list[Any]]:
    """` WHERE ...` (or '') and its parameters for the optional round / receiver / source."""
    where, params = [], []
    for column, value in (("round", opt_int(round, "round")), ("receiver", opt_str(receiver, "receiver")),
                          ("source", opt_str(source, "source"))):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    return (" WHERE " + " AND ".join(where) if where else ""), params


class SqliteState(BrokerState):
    """`BrokerState` in the SQLite file at `path` (created when missing). A new instance on
    the same file restores everything a previous one wrote."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._lock = threading.RLock()
        self._group: list[_Job] = []  # publishes waiting for the next group commit
        self._group_mu = threading.Lock()
        self._group_leader = False
        self.group_commits = 0  # transactions that committed a group (for benches and tests)
        self._damage_logged: set[str] = set()  # damaged blocks reads across nodes skipped (logged once each)
        self.grouped_calls = 0
        self._conn = self._open(self.path)
        # bundles' bytes: a file each in <db>-bundles/ (bundles.in_file); digest -> uploads
        # between their file's rename and their row's commit (retention leaves their file)
        self._sealing: dict[str, int] = {}
        try:
            self._open_files(self.path + "-bundles")
            try:
                self._open_blocks(self.path + "-blocks")
            except BaseException:
                self.files.close()
                raise
            try:
                # summaries held and bundle bytes uploaded per node (the per-node quotas'
                # counts): changed under the lock by the commits that store or drop them,
                # read without it (summaries_held, bundle_bytes_held)
                self._held_by_node: Counter[str] = Counter(
                    {node: int(n) for node, n in self._read("SELECT node_id, SUM(count) FROM summary_blocks "
                                                            "GROUP BY node_id")})
                self._bundle_bytes_by_node: Counter[str] = Counter(
                    {node: int(n) for node, n in self._read("SELECT node_id, SUM(size) FROM bundles WHERE "
                                                            "node_id != '' GROUP BY node_id")})
                # bundles stored from now on have higher rowids (not the wall clock, which an NTP
                # step or a restored backup of a host whose clock ran ahead would mislead); a rowid
                # SQLite hands out again once the highest rows were deleted only makes
                # bundle_held_at_open say True of a new bundle: a needless check
                self._bundle_rowid_at_open = int(self._read("SELECT COALESCE(MAX(rowid), 0) FROM bundles")[0][0])
            except BaseException:
                self.blocks.close()
                self.files.close()
                raise
        except BaseException:
            self._conn.close()
            raise
        self.checkpointer = Checkpointer(self.path)

    def _open_files(self, where: str) -> None:
        """The bundles directory, swept of what uploads a crash cut off (and the rows of
        schema 4's parts no bundle names). A missing directory while rows name files in it is
        an operator's mistake (a volume not mounted, a database restored alone), not damage:
        the start stops, deleting nothing."""
        with self._tx() as conn:
            conn.execute("DELETE FROM bundle_parts WHERE parts NOT IN (SELECT parts FROM bundles)")
            held = dict(conn.execute("SELECT digest, size FROM bundles WHERE in_file = 1").fetchall())
            if held:
                self._require_dir(where, f"{len(held)} bundle(s)", "create it empty to start without those bundles")
            self.files = BundleFiles(where)
            lost = self.files.sweep(held)
            if lost:
                log.warning("broker state %s: %d bundle(s) whose file is missing from %s or shorter or longer than "
                            "its row says (a damaged volume, or a backup of the database newer than that of its "
                            "bundles) are dropped, as retention would: %s", self.path, len(lost), self.files.path,
                            ", ".join(d[:16] for d in lost[:8]))
                self._drop_bundles(conn, lost)

    def _require_dir(self, where: str, named: str, otherwise: str) -> None:
        """Rows name files in `where`: a directory missing there is an operator's mistake (a
        volume not mounted, a database restored alone), not damage, so the start stops,
        deleting nothing."""
        if not os.path.isdir(where):
            raise self._fail(self.path, f"names {named} stored as files in {where!r}, which does not exist. Restore "
                                        "that directory beside the database (docs/deploy.md, State and backups), or "
                                        + otherwise)

    def _open_blocks(self, where: str) -> None:
        """The summary blocks' directory (blockfiles.py), swept of what a crash left: files
        of rounds no row names, bytes past the last block rows name. As for bundles, a
        missing directory while rows name files in it stops the start."""
        query = ("SELECT round, MAX(file_offset + file_length) FROM summary_blocks WHERE file_offset >= 0 "
                 "GROUP BY round")
        ends = dict(self._read(query))
        if ends:
            self._require_dir(where, f"summary blocks of {len(ends)} round(s)",
                              "move the database aside to start with an empty state")
        self.blocks = BlockFiles(where)  # locked: one broker per state (blockfiles.py)
        try:
            # read again under the lock: another broker may have committed since
            short = self.blocks.sweep(dict(self._read(query)))
        except BaseException:
            self.blocks.close()
            raise
        if short:
            log.error("broker state %s: the block files of %d round(s) (%s) are missing or shorter than their rows "
                      "say (a damaged volume, or a backup of the database newer than that of %s): those "
                      "publishes read as damaged. Restore the directory from a copy taken after the database's",
                      self.path, len(short), ", ".join(map(str, sorted(short)[:8])), where)

    def _block_data(self, node_id: str, round: int, data: bytes, offset: int, length: int, crc: int) -> bytes:
        """A summary block's bytes from its row (_BLOCK_BYTES): in the row, or read from its
        round's file and checked (a SummaryBlockError when damaged)."""
        if offset < 0:
            return data
        return self.blocks.read(round, offset, length, crc, f"summary block of node {node_id!r}, round {round}")

    # ----- opening
    @staticmethod
    def _fail(path: str, what: str) -> DataError:
        return DataError(f"broker state {path!r}: {what}")

    def _open(self, path: str) -> sqlite3.Connection:
        existed = os.path.exists(path)
        empty = existed and os.path.isfile(path) and os.path.getsize(path) == 0
        self._fresh = False  # the schema was created by this open (_init_schema)
        created = False
        if not existed:
            try:  # 0600 before SQLite creates it 0644 (its -wal and -shm take the file's mode)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600))
                created = True
            except FileExistsError:
                pass
            except OSError as e:
                raise self._fail(path, f"cannot open it: creating it failed ({e}); check that the directory "
                                       "exists, belongs to the broker's user and is writable (and is not on a "
                                       "read-only mount), or point the broker at another state file") from None
        try:
            conn = self._connect_checked(path)
        except BaseException:
            if created:  # the empty file this open created, and nothing else
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        if existed:  # once it is known to be a broker state (never another file's mode)
            _tighten(path)
        if empty and self._fresh:
            log.warning("broker state %s exists but is empty (0 bytes): starting a new, empty state in it", path)
        if not existed:
            log.info("broker state %s: new file, empty state", path)
        return conn

    def _connect_checked(self, path: str) -> sqlite3.Connection:
        try:
            # a group commit's INSERT has one text per number of rows: room for them in the cache
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30.0,
                                   cached_statements=1024)
        except sqlite3.Error as e:
            raise self._fail(path, f"cannot open it ({e}); check that the directory exists and is "
                                   "writable, or point the broker at another state file") from None
        try:
            self._init_schema(conn, path)
            problems = [r[0] for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
            if problems != ["ok"]:
                conn.close()
                raise self._fail(path, "is damaged: SQLite's quick_check found " + "; ".join(problems)[:400]
                                 + ". Restore it from a backup, or move it (and its -wal file) aside to start "
                                   "with an empty state; do not keep writing to it")
        except sqlite3.DatabaseError as e:
            conn.close()
            code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
            access = _access_problem(path)
            if code in _PERMISSION_CODES or (access and code not in _DAMAGE_CODES):
                # sqlite3.connect opens lazily: a file it cannot open lands here, not above
                raise self._fail(path, f"cannot be opened for reading and writing ({access or e}). That is a "
                                       "permission or mount problem, not damage, and nothing was changed: check "
                                       "that the file, its -wal and -shm files and its directory belong to the "
                                       "broker's user and are writable, and that the volume is not mounted "
                                       "read-only, then start the broker again") from None
            raise self._fail(path, f"is not a readable SQLite database ({e}). If it is not the broker's "
                                   "state, point the broker at another path; if it is, restore it from a "
                                   "backup or move it aside to start with an empty state") from None
        except BaseException:
            conn.close()
            raise
        return conn

    def _refuse_orphaned_files(self, path: str) -> None:
        """A new state (no tables: the database was missing or empty) with bundle or block
        files beside it: those are a previous state's, whose database is gone. The sweeps at
        open would delete every one of them (no row names them), so the start stops here,
        before anything is written or deleted."""
        found = []
        try:
            bundles = bundlefiles.stored_files(path + "-bundles")
            rounds = blockfiles.stored_files(path + "-blocks")
        except OSError as e:
            raise self._fail(path, f"is a new, empty database, and the directories of its bundle and block files "
                                   f"cannot be listed ({e}); nothing was deleted. Check that they belong to the "
                                   "broker's user") from None
        if bundles:
            found.append(f"{len(bundles)} bundle file(s) in {path + '-bundles'!r}")
        if rounds:
            found.append(f"the summary block files of {len(rounds)} round(s) in {path + '-blocks'!r}")
        if found:
            raise self._fail(path, "is missing or empty (no tables: a new state), but " + " and ".join(found)
                             + " are there: the files of a previous state whose database is gone. Nothing was "
                               "deleted. Restore the database (with its -wal file, if any) from a backup beside "
                               "those directories (docs/deploy.md, State and backups); or, to start with an "
                               "empty state, move both directories aside (or point the broker at another path)")

    def _init_schema(self, conn: sqlite3.Connection, path: str) -> None:
        # 64 KiB pages for a new file (an existing one keeps its size): a publish is one blob
        # of a few hundred KiB, which 4 KiB pages split into ~80 overflow pages, each one
        # write to the WAL and, at checkpoints, one more to the file.
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() not in ("wal", "memory"):
            raise self._fail(path, f"SQLite could not switch it to WAL mode (journal_mode={mode}); "
                                   "put the state on a local filesystem")
        conn.execute("PRAGMA synchronous=FULL")
        # checkpoints run in a thread of their own (checkpointer.py), not inside a commit
        conn.execute(f"PRAGMA wal_autocheckpoint={safety_pages(conn.execute('PRAGMA page_size').fetchone()[0])}")
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                self._refuse_orphaned_files(path)
                self._fresh = True
                create(conn)
            elif "meta" not in tables:
                raise self._fail(path, f"is a SQLite database but not a graft-fed broker state (tables: "
                                       f"{', '.join(sorted(tables))}); point the broker at another path")
            else:
                # a write at once: a file SQLite could open only for reading (its mode, its
                # owner, a read-only mount) fails here, as a permission problem (_open), not
                # at the first write of the open's sweeps as the storage failing
                conn.execute("UPDATE meta SET value = value WHERE key = 'schema_version'")
                row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                version = row[0] if row else None
                if str(version).isdigit() and 1 <= int(version) < SCHEMA_VERSION:
                    migrate(conn, int(version))  # broker/sqlite_schema.py
                    version = SCHEMA_VERSION
                if str(version) != str(SCHEMA_VERSION):
                    newer = str(version).isdigit() and int(version) > SCHEMA_VERSION
                    raise self._fail(path, f"has schema version {version!r}, this graft-fed reads version "
                                           f"{SCHEMA_VERSION}. " + (
                                               "It was written by a newer graft-fed: upgrade graft-fed, or "
                                               "point the broker at a fresh state file." if newer else
                                               "Move the file aside to start with an empty state, or point "
                                               "the broker at another path."))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # ----- transactions
    def _storage_error(self, exc: sqlite3.Error, what: str) -> Exception:
        """The domain error for a failure of the database itself (not of a statement's input)."""
        if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL:
            log.error("broker state %s is full (%s): %s refused, nothing of it stored. Free disk space, or set "
                      "retention (keep_rounds, max_bundle_gib)", self.path, exc, what)
            return StorageFull("the broker's storage is full: nothing of this request was stored; retry later "
                               "(the operator must free disk space)")
        log.error("broker state %s failed during a %s: %s (%s)", self.path, what, exc,
                  getattr(exc, "sqlite_errorname", "?"))
        return Unavailable(f"the broker's storage failed during a {what}: retry later (details in the "
                           "broker's log)")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock: committed when the block ends, rolled back
        (and the exception re-raised) when it raises. A failure of the database itself (disk
        full, I/O error, corruption) is raised as StorageFull or Unavailable."""
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                if not _is_storage_failure(exc):
                    raise
                raise self._storage_error(exc, "write") from exc

    def _grouped(self, job: _Job) -> int:
        """Write the job in the next group commit and return how many summaries it stored,
        once the group is durable."""
        self._grouped_many([job])
        if job.error is not None:
            raise job.error
        return job.result

    def _grouped_many(self, jobs: list[_Job]) -> None:
        """Write the jobs in the next group commit; once it is durable, each job holds its
        result or error. The first caller to find no commit under way leads: it commits
        every job queued by then in one transaction, then hands the lead to the first job
        queued during that commit (so a leader's latency is one commit, however busy the
        broker). The jobs are queued together, so one commit takes all of them: the one
        that woke the caller's first job, or the caller's own when the lead came with it."""
        with self._group_mu:
            self._group.extend(jobs)
            lead = not self._group_leader
            self._group_leader = True
        if not lead:
            jobs[0].done.wait()
            if not jobs[0].lead:
                return
        with self._group_mu:
            batch, self._group = self._group, []
        try:
            self._commit_group(batch)
        finally:
            with self._group_mu:
                if self._group:
                    nxt = self._group[0]
                    nxt.lead = True
                    nxt.done.set()
                else:
                    self._group_leader = False
            for j in batch:
                j.done.set()

    def _commit_group(self, batch: list[_Job]) -> None:
        for j in batch:
            j.lead = False
            j.done.clear()
            j.result, j.attached, j.error, j.added = None, 0, None, []
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    try:
                        self._write_jobs(conn, batch)  # the whole group in a few statements
                    except Exception as exc:  # noqa: BLE001 - not a job's own failure: see below
                        if _storage_failed(exc):
                            raise
                        # Not expected (the callers checked and encoded their blocks): write the
                        # group again one job at a time, so that only a job that fails fails.
                        log.warning("broker state %s: a group commit of %d publishes failed (%s: %s); writing "
                                    "them one at a time", self.path, len(batch), type(exc).__name__, exc)
                        conn.execute("ROLLBACK")
                        conn.execute("BEGIN IMMEDIATE")
                        self._write_each(conn, batch)
                    conn.execute("COMMIT")
                    for j in batch:
                        if j.error is None:
                            for node, count in j.added:
                                self._held_by_node[node] += count
                            if j.bundle is not None and j.result and j.bundle[4]:
                                self._bundle_bytes_by_node[j.bundle[4]] += j.bundle[1]
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except BaseException as exc:
                err: BaseException = exc
                if isinstance(exc, sqlite3.Error) and _is_storage_failure(exc):
                    err = self._storage_error(exc, "write")
                for j in batch:  # nothing of the group was stored
                    j.result, j.error = None, err
                return
        self.group_commits += 1
        self.grouped_calls += len(batch)

    def _write_each(self, conn: sqlite3.Connection, batch: list[_Job]) -> None:
        """The group one job at a time, each in its own savepoint (rolled back alone when it fails)."""
        for j in batch:
            j.result, j.attached, j.error, j.added = None, 0, None, []
            conn.execute("SAVEPOINT grp")
            try:
                self._write_jobs(conn, [j])
            except Exception as exc:  # noqa: BLE001 - this caller's failure, re-raised to it
                if _storage_failed(exc):
                    raise
                j.result, j.error = None, exc
            if j.error is not None:
                conn.execute("ROLLBACK TO grp")
            conn.execute("RELEASE grp")

    def _read(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                if not _is_storage_failure(exc):
                    raise
                raise self._storage_error(exc, "read") from exc

    # ----- the federation the rows belong to (BrokerState.bind_manifest)
    def _state_name(self) -> str:
        return f"broker state {self.path!r}"

    def _stored_manifest(self) -> dict[str, Any] | None:
        rows = self._read("SELECT value FROM meta WHERE key = 'manifest'")
        if not rows:
            return None
        try:
            fields = json.loads(rows[0][0])
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            raise self._fail(self.path, f"its stored manifest is not readable ({str(rows[0][0])[:80]!r}); restore the "
                                        "database from a backup, or point the broker at another state file")
        return fields

    def _store_manifest(self, fields: dict[str, Any]) -> None:
        with self._tx() as conn:
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('manifest', ?)",
                         (json.dumps(fields, sort_keys=True),))

    def close(self) -> None:
        self.checkpointer.stop()
        self.files.close()
        with self._lock:
            self._conn.close()
            self.blocks.close()

    # ----- nodes
    @staticmethod
    def _node(r: tuple) -> NodeRow:
        return NodeRow(node_id=r[0], model_id=r[1], tokenizer_id=r[2], privacy=r[3], state=r[4],
                       session_id=r[5], round=r[6], last_seen=db2f(r[7]), published=r[8])

    @staticmethod
    def _write_node(conn: sqlite3.Connection, n: NodeRow) -> None:
        conn.execute(f"INSERT OR REPLACE INTO nodes ({_NODE_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                     (n.node_id, n.model_id, n.tokenizer_id, n.privacy, n.state, n.session_id, n.round,
                      f2db(n.last_seen), n.published))

    def upsert_node(self, node: NodeRow) -> None:
        n = norm_node(node)
        with self._tx() as conn:
            self._write_node(conn, n)

    def get_node(self, node_id: str) -> NodeRow | None:
        rows = self._read(f"SELECT {_NODE_COLS} FROM nodes WHERE node_id = ?", (as_str(node_id, "node_id"),))
        return self._node(rows[0]) if rows else None

    def list_nodes(self) -> list[NodeRow]:
        return [self._node(r) for r in self._read(f"SELECT {_NODE_COLS} FROM nodes ORDER BY node_id")]

    def node_secret(self, node_id: str) -> str:
        rows = self._read("SELECT secret_hash FROM node_secrets WHERE node_id = ?", (as_str(node_id, "node_id"),))
        return rows[0][0] if rows else ""

    def set_node_secret(self, node_id: str, secret_hash: str) -> None:
        node_id, secret_hash = as_str(node_id, "node_id"), as_str(secret_hash, "secret_hash")
        with self._tx() as conn:
            conn.execute("INSERT OR REPLACE INTO node_secrets (node_id, secret_hash) VALUES (?, ?)",
                         (node_id, secret_hash))

    def record_liveness(self, seen: Sequence[tuple[str, float]]) -> None:
        batch = [(f2db(as_float(t, "last_seen")), as_str(node_id, "node_id")) for node_id, t in seen]
        with self._tx() as conn:
            conn.executemany("UPDATE nodes SET last_seen = ? WHERE node_id = ? AND last_seen < ?",
                             [(t, node_id, t) for t, node_id in batch])

    # ----- rounds
    @staticmethod
    def _round(r: tuple) -> RoundRow:
        return RoundRow(round=r[0], state=r[1], opened_at=db2f(r[2]),
                        matched_at=None if r[3] is None else db2f(r[3]), participants=json.loads(r[4]))

    def put_round(self, row: RoundRow) -> None:
        r = norm_round(row)
        with self._tx() as conn:
            self._write_round(conn, r)

    @staticmethod
    def _write_round(conn: sqlite3.Connection, r: RoundRow) -> None:
        conn.execute("INSERT OR REPLACE INTO rounds (round, state, opened_at, matched_at, participants) "
                     "VALUES (?,?,?,?,?)",
                     (r.round, r.state, f2db(r.opened_at), None if r.matched_at is None else f2db(r.matched_at),
                      json.dumps(r.participants)))

    def get_round(self, round: int) -> RoundRow | None:
        rows = self._read("SELECT round, state, opened_at, matched_at, participants FROM rounds WHERE round = ?",
                          (as_int(round, "round"),))
        return self._round(rows[0]) if rows else None

    def latest_round(self) -> int:
        (latest,), = self._read("SELECT MAX(round) FROM rounds")
        return -1 if latest is None else latest

    # ----- summaries (one block per publish: federation/summaryblock.py)
    def _held_ids(self, conn: sqlite3.Connection, node_id: str, round: int) -> tuple[set[str], int]:
        """(prompt ids the node holds in `round`, the next block's seq)."""
        held: set[str] = set()
        seq = 0
        for s_, *stored in conn.execute(f"SELECT seq, {_BLOCK_BYTES} FROM summary_blocks WHERE node_id = ? AND "
                                        "round = ?", (node_id, round)).fetchall():
            held.update(SummaryBlock.header(self._block_data(node_id, round, *stored))[0]["prompt_ids"])
            seq = max(seq, s_ + 1)
        return held, seq

    def _held_many(self, conn: sqlite3.Connection, keys: Iterable[tuple[str, int]]
                   ) -> dict[tuple[str, int], tuple[tuple[list[str], ...], int] | Exception]:
        """What `_held_ids` answers, for many (node, round)s in one statement: (node, round) ->
        (the prompt ids of each block held, the next block's seq), or the error decoding a
        stored block raised (a damaged block fails the writes of its own node and round
        only). A key holding nothing is absent."""
        keys = list(keys)
        out: dict[tuple[str, int], tuple[tuple[list[str], ...], int] | Exception] = {}
        for lo, hi in _spans(len(keys), _MAX_PARAMS // 2):
            part = keys[lo:hi]
            rows = conn.execute("SELECT b.node_id, b.round, b.seq, b.data, b.file_offset, b.file_length, b.file_crc "
                                "FROM (VALUES "
                                + ",".join(["(?,?)"] * len(part)) + ") AS k JOIN summary_blocks b "
                                "ON b.node_id = k.column1 AND b.round = k.column2",
                                [x for key in part for x in key]).fetchall()
            for node_id, round, seq, *stored in rows:
                key = (node_id, round)
                got = out.get(key)
                if isinstance(got, Exception):
                    continue
                try:
                    ids = SummaryBlock.header(self._block_data(node_id, round, *stored))[0]["prompt_ids"]
                except Exception as exc:  # noqa: BLE001 - SummaryBlockError, a header without ids
                    out[key] = exc
                    continue
                parts, nxt = got if got is not None else ((), 0)
                out[key] = (parts + (list(ids),), max(nxt, seq + 1))
        return out

    @staticmethod
    def _plan(job: _Job, held: dict[tuple[str, int], tuple[tuple[list[str], ...], int] | Exception]
              ) -> tuple[list[tuple], list[tuple], int]:
        """(summary_blocks rows, summary_digests rows, summaries stored) of one job, given what
        is held; `held` is updated only when the whole job plans (it then holds the job's
        summaries too). First write wins: summaries already held are dropped."""
        mine: dict[tuple[str, int], tuple[tuple[list[str], ...], int]] = {}
        rows: list[tuple] = []
        digests: list[tuple] = []
        accepted = 0
        for block, data in zip(job.blocks, job.encoded):
            if not len(block):
                continue
            key = (block.node_id, block.round)
            got = mine.get(key) or held.get(key)
            if isinstance(got, Exception):
                raise got
            parts, seq = got if got is not None else ((), 0)
            if parts:  # (a set of the held ids only then: most blocks are their round's first)
                ids = set().union(*parts)
                keep = np.fromiter((pid not in ids for pid in block.prompt_ids), dtype=bool, count=len(block))
                if not keep.all():
                    block, data = block.select(keep), None
                    if not len(block):
                        continue
            mine[key] = (parts + (block.prompt_ids,), seq + 1)
            rows.append((block.node_id, block.round, seq, len(block), block.to_parts() if data is None else data))
            if block.digests is not None:
                digests.extend((block.node_id, block.round, pid, d) for pid, d in zip(block.prompt_ids, block.digests)
                               if d)
            accepted += len(block)
        held.update(mine)
        return rows, digests, accepted

    @staticmethod
    def _insert_many(conn: sqlite3.Connection, head: str, width: int, rows: list[tuple]) -> None:
        """Multi-row INSERTs (`head` ends with VALUES) of at most _MAX_PARAMS parameters, of
        a few row counts only (_spans)."""
        one = "(" + ",".join("?" * width) + ")"
        for lo, hi in _spans(len(rows), max(1, _MAX_PARAMS // width)):
            part = rows[lo:hi]
            conn.execute(head + ",".join([one] * len(part)), [x for r in part for x in r])

    def _write_jobs(self, conn: sqlite3.Connection, jobs: list[_Job]) -> None:
        """The jobs' blocks and node rows, in three statements for all of them (one read, two
        multi-row INSERTs; a fourth for bundle digests, which publishes do not carry). A job
        that fails to plan gets its error and writes nothing; the others' results are set."""
        held = self._held_many(conn, {(b.node_id, b.round) for j in jobs for b in j.blocks if len(b)}
                               | {j.attach[:2] for j in jobs if j.attach is not None})
        blocks: list[tuple] = []
        digests: list[tuple] = []
        nodes: list[tuple] = []
        for j in jobs:
            got = None if j.attach is None else held.get(j.attach[:2])
            if isinstance(got, Exception):  # a damaged block of the summary's node and round: nothing
                j.error = got
                continue
            attached = int(j.attach is not None and got is not None and any(j.attach[2] in ids for ids in got[0]))
            if j.bundle is not None and j.attach is not None and not attached:
                # its summary is gone (retention dropped the round while the bytes arrived):
                # no grant could reach the bundle, which would only count against its uploader
                j.result, j.attached = 0, 0
                continue
            if j.bundle is not None:
                cur = conn.execute("INSERT INTO bundles (digest, data, size, created, signature, signer_cert, parts, "
                                   "in_file, node_id) VALUES (?, x'', ?, ?, ?, ?, 0, 1, ?) ON CONFLICT (digest) DO NOTHING",
                                   (j.bundle[0], j.bundle[1], time.time(), j.bundle[2], j.bundle[3], j.bundle[4]))
                j.result = int(cur.rowcount == 1)  # 0: another upload of the digest won (same bytes)
                if j.attach is None:
                    continue
            if j.attach is not None:
                if attached:  # written after the group's blocks, which may hold its summary
                    digests.append(j.attach)
                if j.bundle is None:
                    j.result = attached
                else:
                    j.attached = attached
                continue
            try:
                rows, dg, accepted = self._plan(j, held)
            except Exception as exc:  # noqa: BLE001 - this caller's failure, re-raised to it
                j.error = exc
                continue
            blocks += rows
            digests += dg
            j.added = [(r[0], r[3]) for r in rows]
            if j.node is not None:
                n = j.node
                nodes.append((n.node_id, n.model_id, n.tokenizer_id, n.privacy, n.state, n.session_id, n.round,
                              f2db(n.last_seen), n.published + accepted))
            j.result = accepted
        if blocks:
            # the bytes into their rounds' files, durable before the rows naming them commit
            where = self.blocks.append([(b[1], b[4]) for b in blocks])
            self._insert_many(conn, "INSERT INTO summary_blocks (node_id, round, seq, count, data, file_offset, "
                              "file_length, file_crc) VALUES ", 8,
                              [(*b[:4], b"", *loc) for b, loc in zip(blocks, where)])
        if digests:
            self._insert_many(conn, "INSERT OR REPLACE INTO summary_digests (node_id, round, prompt_id, digest) VALUES ",
                              4, digests)
        if nodes:  # in the group's order: a node's last row wins, as one write after another would
            self._insert_many(conn, f"INSERT OR REPLACE INTO nodes ({_NODE_COLS}) VALUES ", 9, nodes)

    @staticmethod
    def _first_of_each(block: SummaryBlock) -> SummaryBlock:
        """The block without repeated prompt ids (first wins), by its caller's thread."""
        facts = facts_of(block.prompt_ids)
        if facts is not None and facts.get("unique"):  # an interned list known to be (publishing.py)
            return block
        if len(set(block.prompt_ids)) == len(block):
            if facts is not None:
                facts["unique"] = True
            return block
        seen: set[str] = set()
        keep = np.zeros(len(block), dtype=bool)
        for i, pid in enumerate(block.prompt_ids):
            if pid not in seen:
                seen.add(pid)
                keep[i] = True
        return block.select(keep)

    def put_summaries(self, rows: Sequence[SummaryRow], node: NodeRow | None = None) -> tuple[int, int]:
        batch = [norm_summary(r) for r in rows]
        return self._put_blocks([SummaryBlock.from_rows(g) for g in group_rows(batch)], len(batch), node)

    def put_summary_block(self, block: SummaryBlock, node: NodeRow | None = None) -> tuple[int, int]:
        block = norm_block(block)
        return self._put_blocks([block], len(block), node)

    def put_summary_blocks(self, items: Sequence[tuple[SummaryBlock, NodeRow | None]]
                           ) -> list[tuple[int, int] | Exception]:
        """The publishes in one group commit (one transaction, one fsync) with whatever else
        is queued for it; each its own result or exception, as `_write_each` leaves them."""
        out: list[tuple[int, int] | Exception] = []
        jobs: list[tuple[int, int, _Job]] = []
        for block, node in items:
            try:
                block = norm_block(block)
                jobs.append((len(out), len(block), self._job([block], node)))
                out.append((0, 0))
            except Exception as exc:  # noqa: BLE001 - a malformed block fails alone
                out.append(exc)
        if jobs:
            self._grouped_many([job for _, _, job in jobs])
        for i, total, job in jobs:
            out[i] = job.error if job.error is not None else (job.result, total - job.result)
        return out

    def _job(self, blocks: list[SummaryBlock], node: NodeRow | None) -> _Job:
        n = None if node is None else norm_node(node)
        # deduplicated and encoded here, by the publishing thread, rather than inside the
        # group commit's transaction, which every publish of the group waits for
        blocks = [self._first_of_each(b) for b in blocks]
        return _Job(blocks, [b.to_parts() for b in blocks], n)  # written by pwritev, never joined

    def _put_blocks(self, blocks: list[SummaryBlock], total: int, node: NodeRow | None) -> tuple[int, int]:
        accepted = self._grouped(self._job(blocks, node))
        return accepted, total - accepted

    @staticmethod
    def _block_where(round: int | None, node_id: str | None, min_round: int | None) -> tuple[str, list[Any]]:
        where, params = [], []
        for column, op, value in (("round", "=", opt_int(round, "round")),
                                  ("node_id", "=", opt_str(node_id, "node_id")),
                                  ("round", ">=", opt_int(min_round, "min_round"))):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        return (" WHERE " + " AND ".join(where) if where else ""), params

    def _blocks_and_digests(self, round: int | None, node_id: str | None, min_round: int | None
                            ) -> tuple[list[tuple], dict[tuple[str, int], dict[str, str]]]:
        where, params = self._block_where(round, node_id, min_round)
        with self._lock:
            blocks = []
            for nid, rnd, *stored in self._read(f"SELECT node_id, round, {_BLOCK_BYTES} FROM summary_blocks{where} "
                                                "ORDER BY round, node_id, seq", params):
                try:
                    blocks.append((nid, rnd, self._block_data(nid, rnd, *stored)))
                except SummaryBlockError as exc:
                    self._damaged(exc, node_id)
            digests: dict[tuple[str, int], dict[str, str]] = {}
            for nid, rnd, pid, d in self._read(f"SELECT node_id, round, prompt_id, digest FROM summary_digests{where}",
                                               params):
                digests.setdefault((nid, rnd), {})[pid] = d
        return blocks, digests

    def _damaged(self, exc: SummaryBlockError, node_id: str | None) -> None:
        """A stored block that no longer reads: raised where the read is of one node (its own
        round fails, as its writes do); skipped, with an error in the log (once per state and
        block), where the read spans nodes, so that one damaged publish does not fail every
        node's matching of its round (as if that node had not published it)."""
        if node_id is not None:
            raise exc
        key = str(exc)
        if key not in self._damage_logged:
            self._damage_logged.add(key)
            log.error("broker state %s: %s; reads across nodes skip it (as if it had not been published). Restore "
                      "the blocks directory from a backup taken after the database's, or let retention drop the "
                      "round", self.path, exc)

    def _decoded(self, blocks: list[tuple], node_id: str | None, decode: Callable[[bytes], Any]
                 ) -> Iterator[tuple[str, int, Any]]:
        for nid, rnd, data in blocks:
            try:
                got = decode(data)
            except SummaryBlockError as exc:
                self._damaged(exc, node_id)
                continue
            yield nid, rnd, got

    def summaries(self, round: int | None = None, node_id: str | None = None,
                  prompt_ids: Iterable[str] | None = None, min_round: int | None = None) -> list[SummaryRow]:
        wanted = norm_prompt_ids(prompt_ids)
        blocks, digests = self._blocks_and_digests(round, node_id, min_round)
        if wanted is not None and not wanted:
            return []
        wanted_set = None if wanted is None else set(wanted)
        out: list[SummaryRow] = []
        for nid, rnd, block in self._decoded(blocks, node_id, SummaryBlock.from_bytes):
            out.extend(block.rows(digests.get((nid, rnd), {}), wanted_set))
        out.sort(key=summary_key)
        return out

    def summary_heads(self, round: int | None = None, node_id: str | None = None,
                      prompt_ids: Iterable[str] | None = None, min_round: int | None = None) -> list[SummaryHead]:
        wanted = norm_prompt_ids(prompt_ids)
        blocks, digests = self._blocks_and_digests(round, node_id, min_round)
        if wanted is not None and not wanted:
            return []
        wanted_set = None if wanted is None else set(wanted)
        out: list[SummaryHead] = []
        for nid, rnd, (pids, n, k) in self._decoded(blocks, node_id, SummaryBlock.heads_of):
            dg = digests.get((nid, rnd), {})
            out.extend(SummaryHead(nid, rnd, pid, nn, kk, dg.get(pid, ""))
                       for pid, nn, kk in zip(pids, n.tolist(), k.tolist())
                       if wanted_set is None or pid in wanted_set)
        out.sort(key=lambda h: (h.round, h.node_id, h.prompt_id))
        return out

    def set_bundle_digest(self, node_id: str, round: int, prompt_id: str, digest: str) -> bool:
        key = (as_str(node_id, "node_id"), as_int(round, "round"), as_str(prompt_id, "prompt_id"),
               as_str(digest, "digest"))
        if key[3]:  # an upload's: in the next group commit, with the other uploads' and publishes'
            return bool(self._grouped(_Job([], [], None, attach=key)))
        with self._tx() as conn:  # "" detaches
            if key[2] not in self._held_ids(conn, key[0], key[1])[0]:
                return False
            conn.execute("DELETE FROM summary_digests WHERE node_id = ? AND round = ? AND prompt_id = ?", key[:3])
            return True

    # ----- matches
    def put_matches(self, rows: Sequence[MatchRow]) -> None:
        batch = [norm_match(r) for r in rows]
        with self._tx() as conn:
            conn.executemany(f"INSERT INTO matches ({_MATCH_COLS}) VALUES (?,?,?,?,?) "
                             "ON CONFLICT (round, receiver, prompt_id) DO NOTHING",
                             [(m.round, m.receiver, m.prompt_id, m.source, m.source_round) for m in batch])

    def matches(self, round: int | None = None, receiver: str | None = None,
                source: str | None = None) -> list[MatchRow]:
        where, params = _filter(round, receiver, source)
        return [MatchRow(*r) for r in self._read(f"SELECT {_MATCH_COLS} FROM matches{where} "
                                                 "ORDER BY round, receiver, prompt_id", params)]

    def has_matches(self, round: int) -> bool:
        return bool(self._read("SELECT 1 FROM matches WHERE round = ? LIMIT 1", (as_int(round, "round"),)))

    def put_match_set(self, round: int, data: bytes, round_row: RoundRow | None = None) -> bool:
        round, blob = as_int(round, "round"), norm_blob(data, "match set")
        new = None if round_row is None else norm_round(round_row)
        with self._tx() as conn:
            cur = conn.execute("INSERT INTO match_sets (round, data) VALUES (?, ?) ON CONFLICT (round) DO NOTHING",
                               (round, blob))
            if cur.rowcount == 1 and new is not None:
                self._write_round(conn, new)
            return cur.rowcount == 1

    def match_set(self, round: int) -> bytes | None:
        rows = self._read("SELECT data FROM match_sets WHERE round = ?", (as_int(round, "round"),))
        return bytes(rows[0][0]) if rows else None

    def match_set_rounds(self) -> list[int]:
        return [r[0] for r in self._read("SELECT round FROM match_sets ORDER BY round")]

    # ----- bundles
    def begin_bundle(self) -> BundleWriter:
        return _FileWriter(self)

    def _claim(self, digest: str) -> None:
        """An upload is about to put its file under `digest`'s name: retention leaves that file
        alone until the upload's row is committed or given up (`_release`)."""
        with self._lock:
            self._sealing[digest] = self._sealing.get(digest, 0) + 1

    def _release(self, digest: str, stored: bool) -> None:
        """The end of an upload's claim on `digest`'s file. One that stored nothing (a failure,
        a refusal, a duplicate) deletes the file unless a row names it or another upload of
        the digest is under way; should the state not say, the next open's sweep does."""
        with self._lock:
            self._sealing[digest] -= 1
            if not self._sealing[digest]:
                del self._sealing[digest]
            if digest in self._sealing:
                return
            # also after a store: retention may have dropped the row since (it leaves the
            # files of claimed digests alone), and then nothing else deletes the file
            try:
                named = self._names_file(digest)
            except Exception:  # noqa: BLE001 - the state failed: leave the file to the sweep at open
                return
            if not named:
                self.files.remove([digest])

    def _names_file(self, digest: str) -> bool:
        """Whether a row names `digest`'s file (under the lock, or racing the writers)."""
        return self.bundle_file(digest) is not None

    def _insert_file_row(self, digest: str, size: int, signature: bytes, signer_cert: bytes,
                         attach: tuple[str, int, str] | None = None, node_id: str = "") -> tuple[bool, bool]:
        """The row of a bundle whose file is in place, uploaded by `node_id` (or, with
        `attach` (node, round, prompt id), by that node, its digest attached to that summary),
        in the next group commit: (stored, attached)."""
        owner = attach[0] if attach is not None else node_id
        job = _Job([], [], None, bundle=(digest, size, signature, signer_cert, owner),
                   attach=None if attach is None else (*attach, digest))
        self._grouped(job)
        return bool(job.result), bool(job.attached)

    def put_bundle(self, digest: str, data: bytes, signature: bytes = b"", signer_cert: bytes = b"",
                   node_id: str = "") -> bool:
        digest, blob = as_str(digest, "digest"), norm_bytes(data)
        sig, cert = norm_blob(signature, "signature"), norm_blob(signer_cert, "signer_cert")
        writer = self.begin_bundle()
        try:
            writer.write(blob)
            return writer.commit(digest, sig, cert, node_id=node_id)
        finally:
            writer.abort()  # a no-op once committed

    def bundle_provenance(self, digest: str) -> tuple[bytes, bytes] | None:
        rows = self._read("SELECT signature, signer_cert FROM bundles WHERE digest = ?", (as_str(digest, "digest"),))
        return (bytes(rows[0][0]), bytes(rows[0][1])) if rows else None

    def _damaged_file(self, digest: str, what: str) -> Exception:
        """A bundle whose file is gone or short cannot be served, now or on a retry: NOT_FOUND,
        which a node takes as that offer's failure (it skips the offer). UNAVAILABLE, as for a
        failing read, made the node drop the whole step's exchange and join again."""
        log.error("broker state %s: bundle %s %s in %s (a damaged volume?); it is dropped at the next start",
                  self.path, digest[:16], what, self.files.path)
        return NotFound(f"bundle {digest[:12]}... cannot be served: the broker's copy is damaged (its operator is "
                        "told in the broker's log)")

    def bundle_file_error(self, digest: str, outcome: str, reason: str = "") -> Exception:
        if outcome == "missing":
            if self.bundle_file(digest) is None:  # retention deletes the row, then the file
                return NotFound(f"no bundle {digest[:12]}... (pruned by retention while it was being fetched)")
            return self._damaged_file(digest, "has a row but no file")
        if outcome == "short":
            return self._damaged_file(digest, "has a file shorter than its row says")
        log.error("broker state %s: the file of bundle %s in %s could not be read: %s", self.path, digest[:16],
                  self.files.path, reason)
        return Unavailable(_READ_FAILED)

    def _open_file(self, digest: str) -> tuple[int, int] | None:
        """(descriptor, size) of a bundle whose bytes are a file; None when it is not held.
        Under the lock, as retention deletes rows and then their files."""
        with self._lock:
            where = self.bundle_file(digest)
            if where is None:
                return None
            fd = self.files.open(digest)
            if fd is None:
                raise self._damaged_file(digest, "has a row but no file")
            return fd, where[1]

    def _file_chunks(self, digest: str, fd: int, start: int, end: int, chunk: int) -> Iterator[bytes]:
        """Bytes [start, end) of a bundle's file (within its row's size) in chunks of at most
        `chunk` (one empty chunk when there are none), from descriptor `fd`, which it closes.
        The descriptor is held by a file object made now, before the generator runs, so it is
        closed with the iterator even if that is never started (a generator's code, and so its
        `finally`, runs only once it is)."""
        f = open(fd, "rb", buffering=0)

        def chunks() -> Iterator[bytes]:
            with f:
                if start == end:
                    yield b""
                offset = start
                while offset < end:
                    try:
                        piece = os.pread(f.fileno(), min(chunk, end - offset), offset)
                    except OSError as exc:
                        raise storage_error(self.files.path, exc, "read") from exc
                    if not piece:
                        raise self._damaged_file(digest, "has a file shorter than its row says")
                    offset += len(piece)
                    yield piece
        return chunks()

    def get_bundle(self, digest: str) -> bytes | None:
        digest = as_str(digest, "digest")
        opened = self._open_file(digest)
        if opened is not None:
            return b"".join(self._file_chunks(digest, opened[0], 0, opened[1], 1 << 24))
        with self._lock:
            rows = self._read("SELECT data, parts FROM bundles WHERE digest = ? AND in_file = 0", (digest,))
            if not rows or not rows[0][1]:
                return bytes(rows[0][0]) if rows else None
            return b"".join(r[0] for r in self._read("SELECT data FROM bundle_parts WHERE parts = ? ORDER BY id",
                                                     (rows[0][1],)))

    @staticmethod
    def _pieces(conn: sqlite3.Connection, digest: str) -> tuple[int, list[tuple[str, int, int]]] | None:
        """(size, [(table, rowid, bytes)]) of a bundle held in the database (schema 4 and
        before): where its bytes lie, in order."""
        row = conn.execute("SELECT rowid, size, parts FROM bundles WHERE digest = ? AND in_file = 0",
                           (digest,)).fetchone()
        if row is None:
            return None
        if not row[2]:
            return row[1], [("bundles", row[0], row[1])]
        return row[1], [("bundle_parts", i, n) for i, n in conn.execute(
            "SELECT id, length(data) FROM bundle_parts WHERE parts = ? ORDER BY id", (row[2],))]

    def read_bundle(self, digest: str, offset: int, length: int) -> bytes | None:
        digest, offset, length = as_str(digest, "digest"), as_int(offset, "offset"), as_int(length, "length")
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        opened = self._open_file(digest)
        if opened is not None:
            fd, size = opened
            start = min(offset, size)
            return b"".join(self._file_chunks(digest, fd, start, min(size, start + length), 1 << 24))
        with self._lock:
            try:  # incremental blob I/O: only the chunk's pages are read, never the whole bundle
                found = self._pieces(self._conn, digest)
                if found is None:
                    return None
                out, start = [], 0
                for table, rowid, n in found[1]:
                    lo, hi = max(offset, start), min(offset + length, start + n)
                    if lo < hi:
                        with self._conn.blobopen(table, "data", rowid, readonly=True) as blob:
                            blob.seek(lo - start)
                            out.append(blob.read(hi - lo))
                    start += n
                return b"".join(out)
            except sqlite3.Error as exc:
                if not _is_storage_failure(exc):
                    raise
                raise self._storage_error(exc, "read") from exc

    def bundle_file(self, digest: str) -> tuple[str, int] | None:
        digest = as_str(digest, "digest")
        rows = self._read("SELECT size FROM bundles WHERE digest = ? AND in_file = 1", (digest,))
        return (self.files.file(digest), int(rows[0][0])) if rows else None

    def iter_bundle(self, digest: str, chunk: int) -> Iterator[bytes] | None:
        """A bundle whose bytes are a file: read from a descriptor opened now (the file stays
        readable to it if retention deletes it meanwhile), never taking the state's lock again.
        One held in the database: one read-only connection of its own per iteration, reading
        through one blob handle per stored piece (a handle walks its piece's overflow pages
        once; a new handle per chunk would walk them from the start every time), all in one
        snapshot (WAL). A piece no larger than `chunk` (an upload's chunk, as it was stored)
        goes out as it is."""
        digest, chunk = as_str(digest, "digest"), as_int(chunk, "chunk")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        opened = self._open_file(digest)
        if opened is not None:
            return self._file_chunks(digest, opened[0], 0, opened[1], chunk)
        try:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False, timeout=30.0)
        except sqlite3.Error as exc:
            raise self._storage_error(exc, "read") from exc
        try:
            conn.execute("BEGIN")  # one snapshot for the whole bundle
            found = self._pieces(conn, digest)
        except sqlite3.Error as exc:
            conn.close()
            if not _is_storage_failure(exc):
                raise
            raise self._storage_error(exc, "read") from exc
        if found is None:
            conn.close()
            return None
        size, pieces = found

        def chunks() -> Iterator[bytes]:
            try:
                if not size:
                    yield b""
                for table, rowid, n in pieces:
                    with conn.blobopen(table, "data", rowid, readonly=True) as blob:
                        for _ in range(0, n, chunk):
                            yield blob.read(chunk)
            finally:
                conn.close()
        return chunks()

    def bundle_held_at_open(self, digest: str) -> bool:
        rows = self._read("SELECT rowid FROM bundles WHERE digest = ?", (as_str(digest, "digest"),))
        return bool(rows) and int(rows[0][0]) <= self._bundle_rowid_at_open

    def bundle_size(self, digest: str) -> int | None:
        rows = self._read("SELECT size FROM bundles WHERE digest = ?", (as_str(digest, "digest"),))
        return int(rows[0][0]) if rows else None

    def has_bundles(self, digests: Sequence[str]) -> list[str]:
        wanted = norm_digests(digests)
        if not wanted:
            return []
        held = {r[0] for r in self._read("SELECT digest FROM bundles WHERE digest IN "
                                         "(SELECT value FROM json_each(?))", (json.dumps(wanted),))}
        return [d for d in wanted if d in held]

    def summaries_held(self, node_id: str) -> int:
        return self._held_by_node.get(node_id, 0)

    def bundle_bytes_held(self, node_id: str) -> int:
        return self._bundle_bytes_by_node.get(node_id, 0)

    def bundle_stats(self) -> tuple[int, int]:
        (count, total), = self._read("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM bundles")
        return count, total

    # ----- compatibility
    @staticmethod
    def _compat(r: tuple) -> CompatRow:
        return CompatRow(source=r[0], receiver=r[1], groups=r[2], mean_s=db2f(r[3]),
                         admitted_fraction=db2f(r[4]), rejected=r[5], undelivered=r[6])

    @classmethod
    def _compat_of(cls, conn: sqlite3.Connection, pair: tuple[str, str]) -> CompatRow | None:
        r = conn.execute(f"SELECT {_COMPAT_COLS} FROM compat WHERE source = ? AND receiver = ?", pair).fetchone()
        return None if r is None else cls._compat(r)

    @staticmethod
    def _put_compat(conn: sqlite3.Connection, row: CompatRow) -> None:
        conn.execute(f"INSERT OR REPLACE INTO compat ({_COMPAT_COLS}) VALUES (?,?,?,?,?,?,?)",
                     (row.source, row.receiver, row.groups, f2db(row.mean_s), f2db(row.admitted_fraction),
                      row.rejected, row.undelivered))

    def update_compat(self, source: str, receiver: str, mean_s: float, admitted_fraction: float,
                      rejected: bool) -> None:
        args = norm_compat_args(source, receiver, mean_s, admitted_fraction, rejected)
        with self._tx() as conn:
            self._put_compat(conn, fold_compat(self._compat_of(conn, args[:2]), *args[:2], (args[2:],)))

    def compat(self, pairs: Iterable[tuple[str, str]] | None = None) -> list[CompatRow]:
        if pairs is None:
            return [self._compat(r) for r in self._read(f"SELECT {_COMPAT_COLS} FROM compat ORDER BY source, receiver")]
        # one point read per pair on the primary key (a report names at most a round's prompts)
        return [self._compat(r) for pair in sorted(set(norm_pairs(pairs)))
                for r in self._read(f"SELECT {_COMPAT_COLS} FROM compat WHERE source = ? AND receiver = ?", pair)]

    def put_report_batches(self, batches: Sequence[Sequence[ReportRow]]) -> list[tuple[int, int]]:
        normed = [report_segments(rows) for rows in batches]  # checked, as columns (state_rows)
        out = []
        with self._tx() as conn:
            for segments in normed:
                out.append(self._put_reports(conn, segments))
        return out

    def _put_reports(self, conn: sqlite3.Connection, segments: list[ReportSegment]) -> tuple[int, int]:
        """One batch inside the caller's transaction, as runs of one (round, receiver). Which
        reports are new is read once per (round, receiver) from its block; the new ones are
        added to it (broker/reportblock.py), and each pair's row is read and written once,
        folded over its new reports in the batch's order (the same numbers as folding one
        report at a time). A report of 4,096 groups used to cost three statements a group,
        then two B-tree inserts a group; its columns go from the wire to the block without
        an object per group (issue 13)."""
        held: dict[tuple[int, str], ReportColumns] = {}  # each block's columns, the new reports added
        seen: dict[tuple[int, str], set[tuple[str, str]]] = {}  # (source, prompt id)s in each block
        changed: dict[tuple[int, str], None] = {}  # the blocks to write, in order
        per_pair: dict[tuple[str, str], list[tuple[float, float, bool, bool]]] = {}
        accepted = total = 0
        for rnd, receiver, cols in segments:
            if not cols.sources:  # nothing to add: no block read
                continue
            key = (rnd, receiver)
            if key not in held:
                row = conn.execute("SELECT data FROM report_blocks WHERE round = ? AND receiver = ?",
                                   key).fetchone()
                held[key] = ReportColumns.empty() if row is None else self._report_block(rnd, receiver, row[0])
                seen[key] = set(zip(held[key].sources, held[key].prompt_ids))
            mine, keys = seen[key], list(zip(cols.sources, cols.prompt_ids))
            total += len(keys)
            distinct = set(keys)
            if len(distinct) == len(keys) and mine.isdisjoint(distinct):  # every group new (a report's usual case)
                mine |= distinct
                new = cols
            else:  # the first of the batch wins too
                pick = [i for i, k in enumerate(keys) if k not in mine and not mine.add(k)]
                new = ReportColumns(*([col[i] for i in pick] for col in cols))
            if not new.sources:
                continue
            changed[key] = None
            for col, more in zip(held[key], new):
                col.extend(more)
            accepted += len(new.sources)
            for source, m, a, rej, und in zip(new.sources, new.mean_s, new.admitted_fraction, new.rejected,
                                              new.undelivered):
                per_pair.setdefault((source, receiver), []).append((m, a, rej, und))
        # one block per (round, receiver): a report after the first rewrites it whole, so a
        # report reads one block however many came before (a receiver sending a report per
        # group made each one decode every block before it: quadratic, under the lock)
        conn.executemany("INSERT OR REPLACE INTO report_blocks (round, receiver, count, data) VALUES (?,?,?,?)",
                         [(*key, len(held[key].sources), encode_report_columns(held[key])) for key in changed])
        for pair, folded in per_pair.items():
            self._put_compat(conn, fold_compat(self._compat_of(conn, pair), *pair, folded))
        return accepted, total - accepted

    def _report_block(self, rnd: int, receiver: str, data: bytes) -> ReportColumns:
        """A stored block's entries, as columns; a damaged one is logged and reads as empty
        (its reports are lost: a receiver's report of those groups again would count, and the
        block is written again without them)."""
        try:
            return decode_report_columns(data)
        except ValueError as exc:
            log.error("broker state %s: the reports of %s for round %d are damaged (%s) and are skipped",
                      self.path, receiver, rnd, exc)
            return ReportColumns.empty()

    def reports(self, round: int | None = None, receiver: str | None = None,
                source: str | None = None) -> list[ReportRow]:
        where, params = _filter(round, receiver, None)
        source = opt_str(source, "source")
        out = [ReportRow(round=rnd, receiver=recv, source=e[0], prompt_id=e[1], mean_s=e[2], admitted_fraction=e[3],
                         rejected=e[4], undelivered=e[5])
               for rnd, recv, data in self._read(f"SELECT round, receiver, data FROM report_blocks{where}", params)
               for e in zip(*self._report_block(rnd, recv, data)) if source is None or e[0] == source]
        out.sort(key=lambda r: (r.round, r.receiver, r.source, r.prompt_id))
        return out

    # ----- retention
    def prune(self, keep_rounds: int | None = None, max_bundle_bytes: int | None = None) -> int:
        check_prune_args(keep_rounds, max_bundle_bytes)
        removed, files, gone, freed = 0, [], {}, Counter()
        with self._lock:
            with self._tx() as conn:
                (latest,), = conn.execute("SELECT MAX(round) FROM rounds").fetchall()
                cutoff = prune_cutoff(-1 if latest is None else latest, keep_rounds)
                if cutoff is not None:
                    gone = {node: int(n) for node, n in conn.execute(
                        "SELECT node_id, SUM(count) FROM summary_blocks WHERE round < ? GROUP BY node_id", (cutoff,))}
                    held = sum(gone.values())
                    named = json.dumps([r[0] for r in conn.execute(
                        "SELECT DISTINCT digest FROM summary_digests WHERE round < ?", (cutoff,))])
                    conn.execute("DELETE FROM summary_blocks WHERE round < ?", (cutoff,))
                    conn.execute("DELETE FROM summary_digests WHERE round < ?", (cutoff,))
                    removed += held  # summaries, as the other tables count rows
                    (reports,), = conn.execute("SELECT COALESCE(SUM(count), 0) FROM report_blocks WHERE round < ?",
                                               (cutoff,)).fetchall()
                    conn.execute("DELETE FROM report_blocks WHERE round < ?", (cutoff,))
                    removed += reports  # the reports, not their blocks, as the summaries
                    for table in ("matches", "match_sets", "rounds"):
                        removed += conn.execute(f"DELETE FROM {table} WHERE round < ?", (cutoff,)).rowcount
                    # the bundles only those rounds' summaries named: no grant can reach them any
                    # more, and they count against their uploaders' quotas
                    orphans = [r[0] for r in conn.execute(
                        "SELECT value FROM json_each(?) WHERE NOT EXISTS (SELECT 1 FROM summary_digests s WHERE "
                        "s.digest = value) AND EXISTS (SELECT 1 FROM bundles b WHERE b.digest = value)", (named,))]
                    if orphans:
                        dropped, files, by_node = self._drop_bundles(conn, orphans)
                        removed += dropped
                        freed.update(by_node)
                if max_bundle_bytes is not None:
                    drop = bundles_to_drop(conn.execute("SELECT digest, size FROM bundles ORDER BY rowid").fetchall(),
                                           max_bundle_bytes)
                    if drop:
                        dropped, more_files, by_node = self._drop_bundles(conn, drop)
                        removed += dropped
                        files += more_files
                        freed.update(by_node)
            # committed: the quotas' counts follow
            lower_counts(self._held_by_node, gone)
            lower_counts(self._bundle_bytes_by_node, freed)
            if cutoff is not None:  # the files after their rows (a crash between: the sweep at open deletes them)
                self.blocks.remove_below(cutoff)
        # the files after their rows (a crash between leaves files no row names: deleted at
        # the next open), each under the lock, but not the file of a digest an upload has
        # claimed since (its row is about to name it again) or stored since (its row names it:
        # uploads commit in group commits that do not wait for retention)
        for d in files:
            with self._lock:
                try:
                    named = d in self._sealing or self._names_file(d)
                except Exception:  # noqa: BLE001 - the state failed after the drop: the sweep at open deletes it
                    continue
                if not named:
                    self.files.remove([d])
        return removed

    @staticmethod
    def _drop_bundles(conn: sqlite3.Connection, digests: list[str]) -> tuple[int, list[str], dict[str, int]]:
        """Delete bundles' rows (theirs in bundle_parts too; their summaries lose the digest)
        in the caller's transaction: (rows of `bundles` deleted, the digests whose bytes are
        files, for the caller to delete once the transaction commits, the bytes dropped by
        the node that uploaded them)."""
        ids = json.dumps(digests)
        freed = {node: int(n) for node, n in conn.execute(
            "SELECT node_id, SUM(size) FROM bundles WHERE node_id != '' AND digest IN (SELECT value FROM json_each(?)) "
            "GROUP BY node_id", (ids,))}
        files = [r[0] for r in conn.execute("SELECT digest FROM bundles WHERE in_file = 1 AND digest IN "
                                            "(SELECT value FROM json_each(?))", (ids,))]
        conn.execute("DELETE FROM bundle_parts WHERE parts IN (SELECT parts FROM bundles WHERE parts != 0 "
                     "AND digest IN (SELECT value FROM json_each(?)))", (ids,))
        removed = conn.execute("DELETE FROM bundles WHERE digest IN (SELECT value FROM json_each(?))", (ids,)).rowcount
        conn.execute("DELETE FROM summary_digests WHERE digest IN (SELECT value FROM json_each(?))", (ids,))
        return removed, files, freed


class _FileWriter(BundleWriter):
    """SqliteState's upload: the chunks appended to a temporary file as they arrive (memory
    per upload: one chunk); `prepare` makes it durable under the digest's name (fsync,
    rename, directory fsync; the caller does it outside its locks), `commit` writes the row
    (bundlefiles.py). A write that fails aborts the upload: its file no longer matches its
    size."""

    def __init__(self, state: SqliteState) -> None:
        self._sqlite = state
        self._part: PartFile | None = state.files.create()
        self._sealed: str | None = None  # the digest this upload's file was put under
        self._done = False
        self.size = 0

    def _check_open(self) -> None:
        if self._done or self._part is None:
            raise ValueError("this upload was committed, aborted, failed or already prepared")

    def write(self, data: bytes) -> None:
        self._check_open()
        if len(data):
            try:
                self._part.write(data)
            except BaseException:
                self.abort()
                raise
            self.size += len(data)

    def prepare(self, digest: str) -> None:
        if self._sealed == digest and not self._done:
            return
        self._check_open()
        digest = as_str(digest, "digest")
        part, self._part = self._part, None
        self._sqlite._claim(digest)
        self._sealed = digest
        try:
            part.seal(digest)  # discards the file if it fails
        except BaseException:
            self.abort()
            raise

    def commit(self, digest: str, signature: bytes = b"", signer_cert: bytes = b"", node_id: str = "") -> bool:
        return self._commit(digest, signature, signer_cert, None, as_str(node_id, "node_id"))[0]

    def commit_attached(self, digest: str, signature: bytes, signer_cert: bytes, node_id: str, round: int,
                        prompt_id: str) -> tuple[bool, bool]:
        return self._commit(digest, signature, signer_cert, (as_str(node_id, "node_id"), as_int(round, "round"),
                                                             as_str(prompt_id, "prompt_id")))

    def _commit(self, digest: str, signature: bytes, signer_cert: bytes,
                attach: tuple[str, int, str] | None, node_id: str = "") -> tuple[bool, bool]:
        if self._done:
            raise ValueError("this upload was committed, aborted or failed")
        digest = as_str(digest, "digest")
        sig, cert = norm_blob(signature, "signature"), norm_blob(signer_cert, "signer_cert")
        if self._sealed is None:
            if self._sqlite._read("SELECT 1 FROM bundles WHERE digest = ?", (digest,)):
                self.abort()  # the first upload wins: no need to put the file in place
                return False, attach is not None and self._sqlite.set_bundle_digest(*attach, digest)
            self.prepare(digest)
        elif self._sealed != digest:
            raise ValueError(f"this upload was prepared as {self._sealed[:16]}, not {digest[:16]}")
        stored = False
        try:
            stored, attached = self._sqlite._insert_file_row(digest, self.size, sig, cert, attach, node_id)
            return stored, attached
        finally:
            self._done = True
            self._sqlite._release(digest, stored)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._part is not None:
            part, self._part = self._part, None
            part.discard()
        elif self._sealed is not None:
            self._sqlite._release(self._sealed, False)
