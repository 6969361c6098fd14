"""The scheduler's calls to a worker's ``hypha.v1.Worker`` service, for the jobs it runs there.

Every call goes through the peer connector (a direct channel, or one relayed
through a gateway when the worker cannot be reached), with a deadline from
``[scheduler.jobs]``. The market makes its own calls (accept, renew, release)
with ``worker_stub`` too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import grpc

from hypha.errors import HyphaError
from hypha.net.connector import PeerConnector
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.retry import AttemptEnd, Outcome, attempt_end
from hypha.tensors.chunks import ChunkAssembler, split_payload
from hypha.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

#: ``PullTensors`` kind a worker streams a finished job's result files under.
RESULT_KIND = "result"

#: Worker-side execution end states, as the report states the scheduler receives.
STATUS_TO_REPORT: dict[int, int] = {
    worker_pb2.EXECUTION_STATE_SUCCEEDED: scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED,
    worker_pb2.EXECUTION_STATE_FAILED: scheduler_pb2.EXECUTION_STATE_REPORT_FAILED,
    worker_pb2.EXECUTION_STATE_CANCELLED: scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED,
    worker_pb2.EXECUTION_STATE_TIMED_OUT: scheduler_pb2.EXECUTION_STATE_REPORT_TIMED_OUT,
}
FINAL_REPORTS = frozenset(STATUS_TO_REPORT.values())


async def worker_stub(
    connector: PeerConnector, worker_id: str, addresses: Sequence[str]
) -> worker_pb2_grpc.WorkerStub:
    """A stub on the connector's channel to ``worker_id`` (direct or relayed)."""
    return worker_pb2_grpc.WorkerStub(await connector.channel(worker_id, list(addresses)))


class WorkerCalls:
    """Dispatch, cancel, poll and pull results on the workers the scheduler leased."""

    def __init__(
        self,
        connector: PeerConnector,
        addresses: Callable[[str], Sequence[str]],
        section: SchedulerSection,
    ) -> None:
        self.connector = connector
        self.addresses = addresses
        self.section = section

    async def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        return await worker_stub(self.connector, worker_id, self.addresses(worker_id))

    async def dispatch(self, worker_id: str, request: worker_pb2.DispatchJobRequest) -> None:
        """``DispatchJob``; an unreachable worker's channel is dropped so the next call reconnects."""
        stub = await self.stub(worker_id)
        try:
            await stub.DispatchJob(request, timeout=self.section.jobs.dispatch_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                await self.connector.invalidate(worker_id)
            raise

    async def cancel(self, worker_id: str, job_id: str) -> None:
        """Best effort ``CancelJob``: releasing the lease ends the execution on the worker anyway."""
        try:
            stub = await self.stub(worker_id)
            await stub.CancelJob(
                worker_pb2.CancelExecutionRequest(job_id=job_id, reason="job ended"),
                timeout=self.section.jobs.cancel_timeout_s,
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            log.debug("cancelling job %s on %s failed: %s", job_id, worker_id, describe(err))

    async def poll_status(self, worker_id: str, job_id: str) -> AttemptEnd | None:
        """The execution's end if ``GetJobStatus`` says it ended (None: running or unreachable)."""
        try:
            stub = await self.stub(worker_id)
            status = await stub.GetJobStatus(
                worker_pb2.GetJobStatusRequest(job_id=job_id), timeout=self.section.rpc_timeout_s
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.NOT_FOUND:
                return (Outcome.WORKER_LOST, -1, f"worker {worker_id} no longer knows the job")
            return None
        report = STATUS_TO_REPORT.get(int(status.state))
        return None if report is None else attempt_end(report, int(status.exit_code), status.message)

    async def result_stream(
        self, worker_id: str, job_id: str, timeout_s: float
    ) -> AsyncIterator[worker_pb2.TensorChunk]:
        """The job's result files as ``PullTensors`` streams them."""
        stub = await self.stub(worker_id)
        async for piece in stub.PullTensors(
            worker_pb2.PullTensorsRequest(job_id=job_id, kind=RESULT_KIND), timeout=timeout_s
        ):
            yield piece

    async def pull_tensors(
        self, worker_id: str, job_id: str, kind: str, round_: int, timeout_s: float, max_bytes: int
    ) -> bytes:
        """One published payload of the job (a parameter server's state), verified chunk by chunk."""
        stub = await self.stub(worker_id)
        assembler = ChunkAssembler(max_bytes=max_bytes)
        call = stub.PullTensors(
            worker_pb2.PullTensorsRequest(job_id=job_id, kind=kind, round=round_), timeout=timeout_s
        )
        async for piece in call:
            assembler.feed(piece.chunk)
        return assembler.finish()

    async def push_tensors(
        self, worker_id: str, job_id: str, kind: str, round_: int, payload: bytes, timeout_s: float
    ) -> worker_pb2.PushTensorsResponse:
        """Push one payload into the job's inbox on ``worker_id`` (a replacement server's state)."""
        stub = await self.stub(worker_id)

        def messages() -> Iterator[worker_pb2.TensorChunk]:
            first = True
            for chunk in split_payload(payload, content_type="application/safetensors"):
                message = worker_pb2.TensorChunk(chunk=chunk)
                if first:
                    message.job_id, message.kind, message.round = job_id, kind, round_
                    first = False
                yield message

        return await stub.PushTensors(messages(), timeout=timeout_s)


def is_refusal(err: BaseException) -> bool:
    """Errors that retrying cannot fix (everything else, NOT_FOUND included, is retried)."""
    if isinstance(err, grpc.aio.AioRpcError):
        return err.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
    return isinstance(err, HyphaError) and err.status in (
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    )


#: A worker's answers to a dispatch that mean it refuses the job itself (its policy, a malformed
#: spec): every worker would, so the job fails at once instead of being retried elsewhere.
REFUSALS = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT})


def describe(err: BaseException) -> str:
    """An error as one short line for a job's reason or a log."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name} {err.details() or ''}".strip()
    if isinstance(err, HyphaError):
        return err.message
    return repr(err)


__all__ = [
    "FINAL_REPORTS",
    "REFUSALS",
    "RESULT_KIND",
    "STATUS_TO_REPORT",
    "WorkerCalls",
    "describe",
    "is_refusal",
    "worker_stub",
]
