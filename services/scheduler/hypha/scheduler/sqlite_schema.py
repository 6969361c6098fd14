"""The scheduler database's tables, their version and upgrades, and how a row becomes a record.

Kept apart from the store's operations so that what is on disk is read in one
place: a change to a table, its upgrade step and the row conversion that reads
it are made together.

Decisions (``NOTE``):

- **Versioned with ``PRAGMA user_version``.** A file newer than this
  scheduler's schema is refused (an older scheduler must not write rows it
  does not understand); an older one gains its missing columns in place when
  opened, so an upgraded scheduler keeps every job it ever accepted.
- **A run's state is kept in parts** (``run_state_parts``: one row per
  part), so a run that changes one part rewrites that row only (a DiLoCo
  run's slices are one part each: ``hypha.scheduler.diloco.snapshot``).
- **Durability**: WAL with ``synchronous=NORMAL``: a crash of the scheduler
  process loses nothing committed; a power cut may lose the last
  transactions (acceptable for job bookkeeping, and much faster).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hypha.errors import FailedPreconditionError, InvalidArgumentError
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.records import JobEventRecord, JobRecord, WorkerMetric
from hypha.v1 import common_pb2

SCHEMA_VERSION = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id       TEXT PRIMARY KEY,
    kind         TEXT NOT NULL,
    name         TEXT NOT NULL DEFAULT '',
    spec         BLOB NOT NULL,
    state        TEXT NOT NULL,
    reason       TEXT NOT NULL DEFAULT '',
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL,
    round        INTEGER NOT NULL DEFAULT 0,
    loss         REAL NOT NULL DEFAULT 0,
    workers      TEXT NOT NULL DEFAULT '[]',
    attempt      INTEGER NOT NULL DEFAULT 0,
    exit_code    INTEGER NOT NULL DEFAULT 0,
    submitted_by TEXT NOT NULL DEFAULT '',
    not_before   REAL NOT NULL DEFAULT 0,
    result_path  TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE TABLE IF NOT EXISTS job_events (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id   TEXT NOT NULL,
    at       REAL NOT NULL,
    kind     TEXT NOT NULL,
    state    TEXT NOT NULL,
    round    INTEGER NOT NULL DEFAULT 0,
    loss     REAL NOT NULL DEFAULT 0,
    message  TEXT NOT NULL DEFAULT '',
    workers  TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events (job_id, seq);
CREATE TABLE IF NOT EXISTS logs (
    seq       INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id    TEXT NOT NULL,
    at        REAL NOT NULL,
    stream    TEXT NOT NULL,
    line      TEXT NOT NULL,
    worker_id TEXT NOT NULL DEFAULT '',
    attempt   INTEGER NOT NULL DEFAULT 0,
    worker_name TEXT NOT NULL DEFAULT '',
    executor  TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS logs_by_job ON logs (job_id, seq);
CREATE TABLE IF NOT EXISTS metrics (
    job_id    TEXT NOT NULL,
    round     INTEGER NOT NULL,
    worker_id TEXT NOT NULL DEFAULT '',
    name      TEXT NOT NULL,
    value     REAL NOT NULL,
    at        REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS metrics_by_job ON metrics (job_id, round);
CREATE INDEX IF NOT EXISTS metrics_by_job_row ON metrics (job_id);
CREATE TABLE IF NOT EXISTS worker_metrics (
    job_id             TEXT NOT NULL,
    worker_id          TEXT NOT NULL,
    samples_per_second REAL NOT NULL,
    samples            INTEGER NOT NULL,
    loss               REAL NOT NULL,
    batch_size         INTEGER NOT NULL,
    updated_at         REAL NOT NULL,
    PRIMARY KEY (job_id, worker_id)
);
CREATE TABLE IF NOT EXISTS run_state_parts (
    job_id     TEXT NOT NULL,
    part       TEXT NOT NULL,
    data       TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (job_id, part)
) WITHOUT ROWID;
"""

#: Columns ``transition``/``update`` may change besides state and reason.
MUTABLE_COLUMNS = frozenset({"round", "loss", "workers", "attempt", "exit_code", "not_before", "result_path"})
JOB_COLUMNS = (
    "job_id, kind, spec, state, reason, created_at, updated_at, round, loss, workers, attempt, "
    "exit_code, submitted_by, not_before, result_path"
)
EVENT_COLUMNS = "seq, job_id, at, kind, state, round, loss, message, workers"


def connect(path: Path | str) -> sqlite3.Connection:
    """Open (creating or upgrading) the database at ``path`` (``:memory:`` for none on disk)."""
    if str(path) != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in ``transaction``).
    db = sqlite3.connect(str(path), isolation_level=None, timeout=10.0, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=10000")
    with transaction(db):
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise FailedPreconditionError(
                f"{Path(path)}: schema {version} is newer than this scheduler's ({SCHEMA_VERSION})"
            )
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        # Schema 1 stores (before logs named their worker and executor) gain the columns.
        columns = {row[1] for row in db.execute("PRAGMA table_info(logs)")}
        for column in ("worker_name", "executor"):
            if column not in columns:
                db.execute(f"ALTER TABLE logs ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
        # Schema 2 kept a run's state as one row (a layout no run resumes from any more): its jobs
        # are settled as runs that saved nothing (``restart_recovery``).
        db.execute("DROP TABLE IF EXISTS run_state")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return db


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """An immediate (write-locked) transaction: committed on success, rolled back on error."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def check_changes(changes: Mapping[str, Any]) -> None:
    unknown = set(changes) - MUTABLE_COLUMNS
    if unknown:
        raise InvalidArgumentError(f"cannot change job columns {sorted(unknown)}")


def assignments(changes: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """``changes`` as the ``, column = ?`` tail of an UPDATE's SET and its arguments."""
    sets, args = "", []
    for column, value in sorted(changes.items()):
        if column == "workers" and not isinstance(value, str):
            value = json.dumps(list(value))
        sets += f", {column} = ?"
        args.append(value)
    return sets, args


def job_from_row(row: sqlite3.Row) -> JobRecord:
    spec = common_pb2.JobSpec()
    spec.ParseFromString(row["spec"])
    return JobRecord(
        job_id=row["job_id"],
        kind=row["kind"],
        spec=spec,
        state=JobState(row["state"]),
        reason=row["reason"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        round=row["round"],
        loss=row["loss"],
        workers=tuple(json.loads(row["workers"])),
        attempt=row["attempt"],
        exit_code=row["exit_code"],
        submitted_by=row["submitted_by"],
        not_before=row["not_before"],
        result_path=row["result_path"],
    )


def event_from_row(row: sqlite3.Row) -> JobEventRecord:
    return JobEventRecord(
        seq=row["seq"],
        job_id=row["job_id"],
        at=row["at"],
        kind=row["kind"],
        state=JobState(row["state"]),
        round=row["round"],
        loss=row["loss"],
        message=row["message"],
        workers=tuple(WorkerMetric.from_dict(w) for w in json.loads(row["workers"])),
    )


__all__ = [
    "EVENT_COLUMNS",
    "JOB_COLUMNS",
    "MUTABLE_COLUMNS",
    "SCHEMA_VERSION",
    "assignments",
    "check_changes",
    "connect",
    "event_from_row",
    "job_from_row",
    "transaction",
]
