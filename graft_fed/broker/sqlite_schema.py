"""The SQLite state's schema (broker/state_sqlite.py): the tables of a fresh file, and each
version's migration from the one before, which an older file goes through in place, in
the transaction that opens it. A version's statements run first, then its conversion of
the data already held (`_CONVERSIONS`), if it has one. A fresh file is created as a file
of version 1 and goes through every migration, so that a fresh file and a migrated one
cannot differ.

Float columns carry no declared type (a `REAL` column turns -0.0 into 0.0) and NaN is
stored as the text 'nan' (SQLite turns a NaN into NULL): `f2db` and `db2f`."""

from __future__ import annotations

import json
import math
import sqlite3

from graft_fed.broker.reportblock import encode_report_block
from graft_fed.broker.state import SummaryRow
from graft_fed.federation.summaryblock import SummaryBlock

SCHEMA_VERSION = 11

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- Columns without a declared type hold floats exactly (see the module docstring).
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, tokenizer_id TEXT NOT NULL,
    privacy TEXT NOT NULL, state TEXT NOT NULL, session_id TEXT NOT NULL,
    round INTEGER NOT NULL, last_seen NOT NULL, published INTEGER NOT NULL);
CREATE TABLE rounds (round INTEGER PRIMARY KEY, state TEXT NOT NULL, opened_at NOT NULL, matched_at,
    participants TEXT NOT NULL DEFAULT '[]');
CREATE TABLE summaries (
    node_id TEXT NOT NULL, round INTEGER NOT NULL, prompt_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL, n INTEGER NOT NULL, k INTEGER NOT NULL,
    reward_mean NOT NULL, reward_std NOT NULL,
    lengths TEXT NOT NULL, mean_logprobs TEXT NOT NULL,  -- JSON arrays
    bundle_digest TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (node_id, round, prompt_id));
CREATE INDEX summaries_by_round ON summaries (round, node_id, prompt_id);  -- also the result order
CREATE INDEX summaries_by_prompt ON summaries (prompt_id, round);
CREATE TABLE matches (
    round INTEGER NOT NULL, receiver TEXT NOT NULL, prompt_id TEXT NOT NULL,
    source TEXT NOT NULL, source_round INTEGER NOT NULL,
    PRIMARY KEY (round, receiver, prompt_id));
CREATE INDEX matches_by_source ON matches (source);
-- rowid order is insertion order: prune drops the lowest rowids (oldest) first.
CREATE TABLE bundles (digest TEXT PRIMARY KEY, data BLOB NOT NULL, size INTEGER NOT NULL, created NOT NULL);
CREATE TABLE compat (
    source TEXT NOT NULL, receiver TEXT NOT NULL, groups INTEGER NOT NULL,
    mean_s NOT NULL, admitted_fraction NOT NULL, rejected INTEGER NOT NULL,
    PRIMARY KEY (source, receiver));
"""

# Schema version 1 -> 2: bundle provenance (the producer's signature and certificate) and
# receiver reports keyed by (round, receiver, source, prompt) so a report counts once. Part
# of the schema of a fresh file too.
_MIGRATE_2 = """
ALTER TABLE bundles ADD COLUMN signature BLOB NOT NULL DEFAULT x'';
ALTER TABLE bundles ADD COLUMN signer_cert BLOB NOT NULL DEFAULT x'';
CREATE TABLE reports (
    round INTEGER NOT NULL, receiver TEXT NOT NULL, source TEXT NOT NULL, prompt_id TEXT NOT NULL,
    mean_s NOT NULL, admitted_fraction NOT NULL, rejected INTEGER NOT NULL,
    PRIMARY KEY (round, receiver, source, prompt_id));
