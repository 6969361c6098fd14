"""``SchedulerControl``: what workers tell the scheduler, and what it answers.

Thin by design: the caller's peer id comes from the TLS session (or the
relay's gateway stamp), never from a message field, and every call is handed
to the market (offers) or to the job control (everything about running
jobs: progress, slices, metrics, status, logs), which decides. Only workers
may call this service (``hypha.net.policy``); the job control further
checks that the caller works on the job it names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from hypha.market.policies import OfferView
from hypha.net.auth import peer_identity
from hypha.scheduler.market import SchedulerMarket
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

#: Log lines handed to the job control at once while a stream is read.
LOG_BATCH = 500


class JobControl(Protocol):
    """What the orchestrator does for workers; ``worker_id`` is always the authenticated caller."""

    async def report_progress(
        self, worker_id: str, report: scheduler_pb2.ProgressReport
    ) -> scheduler_pb2.Directive: ...

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse: ...

    async def report_metrics(self, worker_id: str, report: scheduler_pb2.MetricsReport) -> None: ...

    async def report_job_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None: ...

    async def append_logs(self, worker_id: str, lines: Sequence[scheduler_pb2.LogLine]) -> None: ...


class SchedulerControlServicer(scheduler_pb2_grpc.SchedulerControlServicer):
    def __init__(self, market: SchedulerMarket, jobs: JobControl) -> None:
        self.market = market
        self.jobs = jobs

    async def SubmitOffer(
        self, request: common_pb2.Offer, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitOfferResponse:
        # NOTE: the offer's worker_id field is ignored: only the session says who offers.
        worker = peer_identity(context)
        offer = OfferView.from_proto(request, worker_id=worker.peer_id)
        return scheduler_pb2.SubmitOfferResponse(received=self.market.submit_offer(offer, name=worker.name))

    async def ReportProgress(
        self, request: scheduler_pb2.ProgressReport, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Directive:
        return await self.jobs.report_progress(peer_identity(context).peer_id, request)

    async def NextSlice(
        self, request: scheduler_pb2.NextSliceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.NextSliceResponse:
        return await self.jobs.next_slice(peer_identity(context).peer_id, request)

    async def ReportMetrics(
        self, request: scheduler_pb2.MetricsReport, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.MetricsAck:
        await self.jobs.report_metrics(peer_identity(context).peer_id, request)
        return scheduler_pb2.MetricsAck()

    async def ReportJobStatus(
        self, request: scheduler_pb2.JobStatusReport, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.JobStatusAck:
        await self.jobs.report_job_status(peer_identity(context).peer_id, request)
        return scheduler_pb2.JobStatusAck()

    async def AppendLogs(
        self, request_iterator: AsyncIterator[scheduler_pb2.LogLine], context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LogsAck:
        worker = peer_identity(context)
        worker_id = worker.peer_id
        batch: list[scheduler_pb2.LogLine] = []
        count = 0
        async for line in request_iterator:
            # NOTE: whatever the line says, it comes from the caller.
            line.worker_id = worker_id
            line.worker_name = worker.name
            batch.append(line)
            if len(batch) >= LOG_BATCH:
                await self.jobs.append_logs(worker_id, batch)
                count += len(batch)
                batch = []
        if batch:
            await self.jobs.append_logs(worker_id, batch)
            count += len(batch)
        return scheduler_pb2.LogsAck(lines=count)
