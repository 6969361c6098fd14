"""The ``Worker`` gRPC service: the market's lease calls, the job calls, and the status view.

Thin by design: the caller's peer id comes from the TLS session (or the
relay's gateway stamp), the request becomes domain arguments, the market or
the job half (``WorkerJobs``: dispatch, cancel, status, tensor transfer)
decides, and domain errors map to statuses in the server guard.

Results: a finished job's artefacts (the parameter server's model
directory, kept by the job manager) leave the worker through
``PullTensors`` with kind ``result``: every file of the directory in turn,
its first chunk naming it (metadata ``path``, relative) and its last
carrying its sha256. Only the scheduler that dispatched the job may pull it.
The job wrote that directory: ``hypha.filesend.send_dir`` reads it without
following a link, and a link or special file in it refuses the whole result
(FAILED_PRECONDITION, naming it).
NOTE: ``Worker`` has no dedicated result RPC in the contract; the tensor
stream already has chunking, checksums and relay support, so it carries the
files.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from hypha.errors import NotFoundError, PermissionDeniedError
from hypha.filesend import send_dir
from hypha.market.resources import ExecutorKind
from hypha.net.auth import peer_identity
from hypha.pki.identity import Role
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hypha.worker.jobs_servicer import STATE_KIND, WorkerJobs
from hypha.worker.market import WorkerMarket
from hypha.worker.tensor_frames import Pushed

#: ``PullTensors`` kind that streams a finished job's result files.
RESULT_KIND = "result"

#: (job id) -> (result dir, id of the scheduler that dispatched the job), or None.
ResultLookup = Callable[[str], "tuple[Path, str] | None"]


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        market: WorkerMarket,
        name: str = "",
        jobs: WorkerJobs | None = None,
        results: ResultLookup | None = None,
    ) -> None:
        self.market = market
        self.name = name
        self.jobs = jobs
        self.results = results

    # ---- leases -------------------------------------------------------------------------

    async def AcceptOffer(
        self, request: worker_pb2.AcceptOfferRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Lease:
        holder = peer_identity(context).peer_id
        lease = self.market.accept_offer(request.offer_id, holder, request.lease_ttl_s)
        return lease.to_proto(worker_id=self.market.peer_id)

    async def ReleaseOffer(
        self, request: worker_pb2.ReleaseOfferRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseOfferResponse:
        holder = peer_identity(context).peer_id
        return worker_pb2.ReleaseOfferResponse(released=self.market.release_offer(request.offer_id, holder))

    async def RenewLease(
        self, request: worker_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Lease:
        holder = peer_identity(context).peer_id
        lease = self.market.renew_lease(request.lease_id, holder, request.lease_ttl_s)
        return lease.to_proto(worker_id=self.market.peer_id)

    async def ReleaseLease(
        self, request: worker_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseLeaseResponse:
        holder = peer_identity(context).peer_id
        return worker_pb2.ReleaseLeaseResponse(released=self.market.release_lease(request.lease_id, holder))

    # ---- jobs ---------------------------------------------------------------------------

    def _jobs(self) -> WorkerJobs:
        if self.jobs is None:
            raise NotFoundError("this worker runs no jobs")
        return self.jobs

    async def DispatchJob(
        self, request: worker_pb2.DispatchJobRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DispatchJobResponse:
        return await self._jobs().DispatchJob(request, context)

    async def CancelJob(
        self, request: worker_pb2.CancelExecutionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelJobResponse:
        return await self._jobs().CancelJob(request, context)

    async def GetJobStatus(
        self, request: worker_pb2.GetJobStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerJobStatus:
        return await self._jobs().GetJobStatus(request, context)

    async def PushTensors(
        self, request_iterator: AsyncIterator[Pushed], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        return await self._jobs().PushTensors(request_iterator, context)

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | worker_pb2.TensorChunk]:
        caller = peer_identity(context)
        if request.kind == RESULT_KIND:
            async for chunk in self._result_chunks(request.job_id, caller.peer_id):
                yield chunk
            return
        if caller.role is not Role.WORKER and request.kind != STATE_KIND:
            raise PermissionDeniedError("only workers pull tensors; schedulers pull results and states")
        async for frame in self._jobs().PullTensors(request, context):
            yield frame

    async def _result_chunks(self, job_id: str, caller: str) -> AsyncIterator[worker_pb2.TensorChunk]:
        found = self.results(job_id) if self.results is not None else None
        if found is None:
            raise NotFoundError(f"job {job_id!r} left no result on this worker")
        directory, scheduler_id = found
        if caller != scheduler_id:
            raise PermissionDeniedError(
                f"only the scheduler that dispatched job {job_id!r} may pull its result"
            )
        sent = False
        async for _, chunk in send_dir(directory, label=f"the result of job {job_id!r}"):
            sent = True
            yield worker_pb2.TensorChunk(job_id=job_id, kind=RESULT_KIND, chunk=chunk)
        if not sent:
            raise NotFoundError(f"the result of job {job_id!r} is empty")

    # ---- status ---------------------------------------------------------------------------

    async def GetStatus(
        self, request: worker_pb2.GetWorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        status = self.market.status()
        section = self.market.section
        return worker_pb2.WorkerStatus(
            peer_id=self.market.peer_id,
            name=self.name,
            capacity=status.capacity.to_proto(),
            free=status.free.to_proto(),
            leases=[lease.to_proto(worker_id=self.market.peer_id) for lease in status.leases],
            jobs=self.jobs.job_statuses() if self.jobs is not None else [],
            executors=[ExecutorKind.parse(name).to_proto() for name in section.executors],
            price=section.price,
            floor=section.floor,
        )
