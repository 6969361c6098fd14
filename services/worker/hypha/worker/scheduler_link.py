"""The worker's side of job control: everything an execution tells its scheduler.

Executors never reach the scheduler themselves; the job bridge and the job
manager call a ``SchedulerLink`` for them. Tests pass a fake;
``GrpcSchedulerLink`` is the real one (``SchedulerControl`` over a direct or
relayed channel to the scheduler that dispatched the job).

``LogForwarder`` sits between the executor's output and ``AppendLogs``:
lines are queued without blocking (the pipe readers must never stall the
executor), shipped in batches, and when the scheduler cannot keep up the
oldest lines are dropped and the loss is said in a ``system`` line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from hypha.errors import UnavailableError
from hypha.timestamps import to_timestamp
from hypha.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerLink(Protocol):
    """Job-control calls for one execution; failures raise (HyphaError or grpc.aio.AioRpcError)."""

    async def progress(self, report: scheduler_pb2.ProgressReport) -> scheduler_pb2.Directive: ...

    async def next_slice(
        self, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse: ...

    async def metrics(self, report: scheduler_pb2.MetricsReport) -> None: ...

    async def logs(self, lines: Sequence[scheduler_pb2.LogLine]) -> None: ...

    async def status(self, report: scheduler_pb2.JobStatusReport) -> None: ...

    async def close(self) -> None: ...


class ChannelSource(Protocol):
    async def channel(self, peer_id: str, addresses: list[str]) -> Any: ...

    async def invalidate(self, peer_id: str) -> None: ...


class GrpcSchedulerLink:
    """``SchedulerControl`` calls to one scheduler through the worker's ``PeerConnector``."""

    def __init__(
        self,
        connector: ChannelSource,
        scheduler_id: str,
        addresses: Sequence[str] = (),
        *,
        timeout_s: float = 10.0,
        slice_timeout_s: float = 30.0,
    ) -> None:
        self.connector = connector
        self.scheduler_id = scheduler_id
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.slice_timeout_s = slice_timeout_s

    async def _stub(self) -> scheduler_pb2_grpc.SchedulerControlStub:
        channel = await self.connector.channel(self.scheduler_id, self.addresses)
        return scheduler_pb2_grpc.SchedulerControlStub(channel)

    async def _forget_if_down(self, err: grpc.aio.AioRpcError) -> None:
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            await self.connector.invalidate(self.scheduler_id)

    async def progress(self, report: scheduler_pb2.ProgressReport) -> scheduler_pb2.Directive:
        try:
            directive: scheduler_pb2.Directive = await (await self._stub()).ReportProgress(
                report, timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as err:
            await self._forget_if_down(err)
            raise
        return directive

    async def next_slice(self, request: scheduler_pb2.NextSliceRequest) -> scheduler_pb2.NextSliceResponse:
        try:
            response: scheduler_pb2.NextSliceResponse = await (await self._stub()).NextSlice(
                request, timeout=self.slice_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            await self._forget_if_down(err)
            raise
        return response

    async def metrics(self, report: scheduler_pb2.MetricsReport) -> None:
        try:
            await (await self._stub()).ReportMetrics(report, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            await self._forget_if_down(err)
            raise

    async def logs(self, lines: Sequence[scheduler_pb2.LogLine]) -> None:
        try:
            await (await self._stub()).AppendLogs(iter(list(lines)), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            await self._forget_if_down(err)
            raise

    async def status(self, report: scheduler_pb2.JobStatusReport) -> None:
        try:
            await (await self._stub()).ReportJobStatus(report, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            await self._forget_if_down(err)
            raise

    async def close(self) -> None:
        """Channels belong to the connector; nothing to close here."""


#: Local observer of every log line: (job id, stream, line).
LogSink = Callable[[str, str, str], None]


class LogForwarder:
    """Ships one execution's log lines to its scheduler in batches; never blocks the producer."""

    def __init__(
        self,
        link: SchedulerLink,
        job_id: str,
        *,
        worker_id: str = "",
        attempt: int = 0,
        executor: str = "",
        max_pending: int = 10_000,
        batch_max: int = 500,
        max_line_bytes: int = 16_384,
        sink: LogSink | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.job_id = job_id
        self.worker_id = worker_id
        self.attempt = attempt
        #: The executor kind each line is stamped with (``hypha logs`` says who wrote it).
        self.executor = executor
        self.batch_max = batch_max
        self.max_line_bytes = max_line_bytes
        self.sink = sink
        self._clock = clock
        self.max_pending = max_pending
        self._pending: deque[scheduler_pb2.LogLine] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.sent = 0
        self.failures = 0

    def line(self, stream: str, text: str) -> None:
        if len(text.encode(errors="replace")) > self.max_line_bytes:
            text = (
                text.encode(errors="replace")[: self.max_line_bytes].decode(errors="ignore") + " [truncated]"
            )
        if self.sink is not None:
            self.sink(self.job_id, stream, text)
        self._pending.append(
            scheduler_pb2.LogLine(
                job_id=self.job_id,
                stream=stream,
                line=text,
                at=to_timestamp(self._clock()),
                worker_id=self.worker_id,
                attempt=self.attempt,
                executor=self.executor,
            )
        )
        self._trim()
        self._wake.set()

    def _trim(self) -> None:
        """Drop the oldest lines beyond the bound: the newest say most about a job's state."""
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.dropped += 1

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"logs-{self.job_id}")

    async def _run(self) -> None:
        failures_in_row = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                if not await self._ship():
                    failures_in_row += 1
                    if self._closing:
                        return
                    # The scheduler is away: keep the (bounded) backlog and try again later.
                    try:
                        async with asyncio.timeout(min(0.5 * 2**failures_in_row, 10.0)):
                            while not self._closing:
                                await self._wake.wait()
                                self._wake.clear()
                    except TimeoutError:
                        pass
                    continue
                failures_in_row = 0
            if self._closing:
                return

    async def _ship(self) -> bool:
        dropped, self.dropped = self.dropped, 0
        batch = [self._pending.popleft() for _ in range(min(self.batch_max, len(self._pending)))]
        outgoing = batch
        if dropped:
            notice = scheduler_pb2.LogLine(
                job_id=self.job_id,
                stream="system",
                line=f"[{dropped} log lines dropped: the scheduler did not keep up]",
                worker_id=self.worker_id,
                attempt=self.attempt,
            )
            outgoing = [notice, *batch]
        try:
            await self.link.logs(outgoing)
        except Exception as err:
            self.failures += 1
            expected = isinstance(err, grpc.aio.AioRpcError | UnavailableError | OSError)
            log.log(
                logging.DEBUG if expected else logging.WARNING,
                "job %s: shipping %d log lines failed: %r",
                self.job_id,
                len(outgoing),
                err,
            )
            # Put the lines back (oldest first out if over the bound) and owe the notice again.
            self._pending.extendleft(reversed(batch))
            self.dropped += dropped
            self._trim()
            return False
        self.sent += len(batch)
        return True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is left (bounded by ``timeout_s``), then stop."""
        self._closing = True
        self._wake.set()
        if self._task is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._task)
        except TimeoutError:
            log.warning("job %s: %d log lines not delivered", self.job_id, len(self._pending))
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
