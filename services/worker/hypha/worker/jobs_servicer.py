"""The job half of the ``Worker`` service: dispatch, cancel, status, and tensor transfer.

Thin like every servicer here: the caller's peer id comes from the TLS
session (or the relay's stamp), requests become domain values
(``JobDispatch``), the job manager and the tensor exchange decide, and the
server guard maps domain errors to statuses. The worker's servicer composes
this class with the market's lease calls (see ``docs/job-bridge.md``).

A dispatch is only taken under a lease the calling scheduler holds
(``lease_ok``), for an executor kind the worker offers, and for a job id no
other scheduler dispatched here, live or ended (``job_scope``); a cancel only
reaches jobs the calling scheduler dispatched. Workers move a job's tensors
only when the job's dispatch names them (``job_scope.check_member``).

Tensors move between workers, with one exception: a parameter server's
packed state (kind ``ps-state``) goes to and from the scheduler that
dispatched it, which pulls it after every round and pushes it to a
replacement server (``docs/fault-tolerance.md``). Nobody else may send that
kind, and a scheduler may move no other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection

import grpc

from hypha.errors import FailedPreconditionError, PermissionDeniedError
from hypha.market.resources import ExecutorKind
from hypha.net.auth import peer_identity
from hypha.pki.identity import Role
from hypha.timestamps import to_timestamp
from hypha.v1 import worker_pb2
from hypha.worker.execution_state import ExecutionRecord, JobDispatch
from hypha.worker.job_manager import JobManager
from hypha.worker.job_scope import JobOwners, check_member
from hypha.worker.tensor_frames import Pushed
from hypha.worker.transfer import TensorExchange

#: Tensor kind of a parameter server's packed state (``executors.parameter_server.STATE_KIND``).
STATE_KIND = "ps-state"
#: Tensor kind of an inference job's model, a finished job's result (``executors.inference.MODEL_KIND``).
MODEL_KIND = "model"
#: What a scheduler may move, and the execution of its own dispatch it may move it to or from.
SCHEDULER_KINDS = {STATE_KIND: ExecutorKind.PARAMETER_SERVER, MODEL_KIND: ExecutorKind.INFERENCE}

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
        status.started_at.CopyFrom(to_timestamp(record.started_at))
    if record.finished_at is not None:
        status.finished_at.CopyFrom(to_timestamp(record.finished_at))
    return status


class WorkerJobs:
    """Handlers with the generated ``WorkerServicer`` signatures, for the worker's servicer to delegate to."""

    def __init__(
        self,
        manager: JobManager,
        exchange: TensorExchange,
        *,
        lease_ok: LeaseCheck,
        executors: Collection[str] | None = None,
        owners: JobOwners | None = None,
    ) -> None:
        self.manager = manager
        #: Which scheduler each job id here belongs to, after its executions ended too.
        self.owners = owners or JobOwners()
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
        self.owners.claim(dispatch.job_id, scheduler, self.manager.live_dispatches(dispatch.job_id))
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
        self, request_iterator: AsyncIterator[Pushed], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        sender = peer_identity(context)
        messages = self._checked(request_iterator, sender.peer_id, sender.role is Role.SCHEDULER)
        return await self.exchange.receive(messages, sender.peer_id)

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        caller = peer_identity(context)  # authenticated workers and schedulers (the guard checks)
        if caller.role is Role.SCHEDULER:
            self._check_state_peer(request.job_id, request.kind, caller.peer_id)
        else:
            check_member(self.manager.live_dispatches(request.job_id), request.job_id, caller.peer_id)
        async for chunk in self.exchange.serve_pull(request, context.time_remaining()):
            yield chunk

    async def _checked(
        self, messages: AsyncIterator[Pushed], sender: str, from_scheduler: bool
    ) -> AsyncIterator[Pushed]:
        """The pushed stream, refused at its first message if the sender may not send its kind."""
        first = True
        async for message in messages:
            if first:
                first = False
                if from_scheduler:
                    self._check_state_peer(message.job_id, message.kind, sender)
                elif message.kind in SCHEDULER_KINDS:
                    raise PermissionDeniedError(
                        f"only the dispatching scheduler sends {message.kind!r} tensors"
                    )
                else:
                    check_member(self.manager.live_dispatches(message.job_id), message.job_id, sender)
            yield message

    def _check_state_peer(self, job_id: str, kind: str, scheduler: str) -> None:
        executor = SCHEDULER_KINDS.get(kind)
        if executor is None:
            allowed = ", ".join(repr(k) for k in SCHEDULER_KINDS)
            raise PermissionDeniedError(f"a scheduler moves only {allowed} tensors, not {kind!r}")
        if self.manager.dispatched_by(job_id, executor) != scheduler:
            raise PermissionDeniedError(
                f"no {executor.value} execution of job {job_id!r} that {scheduler} dispatched runs here"
            )

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
        self, request_iterator: AsyncIterator[Pushed], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        return await self.jobs.PushTensors(request_iterator, context)

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # An async generator itself: the server guard wraps stream handlers by their kind.
        async for chunk in self.jobs.PullTensors(request, context):
            yield chunk


__all__ = ["STATE_KIND", "LeaseCheck", "WorkerJobs", "WorkerJobsMixin", "status_proto"]
