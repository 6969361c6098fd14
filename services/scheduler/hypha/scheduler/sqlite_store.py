"""The scheduler's memory: every job, its history, logs and metrics, in SQLite (synchronous).

The database lives in the scheduler's state dir (``<state_dir>/scheduler.db``),
so a restarted scheduler still knows every job it ever accepted.

Decisions (``NOTE``):

- **Compare-and-set, never read-then-write.** A state change is one
  ``UPDATE jobs ... WHERE job_id = ? AND state = ?`` inside an immediate
  transaction, checked against ``lifecycle`` first; when the row moved in the
  meantime (another writer, another process) the update matches nothing and
  the caller gets a ``FailedPreconditionError``/``IllegalTransitionError``,
  never a lost update. Progress updates are conditional too (``AND state IN
  (running, allocating)``), so a late report cannot touch a finished job.
- **Events are rows.** Each committed change appends a row to
  ``job_events`` (state changes, progress, info); ``WatchJob`` and ``GetLogs
  --follow`` read rows after the last sequence number they saw (the async
  ``hypha.scheduler.store.JobStore`` wakes them after each commit).
- **Bounded.** Logs keep the last ``max_log_lines`` lines per job (older
  lines are dropped, each line cut at ``MAX_LINE_CHARS``); events keep the
  last ``max_events`` per job, and progress events within one round are
  coalesced (only the latest survives), while per-round metrics stay in
  ``metrics``, the last ``max_metric_rows`` rows per job
  (``scheduler.jobs.max_metric_rows``; a worker reports every round, so a
  long job would otherwise grow the table without end). The oldest go
  first, as for logs: a curve keeps its recent end.
- **A run's own state is kept only while the job is active**
  (``save_run_state``, in parts, each written only when the run changes it):
  it is what resuming the job after a restart needs
  (``hypha.scheduler.restart_recovery``), and is removed when the job
  reaches a terminal state.

The tables, their upgrades and durability are ``hypha.scheduler.sqlite_schema``'s.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from hypha.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from hypha.scheduler.lifecycle import JobState, Reason, transition
from hypha.scheduler.records import (
    JobEventRecord,
    JobRecord,
    LogEntry,
    LogRecord,
    MetricRecord,
    WorkerMetric,
    new_job_id,
)
from hypha.scheduler.sqlite_schema import (
    EVENT_COLUMNS,
    JOB_COLUMNS,
    assignments,
    check_changes,
    connect,
    event_from_row,
    job_from_row,
    transaction,
)
from hypha.v1 import common_pb2

DB_NAME = "scheduler.db"
MAX_LINE_CHARS = 8192


class SqliteJobStore:
    """Jobs, events, logs and metrics in one SQLite file. Not thread-safe: one
    instance per thread (several instances, even processes, may share a file)."""

    def __init__(
        self,
        path: Path | str,
        *,
        clock: Callable[[], float] = time.time,
        max_log_lines: int = 10_000,
        max_events: int = 10_000,
        max_metric_rows: int = 10_000,
    ) -> None:
        if max_log_lines < 1 or max_events < 1 or max_metric_rows < 1:
            raise InvalidArgumentError("max_log_lines, max_events and max_metric_rows must be at least 1")
        self.path = Path(path)
        self.clock = clock
        self.max_log_lines = max_log_lines
        self.max_events = max_events
        self.max_metric_rows = max_metric_rows
        self._db = connect(path)

    def close(self) -> None:
        self._db.close()

    # ---- jobs -----------------------------------------------------------------------------

    def create(
        self, spec: common_pb2.JobSpec, submitted_by: str = "", *, job_id: str | None = None
    ) -> JobRecord:
        kind = spec.WhichOneof("kind")
        if kind is None:
            raise InvalidArgumentError("spec.kind: missing: set diloco or task")
        now = self.clock()
        with transaction(self._db) as db:
            for _ in range(5):
                candidate = job_id or new_job_id()
                try:
                    db.execute(
                        "INSERT INTO jobs (job_id, kind, name, spec, state, reason, created_at, updated_at,"
                        " submitted_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            candidate,
                            kind,
                            spec.name,
                            spec.SerializeToString(),
                            JobState.PENDING.value,
                            Reason.SUBMITTED,
                            now,
                            now,
                            submitted_by,
                        ),
                    )
                except sqlite3.IntegrityError:
                    if job_id is not None:
                        raise AlreadyExistsError(f"job {job_id} already exists") from None
                    continue
                self._event(db, candidate, now, "state", JobState.PENDING, 0, 0.0, Reason.SUBMITTED)
                return self._get(db, candidate)
        raise FailedPreconditionError("could not allocate a unique job id")

    def get(self, job_id: str) -> JobRecord:
        return self._get(self._db, job_id)

    def find(self, job_id: str) -> JobRecord | None:
        row = self._db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else job_from_row(row)

    def list_jobs(
        self,
        states: Iterable[JobState] | None = None,
        *,
        kind: str | None = None,
        submitted_by: str | None = None,
        limit: int = 1000,
    ) -> list[JobRecord]:
        """Jobs in submission order: the most recent ``limit`` that match."""
        where, args = [], []
        wanted = [JobState(s).value for s in states] if states is not None else []
        if wanted:
            where.append(f"state IN ({', '.join('?' * len(wanted))})")
            args.extend(wanted)
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if submitted_by is not None:
            where.append("submitted_by = ?")
            args.append(submitted_by)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._db.execute(
            f"SELECT {JOB_COLUMNS} FROM jobs {clause} ORDER BY rowid DESC LIMIT ?", (*args, limit)
        ).fetchall()
        return [job_from_row(row) for row in reversed(rows)]

    def counts(self) -> dict[tuple[str, JobState], int]:
        """Number of jobs by (kind, state)."""
        rows = self._db.execute("SELECT kind, state, COUNT(*) FROM jobs GROUP BY kind, state").fetchall()
        return {(row[0], JobState(row[1])): int(row[2]) for row in rows}

    def transition(
        self,
        job_id: str,
        target: JobState,
        *,
        expected: JobState | None = None,
        reason: str | None = None,
        **changes: Any,
    ) -> JobRecord:
        """Move a job to ``target`` with one conditional update.

        ``expected``: the state the caller believes the job is in; if it is in
        another, FailedPreconditionError (someone else moved it first). Without
        it, any state the table allows moving from is accepted. ``changes``
        sets other columns in the same write (attempt, exit_code, workers,
        not_before, result_path, round, loss). ``reason`` None keeps the old one.
        """
        check_changes(changes)
        now = self.clock()
        with transaction(self._db) as db:
            current = self._get(db, job_id)
            if expected is not None and current.state is not expected:
                raise FailedPreconditionError(
                    f"job {job_id} is {current.state.value}, not {expected.value} (changed concurrently)"
                )
            transition(current.state, target, job_id)
            sets, args = assignments(changes)
            new_reason = current.reason if reason is None else reason
            cursor = db.execute(
                f"UPDATE jobs SET state = ?, reason = ?, updated_at = ?{sets} WHERE job_id = ? AND state = ?",
                (target.value, new_reason, now, *args, job_id, current.state.value),
            )
            if cursor.rowcount != 1:  # only possible if the lock semantics were bypassed
                raise FailedPreconditionError(f"job {job_id} changed concurrently")
            if target.terminal:
                db.execute("DELETE FROM run_state_parts WHERE job_id = ?", (job_id,))
            job = self._get(db, job_id)
            self._event(db, job_id, now, "state", target, job.round, job.loss, new_reason)
            return job

    def update(
        self,
        job_id: str,
        *,
        message: str = "",
        worker_metrics: Iterable[WorkerMetric] = (),
        states: frozenset[JobState] = frozenset({JobState.RUNNING, JobState.ALLOCATING}),
        **changes: Any,
    ) -> JobRecord | None:
        """Record progress (round, loss, workers, per-worker figures) on a job in one of ``states``.

        Returns None, changing nothing, when the job is in no such state (a
        late report for a finished job). Progress events of the same round
        are coalesced: watchers see the latest one.
        """
        check_changes(changes)
        metrics = tuple(worker_metrics)
        now = self.clock()
        with transaction(self._db) as db:
            sets, args = assignments(changes)
            allowed = [s.value for s in states]
            cursor = db.execute(
                f"UPDATE jobs SET updated_at = ?{sets} WHERE job_id = ? "
                f"AND state IN ({', '.join('?' * len(allowed))})",
                (now, *args, job_id, *allowed),
            )
            if cursor.rowcount != 1:
                if self.find(job_id) is None:
                    raise NotFoundError(f"no such job: {job_id}")
                return None
            for m in metrics:
                db.execute(
                    "INSERT INTO worker_metrics (job_id, worker_id, samples_per_second, samples, loss,"
                    " batch_size, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (job_id, worker_id) DO UPDATE SET"
                    " samples_per_second = excluded.samples_per_second, samples = excluded.samples,"
                    " loss = excluded.loss, batch_size = excluded.batch_size,"
                    " updated_at = excluded.updated_at",
                    (job_id, m.worker_id, m.samples_per_second, m.samples, m.loss, m.batch_size, now),
                )
            job = self._get(db, job_id)
            db.execute(
                "DELETE FROM job_events WHERE job_id = ? AND kind = 'progress' AND round = ?"
                " AND seq > (SELECT COALESCE(MAX(seq), 0) FROM job_events"
                " WHERE job_id = ? AND kind != 'progress')",
                (job_id, job.round, job_id),
            )
            self._event(db, job_id, now, "progress", job.state, job.round, job.loss, message, metrics)
            return job

    def note(self, job_id: str, message: str) -> None:
        """An informational entry in the job's history (no state change)."""
        now = self.clock()
        with transaction(self._db) as db:
            job = self._get(db, job_id)
            self._event(db, job_id, now, "info", job.state, job.round, job.loss, message)

    # ---- history, logs, metrics -------------------------------------------------------------

    def events(self, job_id: str, after: int = 0, limit: int = 1000) -> list[JobEventRecord]:
        rows = self._db.execute(
            f"SELECT {EVENT_COLUMNS} FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [event_from_row(row) for row in rows]

    def last_event_seq(self, job_id: str) -> int:
        row = self._db.execute("SELECT MAX(seq) FROM job_events WHERE job_id = ?", (job_id,)).fetchone()
        return int(row[0] or 0)

    def worker_metrics(self, job_id: str) -> list[WorkerMetric]:
        rows = self._db.execute(
            "SELECT worker_id, samples_per_second, samples, loss, batch_size FROM worker_metrics"
            " WHERE job_id = ? ORDER BY worker_id",
            (job_id,),
        ).fetchall()
        return [WorkerMetric(*tuple(row)) for row in rows]

    def append_logs(self, job_id: str, entries: Iterable[LogEntry]) -> int:
        """Append lines (cut at MAX_LINE_CHARS) and drop the oldest beyond ``max_log_lines``."""
        now = self.clock()
        rows = [
            (
                job_id,
                e.at or now,
                e.stream or "stdout",
                e.line[:MAX_LINE_CHARS],
                e.worker_id,
                e.attempt,
                e.worker_name,
                e.executor,
            )
            for e in entries
        ]
        if not rows:
            return 0
        with transaction(self._db) as db:
            if db.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone() is None:
                raise NotFoundError(f"no such job: {job_id}")
            db.executemany(
                "INSERT INTO logs (job_id, at, stream, line, worker_id, attempt, worker_name, executor)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            cutoff = db.execute(
                "SELECT seq FROM logs WHERE job_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?",
                (job_id, self.max_log_lines),
            ).fetchone()
            if cutoff is not None:
                db.execute("DELETE FROM logs WHERE job_id = ? AND seq <= ?", (job_id, cutoff[0]))
        return len(rows)

    def logs(self, job_id: str, after: int = 0, limit: int = 1000) -> list[LogRecord]:
        rows = self._db.execute(
            "SELECT seq, job_id, at, stream, line, worker_id, attempt, worker_name, executor FROM logs"
            " WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [LogRecord(*tuple(row)) for row in rows]

    def record_metrics(
        self, job_id: str, round_: int, values: Mapping[str, float], worker_id: str = ""
    ) -> None:
        """Append one round's figures and drop the job's oldest rows beyond ``max_metric_rows``."""
        now = self.clock()
        with transaction(self._db) as db:
            db.executemany(
                "INSERT INTO metrics (job_id, round, worker_id, name, value, at) VALUES (?, ?, ?, ?, ?, ?)",
                [(job_id, round_, worker_id, name, float(value), now) for name, value in values.items()],
            )
            # metrics_by_job_row (job_id, then rowid): the cut-off is one index walk, no sort.
            cutoff = db.execute(
                "SELECT rowid FROM metrics WHERE job_id = ? ORDER BY rowid DESC LIMIT 1 OFFSET ?",
                (job_id, self.max_metric_rows),
            ).fetchone()
            if cutoff is not None:
                db.execute("DELETE FROM metrics WHERE job_id = ? AND rowid <= ?", (job_id, cutoff[0]))

    def metrics(self, job_id: str) -> list[MetricRecord]:
        rows = self._db.execute(
            "SELECT job_id, round, worker_id, name, value, at FROM metrics WHERE job_id = ?"
            " ORDER BY round, rowid",
            (job_id,),
        ).fetchall()
        return [MetricRecord(*tuple(row)) for row in rows]

    # ---- a running job's own state (what resuming it after a restart needs) -----------------

    def save_run_state(self, job_id: str, parts: Mapping[str, Any], *, replace: bool = False) -> bool:
        """Keep each of ``parts`` (its top-level keys, JSON-able values) for an active job, in one
        transaction; ``replace``: the parts not given are dropped. False (nothing kept) when the
        job is over.

        Parts not given are left as they are, so a run writes only what changed."""
        now = self.clock()
        active = (JobState.ALLOCATING.value, JobState.RUNNING.value)
        with transaction(self._db) as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no such job: {job_id}")
            if row[0] not in active:
                return False
            if replace:
                db.execute("DELETE FROM run_state_parts WHERE job_id = ?", (job_id,))
            db.executemany(
                "INSERT INTO run_state_parts (job_id, part, data, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, part)"
                " DO UPDATE SET data = excluded.data, updated_at = excluded.updated_at",
                [(job_id, part, json.dumps(value, sort_keys=True), now) for part, value in parts.items()],
            )
        return True

    def run_state(self, job_id: str) -> dict[str, Any] | None:
        """Every part ``save_run_state`` kept for the job, as one mapping (None: nothing kept)."""
        rows = self._db.execute(
            "SELECT part, data FROM run_state_parts WHERE job_id = ?", (job_id,)
        ).fetchall()
        return {part: json.loads(data) for part, data in rows} if rows else None

    # ---- internals ------------------------------------------------------------------------

    def _get(self, db: sqlite3.Connection, job_id: str) -> JobRecord:
        row = db.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no such job: {job_id}")
        return job_from_row(row)

    def _event(
        self,
        db: sqlite3.Connection,
        job_id: str,
        at: float,
        kind: str,
        state: JobState,
        round_: int,
        loss: float,
        message: str,
        workers: tuple[WorkerMetric, ...] = (),
    ) -> None:
        cursor = db.execute(
            "INSERT INTO job_events (job_id, at, kind, state, round, loss, message, workers)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                at,
                kind,
                state.value,
                round_,
                loss,
                message,
                json.dumps([w.to_dict() for w in workers]),
            ),
        )
        seq = cursor.lastrowid or 0
        if seq > self.max_events:
            db.execute(
                "DELETE FROM job_events WHERE job_id = ? AND seq <= (SELECT seq FROM job_events"
                " WHERE job_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (job_id, job_id, self.max_events),
            )


__all__ = ["DB_NAME", "MAX_LINE_CHARS", "SqliteJobStore"]