"""
# Schema version 2 -> 3 (issue 13): a synchronous round's matches as one blob
# (broker/matchset.py), one write per round instead of a row per match; and one publish's
# summaries as one blob (federation/summaryblock.py) instead of a row per summary, their
# bundle digests in a table of their own. `_convert_summaries` moves the rows of an older
# file into blocks in the same transaction.
_MIGRATE_3 = """
CREATE TABLE match_sets (round INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE summary_blocks (
    node_id TEXT NOT NULL, round INTEGER NOT NULL, seq INTEGER NOT NULL, count INTEGER NOT NULL,
    data BLOB NOT NULL, PRIMARY KEY (node_id, round, seq));
CREATE INDEX summary_blocks_by_round ON summary_blocks (round, node_id);
CREATE TABLE summary_digests (
    node_id TEXT NOT NULL, round INTEGER NOT NULL, prompt_id TEXT NOT NULL, digest TEXT NOT NULL,
    PRIMARY KEY (node_id, round, prompt_id));
CREATE INDEX summary_digests_by_digest ON summary_digests (digest);
"""
# Schema version 3 -> 4 (issue 13): a bundle uploaded a chunk at a time is stored as it
# arrives, one row of `bundle_parts` per chunk (written without an fsync of its own), and
# becomes a bundle when its `bundles` row (data empty, `parts` naming its rows) commits. A
# bundle of an older file keeps its bytes in `bundles.data` (`parts` 0). Rows no bundle
# names (an upload cut off by a crash) are dropped at open.
_MIGRATE_4 = """
ALTER TABLE bundles ADD COLUMN parts INTEGER NOT NULL DEFAULT 0;
CREATE TABLE bundle_parts (id INTEGER PRIMARY KEY, parts INTEGER NOT NULL, data BLOB NOT NULL);
CREATE INDEX bundle_parts_by_parts ON bundle_parts (parts, id);
"""
# Schema version 4 -> 5 (issue 13): a bundle's bytes in a file of its own
# (broker/bundlefiles.py), the row only its index (`in_file` 1, data empty, parts 0). The
# bundles already held keep their bytes where they are (bundles.data or bundle_parts).
_MIGRATE_5 = """
ALTER TABLE bundles ADD COLUMN in_file INTEGER NOT NULL DEFAULT 0;
"""
# Schema version 5 -> 6 (issue 13): summary blocks are written in the narrow encoding
# (b"GFS2", federation/summaryblock.py); the blocks already held keep theirs (b"GFS1", which
# still decodes). No statement: the version says that a graft-fed from before, which cannot
# read the new blocks, must not open the file (it would take them for damaged ones).
_MIGRATE_6 = ""
# Schema version 6 -> 7 (issue 13): match sets are written in the narrow encoding (b"GFM2",
# broker/matchset.py); the sets already held keep theirs (b"GFM1", which still decodes). No
# statement, for the same reason as 6.
_MIGRATE_7 = ""
# Schema version 7 -> 8 (issue 13): a summary block's bytes in its round's file
# (broker/blockfiles.py), the row saying where (`file_offset` >= 0, `file_length`,
# `file_crc`; data empty). The blocks already held keep their bytes in `data`
# (`file_offset` -1).
_MIGRATE_8 = """
ALTER TABLE summary_blocks ADD COLUMN file_offset INTEGER NOT NULL DEFAULT -1;
ALTER TABLE summary_blocks ADD COLUMN file_length INTEGER NOT NULL DEFAULT 0;
ALTER TABLE summary_blocks ADD COLUMN file_crc INTEGER NOT NULL DEFAULT 0;
"""
# Schema version 8 -> 9: the hash of the secret that holds each node id (sessions.py, Join),
# none held yet: a table of its own, so that the node rows every publish writes do not carry it.
_MIGRATE_9 = """
CREATE TABLE node_secrets (node_id TEXT PRIMARY KEY, secret_hash TEXT NOT NULL);
"""
# Schema version 9 -> 10: the node that uploaded each bundle (its storage quota,
# `max_node_bundle_mib`, counts the bundles it uploaded that the broker still holds, and
# retention dropping them frees it). A bundle held before gets the first node whose summary
# names it ('' when none does: it then counts against nobody). And the groups receivers
# reported undelivered (`reports.undelivered`, `compat.undelivered`: left out of a source's
# quarantine rate), none among those held before.
_MIGRATE_10 = """
ALTER TABLE bundles ADD COLUMN node_id TEXT NOT NULL DEFAULT '';
ALTER TABLE compat ADD COLUMN undelivered INTEGER NOT NULL DEFAULT 0;
ALTER TABLE reports ADD COLUMN undelivered INTEGER NOT NULL DEFAULT 0;
UPDATE bundles SET node_id = COALESCE((SELECT MIN(s.node_id) FROM summary_digests s WHERE s.digest = bundles.digest),
                                      '');
"""
# Schema version 10 -> 11 (issue 13): a receiver's reports of a round as one block
# (broker/reportblock.py, `GFR1`) instead of a row per group: one write per report rather
# than two B-tree inserts per group, and half the bytes. `_convert_reports` moves the rows
# of an older file into blocks (one per round and receiver) in the same transaction.
_MIGRATE_11 = """
CREATE TABLE report_blocks (
    round INTEGER NOT NULL, receiver TEXT NOT NULL, count INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (round, receiver));
"""
_MIGRATIONS = {2: _MIGRATE_2, 3: _MIGRATE_3, 4: _MIGRATE_4, 5: _MIGRATE_5, 6: _MIGRATE_6, 7: _MIGRATE_7,
               8: _MIGRATE_8, 9: _MIGRATE_9, 10: _MIGRATE_10, 11: _MIGRATE_11}


_REPORT_COLS = "round, receiver, source, prompt_id, mean_s, admitted_fraction, rejected, undelivered"


def _convert_summaries(conn: sqlite3.Connection) -> None:
    """Schema 3: every (node, round)'s summary rows become one block; the table goes."""
    groups: dict[tuple[str, int], list[SummaryRow]] = {}
    for r in conn.execute("SELECT node_id, round, prompt_id, policy_version, n, k, reward_mean, reward_std, lengths, "
                          "mean_logprobs, bundle_digest FROM summaries ORDER BY round, node_id, prompt_id"):
        row = SummaryRow(node_id=r[0], round=r[1], prompt_id=r[2], policy_version=r[3], n=r[4], k=r[5],
                         reward_mean=db2f(r[6]), reward_std=db2f(r[7]), lengths=json.loads(r[8]),
                         mean_logprobs=[float(x) for x in json.loads(r[9])], bundle_digest=r[10])
        groups.setdefault((row.node_id, row.round), []).append(row)
    for (node_id, round), rows in groups.items():
        block = SummaryBlock.from_rows(rows)
        conn.execute("INSERT INTO summary_blocks (node_id, round, seq, count, data) VALUES (?,?,0,?,?)",
                     (node_id, round, len(block), block.to_bytes()))
        conn.executemany("INSERT INTO summary_digests (node_id, round, prompt_id, digest) VALUES (?,?,?,?)",
                         [(node_id, round, r.prompt_id, r.bundle_digest) for r in rows if r.bundle_digest])
    conn.execute("DROP TABLE summaries")


def _convert_reports(conn: sqlite3.Connection) -> None:
    """Schema 11: every (round, receiver)'s report rows become its block; the table goes. The
    rows come in (round, receiver) order, so one block at a time is held (a file of a
    thousand rounds holds 78 million reports at 64 x 4,096)."""
    key, entries = None, []

    def flush() -> None:
        if entries:
            conn.execute("INSERT INTO report_blocks (round, receiver, count, data) VALUES (?,?,?,?)",
                         (*key, len(entries), encode_report_block(entries)))

    for r in conn.execute(f"SELECT {_REPORT_COLS} FROM reports ORDER BY round, receiver, source, prompt_id"):
        if (r[0], r[1]) != key:
            flush()
            key, entries = (r[0], r[1]), []
        entries.append((r[2], r[3], db2f(r[4]), db2f(r[5]), bool(r[6]), bool(r[7])))
    flush()
    conn.execute("DROP TABLE reports")


_CONVERSIONS = {3: _convert_summaries, 11: _convert_reports}  # version reached -> data conversion after its statements


def f2db(x: float):
    """A float as a column stores it (NaN as the text 'nan')."""
    return "nan" if math.isnan(x) else x


def db2f(v) -> float:
    """A float column's value as a float (a float, or the text 'nan')."""
    return float(v)


def _run(conn: sqlite3.Connection, script: str) -> None:
    for stmt in script.split(";"):
        if stmt.strip():
            conn.execute(stmt)


def create(conn: sqlite3.Connection) -> None:
    """The tables of a fresh file, at SCHEMA_VERSION (inside the caller's transaction)."""
    _run(conn, _SCHEMA)
    _upgrade(conn, 1)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """A file of `version` (1 <= version < SCHEMA_VERSION) brought to SCHEMA_VERSION, its data
    converted (inside the caller's transaction: a failure leaves the file as it was)."""
    if not 1 <= version < SCHEMA_VERSION:
        raise ValueError(f"no migration from schema version {version} (this graft-fed writes {SCHEMA_VERSION})")
    _upgrade(conn, version)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))


def _upgrade(conn: sqlite3.Connection, version: int) -> None:
    for v in range(version + 1, SCHEMA_VERSION + 1):
        _run(conn, _MIGRATIONS[v])
        if v in _CONVERSIONS:
            _CONVERSIONS[v](conn)
