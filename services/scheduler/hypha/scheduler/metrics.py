"""Scheduler monitoring: Prometheus metrics, and the AIM status bridge push.

**Prometheus.** ``SchedulerMetrics`` keeps the ``hypha_scheduler_*`` metric set
on its own ``prometheus_client`` registry; the REST server serves it at
``GET /metrics`` (``hypha.net.metrics_server.exposition``), behind the same
mTLS as the rest of the REST API (any certificate of the network, any role:
point Prometheus' ``tls_config`` at an admin or client certificate). Figures
that live in the job store (jobs by state, tasks queued / completed / failed)
and in the market (workers available / busy) are read when scraped, through
``refresh`` hooks, so they survive restarts and never drift from the truth;
the rest (allocation latency, round duration, bytes moved) are observed by
orchestration as they happen.

**Status bridge.** The reference system's ``status_bridge`` setting: each training metric is one
JSON ``POST http://<status_bridge>/status`` of the reference system's AIM
schema, ``{"worker_id", "metric_name", "round", "value"}`` (plus ``job_id``).
It is fire-and-forget: ``push`` never blocks and drops the metric when the
bounded queue is full; one background task sends, with a per-request
timeout, and counts what it sent, dropped and failed to send.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hypha.jobfile.kinds import KINDS
from hypha.scheduler.lifecycle import JobState
from hypha.service import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEFAULT_ROUND_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

Refresh = Callable[[], Awaitable[None]]
JobCounts = Mapping[tuple[str, JobState], int]


class _StoreFigures(Collector):
    """The job store's counts as of the last refresh (totals the store keeps, not this process)."""

    def __init__(self) -> None:
        self.table: JobCounts = {}

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        table = self.table
        jobs = GaugeMetricFamily(
            "hypha_scheduler_jobs",
            "Jobs known to the scheduler, by kind and state.",
            labels=("kind", "state"),
        )
        for kind in KINDS:
            for state in JobState:
                jobs.add_metric((kind, state.value), table.get((kind, state), 0))
        yield jobs
        queued = table.get(("task", JobState.PENDING), 0) + table.get(("task", JobState.ALLOCATING), 0)
        yield GaugeMetricFamily(
            "hypha_scheduler_tasks_queued", "Task jobs waiting (pending or allocating).", queued
        )
        yield CounterMetricFamily(
            "hypha_scheduler_tasks_completed",
            "Task jobs that succeeded, since the store was created.",
            table.get(("task", JobState.SUCCEEDED), 0),
        )
        yield CounterMetricFamily(
            "hypha_scheduler_tasks_failed",
            "Task jobs that failed for good, since the store was created.",
            table.get(("task", JobState.FAILED), 0),
        )


class SchedulerMetrics:
    """The scheduler's metric set (the ``hypha_scheduler_*`` names), on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self._store = _StoreFigures()
        r.register(self._store)
        self._hooks: list[Refresh] = []
        self.jobs_submitted = Counter(
            "hypha_scheduler_jobs_submitted", "Jobs accepted by this process.", registry=r
        )
        self.workers_available = Gauge(
            "hypha_scheduler_workers_available", "Leased, healthy workers not running a job.", registry=r
        )
        self.workers_busy = Gauge("hypha_scheduler_workers_busy", "Leased workers running a job.", registry=r)
        self.allocation_seconds = Histogram(
            "hypha_scheduler_allocation_duration_seconds",
            "Time from asking the market for workers to holding their leases.",
            buckets=DEFAULT_LATENCY_BUCKETS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "hypha_scheduler_round_duration_seconds",
            "Duration of DiLoCo rounds.",
            buckets=DEFAULT_ROUND_BUCKETS,
            registry=r,
        )
        self.bytes_moved = Counter(
            "hypha_scheduler_bytes_moved",
            "Bytes the scheduler streamed, by what they were.",
            ("kind",),
            registry=r,
        )

    def watch_store(self, counts: Callable[[], Awaitable[JobCounts]]) -> None:
        """Refresh the job figures from the store (``JobStore.counts``) at each scrape."""

        async def refresh() -> None:
            self._store.table = dict(await counts())

        self._hooks.append(refresh)

    def watch_workers(self, busy_flags: Callable[[], Awaitable[Iterable[bool]]]) -> None:
        """Refresh worker figures at each scrape; ``busy_flags`` yields one bool per leased worker."""

        async def refresh() -> None:
            flags = list(await busy_flags())
            busy = sum(1 for flag in flags if flag)
            self.workers_busy.set(busy)
            self.workers_available.set(len(flags) - busy)

        self._hooks.append(refresh)

    async def refresh(self) -> None:
        """Read the scrape-time figures; one broken source must not hide every other metric."""
        for hook in self._hooks:
            try:
                await hook()
            except Exception:
                log.exception("metrics scrape hook failed")

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent), e.g. ``value("hypha_scheduler_bytes_moved_total",
        kind="result")``: for tests and the status page, without parsing the text format."""
        return self.registry.get_sample_value(name, labels) or 0.0


class StatusBridge:
    """Pushes training metrics to an AIM bridge: fire-and-forget, bounded, never blocking."""

    def __init__(self, address: str, *, max_queue: int = 1000, timeout_s: float = 2.0) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        base = address if address.startswith(("http://", "https://")) else f"http://{address}"
        self.url = base.rstrip("/") + "/status"
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=max_queue)
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.dropped = 0
        self.failed = 0

    def push(self, job_id: str, worker_id: str, metric_name: str, round_: int, value: float) -> bool:
        """Queue one metric; False (and counted as dropped) when the queue is full."""
        item = {
            "job_id": job_id,
            "worker_id": worker_id,
            "metric_name": metric_name,
            "round": int(round_),
            "value": float(value),
        }
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    def push_metrics(self, job_id: str, worker_id: str, round_: int, values: Mapping[str, float]) -> int:
        """One POST per value (the AIM schema carries one metric each); returns how many were queued."""
        return sum(self.push(job_id, worker_id, name, round_, value) for name, value in values.items())

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="status-bridge")

    async def stop(self) -> None:
        """Idempotent; metrics still queued are dropped (it is a best-effort feed)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                item = await self._queue.get()
                try:
                    async with session.post(self.url, json=item) as response:
                        if response.status >= 400:
                            raise aiohttp.ClientResponseError(
                                response.request_info,
                                (),
                                status=response.status,
                                message=response.reason or "",
                            )
                    self.sent += 1
                except (aiohttp.ClientError, TimeoutError, OSError) as err:
                    self.failed += 1
                    if self.failed == 1 or self.failed % 100 == 0:
                        log.warning(
                            "status bridge %s: push failed (%d so far): %s", self.url, self.failed, err
                        )
