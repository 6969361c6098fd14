"""The job store as the scheduler's async code uses it: one database thread and a change feed.

The records and the rules (compare-and-set transitions, bounded logs and
events) are ``hypha.scheduler.sqlite_store``'s, recovery after a crash
``hypha.scheduler.restart_recovery``'s; this module adds two things on top:

- **One database thread.** ``JobStore`` runs every call of its
  ``SqliteJobStore`` on one dedicated thread: SQLite serialises writers
  anyway, the event loop never blocks on disk, and the connection is only
  ever used from the thread that opened it. Each method is the synchronous
  one, run there (``_on_db_thread``), so the two cannot drift apart.
- **An event feed, not polling.** After a commit that changes a job (its
  row, its events, its logs) the waiters of that job are woken
  (``ChangeFeed``); ``WatchJob`` and ``GetLogs --follow`` read rows after
  the last sequence number they saw and sleep on the feed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from hypha.errors import FailedPreconditionError, UnavailableError
from hypha.scheduler import restart_recovery
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.records import (
    JobEventRecord,
    JobRecord,
    LogEntry,
    LogRecord,
    MetricRecord,
    RecoveryReport,
    WorkerMetric,
)
from hypha.scheduler.sqlite_store import DB_NAME, SqliteJobStore
from hypha.service import Service
from hypha.v1 import common_pb2

P = ParamSpec("P")
T = TypeVar("T")


class ChangeFeed:
    """Wakes whoever waits on a key (``job:<id>``, ``logs:<id>``) after a commit.

    A waiter takes the key's current event *before* reading the store, so a
    change committed between its read and its wait still wakes it: no lost
    wake-ups, no polling, and nothing queued per waiter.
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def token(self, key: str) -> asyncio.Event:
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = asyncio.Event()
        return event

    def notify(self, key: str) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()


def _on_db_thread(
    method: Callable[Concatenate[SqliteJobStore, P], T],
) -> Callable[Concatenate[JobStore, P], Awaitable[T]]:
    """``SqliteJobStore.method`` as an async ``JobStore`` method run on the store's thread."""

    async def call(self: JobStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._call(partial(method, self._open_store(), *args, **kwargs))

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


class JobStore(Service):
    """Async access to a ``SqliteJobStore`` through one dedicated thread, plus the change feed."""

    def __init__(self, path: Path | str, **options: Any) -> None:
        self.path = Path(path)
        self.feed = ChangeFeed()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobstore")
        self._store: SqliteJobStore | None = None
        self._options = options
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    async def open(cls, path: Path | str, **options: Any) -> JobStore:
        store = cls(path, **options)
        await store.start()
        return store

    async def start(self) -> None:
        """Open the database (on the store's thread); a no-op when already open.

        Lets a node build the store (and everything that holds it) before its
        event loop runs and open it as one of its parts."""
        if self._closed:
            raise FailedPreconditionError("job store is closed")
        if self._store is None:
            self._store = await self._call(partial(SqliteJobStore, self.path, **self._options))

    async def stop(self) -> None:
        await self.close()

    async def close(self) -> None:
        """Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._store is not None:
            await self._call(self._store.close)
        self._executor.shutdown(wait=True)

    async def _call(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn)

    def _open_store(self) -> SqliteJobStore:
        if self._store is None or self._closed:
            # The scheduler is starting or stopping (its server answers a moment longer than
            # the store is open): a worker's report or a client's call is to be tried again.
            state = "not open yet" if self._store is None and not self._closed else "closed"
            raise UnavailableError(f"job store is {state}: the scheduler is starting or stopping; try again")
        return self._store

    def _changed(self, job_id: str) -> None:
        self.feed.notify(f"job:{job_id}")
        self.feed.notify("jobs")

    # ---- reads: the synchronous methods, on the store's thread ----------------------------

    get = _on_db_thread(SqliteJobStore.get)
    find = _on_db_thread(SqliteJobStore.find)
    list_jobs = _on_db_thread(SqliteJobStore.list_jobs)
    counts = _on_db_thread(SqliteJobStore.counts)
    events = _on_db_thread(SqliteJobStore.events)
    last_event_seq = _on_db_thread(SqliteJobStore.last_event_seq)
    worker_metrics = _on_db_thread(SqliteJobStore.worker_metrics)
    logs = _on_db_thread(SqliteJobStore.logs)
    metrics = _on_db_thread(SqliteJobStore.metrics)
    record_metrics = _on_db_thread(SqliteJobStore.record_metrics)  # per-round history: nobody waits on it
    save_run_state = _on_db_thread(SqliteJobStore.save_run_state)  # a run's own state: nobody waits on it
    run_state = _on_db_thread(SqliteJobStore.run_state)

    # ---- writes: the same, then wake whoever waits on the job ---------------------------

    async def create(
        self, spec: common_pb2.JobSpec, submitted_by: str = "", *, job_id: str | None = None
    ) -> JobRecord:
        job = await self._create(spec, submitted_by, job_id=job_id)
        self._changed(job.job_id)
        return job

    async def transition(
        self,
        job_id: str,
        target: JobState,
        *,
        expected: JobState | None = None,
        reason: str | None = None,
        **changes: Any,
    ) -> JobRecord:
        try:
            return await self._transition(job_id, target, expected=expected, reason=reason, **changes)
        finally:
            self._changed(job_id)

    async def update(
        self, job_id: str, *, message: str = "", worker_metrics: Iterable[WorkerMetric] = (), **changes: Any
    ) -> JobRecord | None:
        job = await self._update(job_id, message=message, worker_metrics=tuple(worker_metrics), **changes)
        if job is not None:
            self._changed(job_id)
        return job

    async def note(self, job_id: str, message: str) -> None:
        await self._note(job_id, message)
        self._changed(job_id)

    async def append_logs(self, job_id: str, entries: Iterable[LogEntry]) -> int:
        count = await self._append_logs(job_id, tuple(entries))
        if count:
            self.feed.notify(f"logs:{job_id}")
        return count

    async def recover(self, resumable: Callable[[JobRecord], bool] | None = None) -> RecoveryReport:
        report = await self._recover(resumable)
        for job in [*report.requeued, *report.resumed, *report.failed]:
            self._changed(job.job_id)
        return report

    _create = _on_db_thread(SqliteJobStore.create)
    _transition = _on_db_thread(SqliteJobStore.transition)
    _update = _on_db_thread(SqliteJobStore.update)
    _note = _on_db_thread(SqliteJobStore.note)
    _append_logs = _on_db_thread(SqliteJobStore.append_logs)
    _recover = _on_db_thread(restart_recovery.recover)  # a bare ``recover`` here is the method above


__all__ = [
    "DB_NAME",
    "ChangeFeed",
    "JobEventRecord",
    "JobRecord",
    "JobStore",
    "LogEntry",
    "LogRecord",
    "MetricRecord",
    "RecoveryReport",
    "WorkerMetric",
]
