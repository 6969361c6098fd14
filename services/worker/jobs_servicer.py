"""The job half of the ``Worker`` service: dispatch, cancel, status, and tensor transfer.

Thin like every servicer here: the caller's peer id comes from the TLS
session (or the relay's stamp), requests become domain values
(``JobDispatch``), the job manager and the tensor exchange decide, and the
server guard maps domain errors to statuses. The worker's servicer composes
this class with the market's lease calls (see ``docs/job-bridge.md``).

A dispatch is only taken under a lease the calling scheduler holds
(``lease_ok``), and for an executor kind the worker offers; a cancel only
reaches jobs the calling scheduler dispatched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from hypha.errors import FailedPreconditionError
from hypha.net.auth import peer_identity
from hypha.v1 import worker_pb2
from hypha.worker.job_state import ExecutionRecord, JobDispatch
from hypha.worker.jobs import JobManager
from hypha.worker.transfer import TensorExchange

#: (lease id, scheduler peer id) -> whether that scheduler holds that lease, active, on this worker.
LeaseCheck = Callable[[str, str], bool]


def status_proto(record: ExecutionRecord) -> worker_pb2.WorkerJobStatus:
    status = worker_pb2.WorkerJobStatus(
        job_id=record.job_id,
        state=record.state.to_proto(),
        exit_code=record.exit_code or 0,
        message=record.message,
    )
    if record.started_at is not None:
        status.started_at.CopyFrom(_stamp(record.started_at))
    if record.finished_at is not None:
        status.finished_at.CopyFrom(_stamp(record.finished_at))
    return status


def _stamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class WorkerJobs:
    """Handlers with the generated ``WorkerServicer`` signatures, for the worker's servicer to delegate to."""

    def __init__(
        self,
        manager: JobManager,
        exchange: TensorExchange,
        *,
        lease_ok: LeaseCheck,
        executors: Collection[str] | None = None,
    ) -> None:
        self.manager = manager
        self.exchange = exchange
        self.lease_ok = lease_ok
        self.executors = frozenset(executors) if executors is not None else None

    async def DispatchJob(
        self, request: worker_pb2.DispatchJobRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DispatchJobResponse:
        scheduler = peer_identity(context).peer_id
        dispatch = JobDispatch.from_proto(request, scheduler)
        if self.executors is not None and dispatch.executor.value not in self.executors:
            raise FailedPreconditionError(f"this worker does not run {dispatch.executor.value} executors")
        if not self.lease_ok(dispatch.lease_id, scheduler):
            raise FailedPreconditionError(f"lease {dispatch.lease_id!r} is not an active lease of the caller")
        record = await self.manager.dispatch(dispatch)
        return worker_pb2.DispatchJobResponse(execution_id=record.execution_id)

    async def CancelJob(
        self, request: worker_pb2.CancelExecutionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelJobResponse:
        scheduler = peer_identity(context).peer_id
        cancelled = await self.manager.cancel(
            request.job_id, request.reason or "cancelled by the scheduler", scheduler_id=scheduler
        )
        return worker_pb2.CancelJobResponse(cancelled=cancelled)

    async def GetJobStatus(
        self, request: worker_pb2.GetJobStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerJobStatus:
        return status_proto(self.manager.get(request.job_id))

    async def PushTensors(
        self, request_iterator: AsyncIterator[worker_pb2.TensorChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        sender = peer_identity(context).peer_id
        return await self.exchange.receive(request_iterator, sender)

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TensorChunk]:
        peer_identity(context)  # authenticated workers only (the guard checks the role)
        async for chunk in self.exchange.serve_pull(request, context.time_remaining()):
            yield chunk

    def job_statuses(self) -> list[worker_pb2.WorkerJobStatus]:
        """Every execution this worker knows (live first), for ``GetStatus``."""
        return [status_proto(record) for record in self.manager.records()]


class WorkerJobsMixin:
    """Delegates the job RPCs of the generated ``WorkerServicer`` to ``self.jobs``.

    Compose it in front of the generated base: ``class WorkerServicer(WorkerJobsMixin,
    worker_pb2_grpc.WorkerServicer)`` and set ``self.jobs = WorkerJobs(...)`` in ``__init__``.
    """

    jobs: WorkerJobs

    async def DispatchJob(
        self, request: worker_pb2.DispatchJobRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DispatchJobResponse:
        return await self.jobs.DispatchJob(request, context)

    async def CancelJob(
        self, request: worker_pb2.CancelExecutionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelJobResponse:
        return await self.jobs.CancelJob(request, context)

    async def GetJobStatus(
        self, request: worker_pb2.GetJobStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerJobStatus:
        return await self.jobs.GetJobStatus(request, context)

    async def PushTensors(
        self, request_iterator: AsyncIterator[worker_pb2.TensorChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        return await self.jobs.PushTensors(request_iterator, context)

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TensorChunk]:
        # An async generator itself: the server guard wraps stream handlers by their kind.
        async for chunk in self.jobs.PullTensors(request, context):
            yield chunk


__all__ = ["LeaseCheck", "WorkerJobs", "WorkerJobsMixin", "status_proto"]
