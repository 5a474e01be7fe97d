"""SQLite trajectory store: one file per run, indexed by prompt id and step.

The store is the paper's "stored peer trajectories": a log of every group a run sampled
(prompt, texts, generation log-probs, rewards, advantages, lengths), which another model
can later train against (docs/algorithm.md, "Stored peers"). WAL mode lets a reader (a receiver) open
the file while its writer is still training.

A damaged file is refused when it is opened (SQLite's quick_check), and a write the disk
cannot take raises `StorageError` naming the file; the groups recorded before are intact
(each `record` is one transaction).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from graft_fed.core.records import GroupRecord
from graft_fed.errors import DataError, StorageError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    run_id TEXT NOT NULL,
    model_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    prompt_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    k INTEGER NOT NULL,
    payload TEXT NOT NULL,
    PRIMARY KEY (run_id, step, prompt_id)
);
CREATE INDEX IF NOT EXISTS groups_by_prompt ON groups (prompt_id, step);
"""


class TrajectoryStore:
    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly and not self.path.is_file():
            raise DataError(f"trajectory store {self.path} does not exist; give the trajectories.sqlite "
                            "file of a finished run (run.record_groups: true)")
        uri = f"file:{self.path}?mode=ro" if readonly else f"file:{self.path}"
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(uri, uri=True, check_same_thread=False)
            if not readonly:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self.db.executescript(_SCHEMA)
                self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                self.db.commit()
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            problems = [r[0] for r in self.db.execute("PRAGMA quick_check(5)").fetchall()]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems)[:400])
        except sqlite3.DatabaseError as exc:
            if getattr(self, "db", None) is not None:
                self.db.close()
            raise DataError(f"{self.path} is not a readable trajectory store ({exc}). Restore it from a backup, "
                            "or move it (and its -wal file) aside: a run then records into a new file, and "
                            "the groups in the damaged one are lost to stored-peer training") from None
        if row is None or str(row[0]) != str(SCHEMA_VERSION):
            raise DataError(f"{self.path}: trajectory store schema {str(row[0])[:40] if row else '?'} is not "
                            f"{SCHEMA_VERSION}; re-export it with this graft-fed version")

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "TrajectoryStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, records: Iterable[GroupRecord]) -> int:
        """Insert (or replace: a resumed run re-records the steps after its checkpoint) groups."""
        rows = [(r.run_id, r.model_id, r.step, r.prompt_id, r.n, r.k, json.dumps(r.to_dict()))
                for r in records]
        try:
            with self.db:
                self.db.executemany("INSERT OR REPLACE INTO groups VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        except sqlite3.OperationalError as exc:
            full = (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL
            raise StorageError(
                f"trajectory store {self.path}: " + ("the disk is full" if full else f"write failed ({exc})")
                + f"; {len(rows)} groups were not recorded (those recorded before are intact). Free space and "
                "resume the run from its last checkpoint (--resume auto), or set run.record_groups: false") from None
        return len(rows)

    def set_run_advantage(self, run_id: str, advantage: str) -> None:
        """Record how `run_id` normalised its advantages (core.advantages.advantage_id): a
        receiver training on this run's groups uses them as they are, so it checks this."""
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"advantage/{run_id}", advantage))

    def run_advantage(self, run_id: str) -> str | None:
        """What `set_run_advantage` recorded for `run_id`; None for a store written before it was."""
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (f"advantage/{run_id}",)).fetchone()
        return None if row is None else str(row[0])

    def runs(self) -> list[tuple[str, str, int]]:
        """(run_id, model_id, number of groups) for every run in the store."""
        return [tuple(r) for r in self.db.execute(
            "SELECT run_id, model_id, COUNT(*) FROM groups GROUP BY run_id, model_id ORDER BY run_id")]

    def _decode(self, payload: str, prompt_id: str | None = None) -> GroupRecord:
        """A stored group; `prompt_id`: the prompt its row is filed under, which it must be for.
        A store may come from another site (stored peers): whatever its rows hold (JSON nested
        thousands deep, integers of thousands of digits, a group filed under another prompt)
        is a DataError naming the file, never a traceback or a group for the wrong prompt."""
        try:
            rec = GroupRecord.from_dict(json.loads(payload))
        except (ValueError, RecursionError, TypeError) as exc:  # JSONDecodeError and RecordError are ValueErrors
            raise DataError(f"corrupt group in trajectory store {self.path}: {type(exc).__name__}: "
                            f"{str(exc)[:200]}; re-export it from the run that recorded it") from None
        if prompt_id is not None and rec.prompt_id != prompt_id:
            raise DataError(f"corrupt group in trajectory store {self.path}: the row of prompt {prompt_id[:64]!r} "
                            f"holds a group for prompt {rec.prompt_id[:64]!r}; re-export it from the run that "
                            "recorded it")
        return rec

    def lookup(self, prompt_ids: Sequence[str], step: int | None = None, run_id: str | None = None,
               match: str = "same_step") -> dict[str, GroupRecord]:
        """The stored group for each prompt id.

        match: "same_step" (the paper's stored mode: the peer's group for this prompt at the
        same step of the same prompt schedule), "latest_before" (the freshest group at a
        step <= `step`), or "latest" (the freshest group at any step).
        """
        out: dict[str, GroupRecord] = {}
        run_clause = " AND run_id = ?" if run_id is not None else ""
        for pid in prompt_ids:
            args: list = [pid]
            if match == "same_step":
                sql = "SELECT payload FROM groups WHERE prompt_id = ? AND step = ?"
                args.append(step)
            elif match == "latest_before":
                sql = "SELECT payload FROM groups WHERE prompt_id = ? AND step <= ?"
                args.append(step)
            elif match == "latest":
                sql = "SELECT payload FROM groups WHERE prompt_id = ?"
            else:
                raise ValueError(f"unknown match {match!r}")
            if run_id is not None:
                args.append(run_id)
            row = self.db.execute(sql + run_clause + " ORDER BY step DESC LIMIT 1", args).fetchone()
            if row is not None:
                out[pid] = self._decode(row[0], pid)
        return out

    def iter_records(self, run_id: str | None = None) -> Iterator[GroupRecord]:
        sql, args = "SELECT payload FROM groups", []
        if run_id is not None:
            sql += " WHERE run_id = ?"
            args.append(run_id)
        for (payload,) in self.db.execute(sql + " ORDER BY run_id, step, prompt_id", args):
            yield self._decode(payload)

    def export(self, out: str | Path, run_id: str | None = None) -> int:
        """Write the store as JSONL (.jsonl) or Parquet (.parquet, needs pyarrow) for sharing."""
        out = Path(out)
        records = [r.to_dict() for r in self.iter_records(run_id)]
        if out.suffix == ".parquet":
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError("Parquet export needs pyarrow: pip install 'graft-fed[data]'") from None
            for r in records:
                r["meta"] = json.dumps(r["meta"])
            pq.write_table(pa.Table.from_pylist(records), out)
        else:
            with out.open("w", encoding="utf-8") as fh:
                for r in records:
                    fh.write(json.dumps(r) + "\n")
        return len(records)

    @staticmethod
    def import_jsonl(path: str | Path, store_path: str | Path) -> int:
        """Load an exported JSONL into a store (validating every record)."""
        recs = []
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read {path} ({exc}); give a JSONL file that `graft-fed store export` "
                            "wrote") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                recs.append(GroupRecord.from_dict(json.loads(line)))
            except (ValueError, RecursionError, TypeError) as exc:  # JSONDecodeError and RecordError are ValueErrors
                raise DataError(f"{path}:{n}: not a group record ({type(exc).__name__}: {str(exc)[:200]}); nothing "
                                "was imported") from None
        with TrajectoryStore(store_path) as store:
            return store.record(recs)
