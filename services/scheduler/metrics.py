"""Scheduler monitoring: Prometheus metrics, and the AIM status bridge push.

**Prometheus.** ``MetricsRegistry`` holds counters, gauges and histograms and
renders the plain-text exposition format (version 0.0.4) itself, so there is
no new dependency. The REST server serves it at ``GET /metrics``, behind the
same mTLS as the rest of the REST API (any certificate of the network, any
role: point Prometheus' ``tls_config`` at an admin or client certificate).
Figures that live in the job store (jobs by state, tasks queued / completed
/ failed) and in the market (workers available / busy) are read when
scraped, through ``on_scrape`` hooks, so they survive restarts and never
drift from the truth; the rest (allocation latency, round duration, bytes
moved) are observed by orchestration as they happen.

**Status bridge.** Seed 000's ``status_bridge``: each training metric is one
JSON ``POST http://<status_bridge>/status`` of the reference system's AIM
schema, ``{"worker_id", "metric_name", "round", "value"}`` (plus ``job_id``).
It is fire-and-forget: ``push`` never blocks and drops the metric when the
bounded queue is full; one background task sends, with a per-request
timeout, and counts what it sent, dropped and failed to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from hypha.scheduler.lifecycle import JobState

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEFAULT_ROUND_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

LabelKey = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(labels: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    pairs = (*labels, *extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)

    def _key(self, labels: Mapping[str, str]) -> LabelKey:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels must be exactly {self.labels}, got {sorted(labels)}")
        return tuple((name, str(labels[name])) for name in self.labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelKey, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, value: float, **labels: str) -> None:
        """For totals kept elsewhere (the job store): the current running total."""
        self._values[self._key(labels)] = value

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_format_labels(k)} {_format_value(v)}" for k, v in sorted(self._values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelKey, float] = {} if labels else {(): 0.0}

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def clear(self) -> None:
        self._values = {} if self.labels else {(): 0.0}

    def lines(self) -> list[str]:
        return [f"{self.name}{_format_labels(k)} {_format_value(v)}" for k, v in sorted(self._values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS,
        labels: Sequence[str] = (),
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[LabelKey, list[int]] = {}
        self._sums: dict[LabelKey, float] = {}
        if not labels:
            self._counts[()] = [0] * (len(self.buckets) + 1)
            self._sums[()] = 0.0

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        counts = self._counts.get(self._key(labels))
        return counts[-1] if counts else 0

    def lines(self) -> list[str]:
        out = []
        for key, counts in sorted(self._counts.items()):
            for bound, n in zip(self.buckets, counts, strict=False):
                out.append(f"{self.name}_bucket{_format_labels(key, (('le', _format_value(bound)),))} {n}")
            out.append(f"{self.name}_bucket{_format_labels(key, (('le', '+Inf'),))} {counts[-1]}")
            out.append(f"{self.name}_sum{_format_labels(key)} {_format_value(self._sums[key])}")
            out.append(f"{self.name}_count{_format_labels(key)} {counts[-1]}")
        return out


ScrapeHook = Callable[[], Awaitable[None]]


class MetricsRegistry:
    """Named metrics plus hooks that refresh scrape-time figures; renders the text format."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._hooks: list[ScrapeHook] = []

    def _add(self, metric: _Metric) -> Any:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        result: Counter = self._add(Counter(name, help_text, labels))
        return result

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        result: Gauge = self._add(Gauge(name, help_text, labels))
        return result

    def histogram(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS,
        labels: Sequence[str] = (),
    ) -> Histogram:
        result: Histogram = self._add(Histogram(name, help_text, buckets, labels))
        return result

    def on_scrape(self, hook: ScrapeHook) -> None:
        self._hooks.append(hook)

    async def render(self) -> str:
        for hook in self._hooks:
            try:
                await hook()
            except Exception:  # one broken source must not hide every other metric
                log.exception("metrics scrape hook failed")
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.header())
            lines.extend(metric.lines())
        return "\n".join(lines) + "\n"


class SchedulerMetrics:
    """The scheduler's metric set (names as in seed 001), on its own registry."""

    def __init__(self, registry: MetricsRegistry | None = None) -> None:
        r = self.registry = registry or MetricsRegistry()
        self.jobs = r.gauge(
            "hypha_scheduler_jobs", "Jobs known to the scheduler, by kind and state.", ("kind", "state")
        )
        self.tasks_queued = r.gauge(
            "hypha_scheduler_tasks_queued", "Task jobs waiting (pending or allocating)."
        )
        self.tasks_completed = r.counter(
            "hypha_scheduler_tasks_completed_total", "Task jobs that succeeded, since the store was created."
        )
        self.tasks_failed = r.counter(
            "hypha_scheduler_tasks_failed_total",
            "Task jobs that failed for good, since the store was created.",
        )
        self.jobs_submitted = r.counter(
            "hypha_scheduler_jobs_submitted_total", "Jobs accepted by this process."
        )
        self.workers_available = r.gauge(
            "hypha_scheduler_workers_available", "Leased, healthy workers not running a job."
        )
        self.workers_busy = r.gauge("hypha_scheduler_workers_busy", "Leased workers running a job.")
        self.allocation_seconds = r.histogram(
            "hypha_scheduler_allocation_duration_seconds",
            "Time from asking the market for workers to holding their leases.",
        )
        self.round_seconds = r.histogram(
            "hypha_scheduler_round_duration_seconds", "Duration of DiLoCo rounds.", DEFAULT_ROUND_BUCKETS
        )
        self.bytes_moved = r.counter(
            "hypha_scheduler_bytes_moved_total", "Bytes the scheduler streamed, by what they were.", ("kind",)
        )

    def watch_store(self, counts: Callable[[], Awaitable[Mapping[tuple[str, JobState], int]]]) -> None:
        """Refresh the job figures from the store (``JobStore.counts``) at each scrape."""

        async def refresh() -> None:
            table = await counts()
            self.jobs.clear()
            for kind in ("diloco", "task"):
                for state in JobState:
                    self.jobs.set(table.get((kind, state), 0), kind=kind, state=state.value)
            self.tasks_queued.set(
                table.get(("task", JobState.PENDING), 0) + table.get(("task", JobState.ALLOCATING), 0)
            )
            self.tasks_completed.set_total(table.get(("task", JobState.SUCCEEDED), 0))
            self.tasks_failed.set_total(table.get(("task", JobState.FAILED), 0))

        self.registry.on_scrape(refresh)

    def watch_workers(self, busy_flags: Callable[[], Awaitable[Iterable[bool]]]) -> None:
        """Refresh worker figures at each scrape; ``busy_flags`` yields one bool per healthy worker."""

        async def refresh() -> None:
            flags = list(await busy_flags())
            busy = sum(1 for flag in flags if flag)
            self.workers_busy.set(busy)
            self.workers_available.set(len(flags) - busy)

        self.registry.on_scrape(refresh)

    async def render(self) -> str:
        return await self.registry.render()


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
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

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
