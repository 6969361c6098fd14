"""The scheduler's client API (``hypha.v1.Scheduler``): jobs in, progress and results out.

``SchedulerServicer`` serves the RPCs on top of the job store and a
``JobDriver``, the part that actually queues, leases, dispatches and drives
jobs (``hypha.scheduler.orchestrator.Orchestrator``, wired in by the
scheduler app). The API only records and reports: a submitted job is
checked (``JobDriver.admit``: what only the running scheduler can know,
such as whether a data node announces the dataset; a task's files bundle is
checked and kept by its sha256 in ``bundles``), persisted PENDING and
handed to ``JobDriver.submit``; a cancelled job is
marked CANCELLED *first* (so orchestration's own conditional updates to
RUNNING fail from then on) and then ``JobDriver.cancel`` frees its workers.

Every method has a transport-neutral form taking the caller's
``PeerIdentity`` (used by the REST mirror) and the gRPC form reading it from
the TLS session. Who may do what (``NOTE``):

- Only CLIENT and ADMIN certificates reach the API (the server guard's
  policy; checked again here for the REST path).
- Every client sees every job of this scheduler (it serves one organisation's
  users; the submitter is recorded and shown), but a task's ``env`` values
  only if it submitted the job or is an admin: every job view is built by
  ``JobRecord.to_proto(viewer)``, which redacts them for anyone else.
- Cancelling and scaling (``ScaleJob``) are for the job's submitter or an admin. ``cancel --all``
  cancels the caller's own active jobs, or every active job for an admin.

``WatchJob`` and ``GetLogs --follow`` stream from the store's event feed:
they wake on commits, never poll. ``FetchResult`` streams each result file
in chunks of at most 1 MiB, each file's last chunk carrying its sha256, through
``hypha.filesend.send_dir``: a link or special file in the result refuses it
(FAILED_PRECONDITION, naming it), nothing of it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

import grpc

from hypha.bundles import BundleStore
from hypha.errors import (
    FailedPreconditionError,
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from hypha.filesend import send_dir
from hypha.jobfile import normalize_spec, parse_job_toml
from hypha.jobfile.kinds import kind_of
from hypha.net.auth import peer_identity
from hypha.pki.identity import PeerIdentity, Role
from hypha.scheduler.lifecycle import ACTIVE, JobState, Reason
from hypha.scheduler.metrics import SchedulerMetrics
from hypha.scheduler.records import JobEventRecord, JobRecord, WorkerMetric
from hypha.scheduler.store import JobStore
from hypha.tensors.chunks import DEFAULT_CHUNK_SIZE
from hypha.timestamps import to_timestamp
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

OPERATORS = frozenset({Role.CLIENT, Role.ADMIN})


class JobDriver(Protocol):
    """What the API needs from the part that runs jobs (the orchestrator)."""

    async def admit(self, spec: common_pb2.JobSpec) -> None:
        """Refuse, with the real reason, a job the scheduler already knows cannot run
        (a dataset no data node announces); called before the job is stored."""

    async def submit(self, job: JobRecord) -> None:
        """Take over a PENDING job (queue it). Returns at once; progress goes to the store.

        Raising a HyphaError (e.g. ResourceExhaustedError: queue full) refuses
        the job: the API marks it FAILED with that message and returns the error.
        """

    async def cancel(self, job_id: str) -> None:
        """Free what a job holds (dispatched work, leases). The API has already
        marked it CANCELLED in the store, so orchestration's own conditional
        updates fail from then on; this must not change the job's state."""

    async def scale(self, job_id: str, workers: int) -> None:
        """Grow or shrink a running DiLoCo job; refuses (with the reason) any other job."""

    async def list_workers(self) -> list[scheduler_pb2.WorkerView]:
        """The workers this scheduler holds leases on."""

    async def fetch_result(self, job_id: str) -> Path:
        """A file or directory holding a SUCCEEDED job's result (e.g. model.safetensors + config.json)."""


def require_operator(caller: PeerIdentity) -> None:
    if caller.role not in OPERATORS:
        raise PermissionDeniedError(f"role {caller.role.value} may not use the client API")


def job_event(
    job: JobRecord,
    viewer: PeerIdentity | None,
    *,
    at: float,
    message: str,
    workers: Sequence[WorkerMetric] = (),
) -> scheduler_pb2.JobEvent:
    """One ``WatchJob`` event, the job as ``viewer`` may see it."""
    return scheduler_pb2.JobEvent(
        job=job.to_proto(viewer),
        at=to_timestamp(at),
        message=message,
        workers=[w.to_proto() for w in workers],
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        store: JobStore,
        orchestrator: JobDriver,
        *,
        metrics: SchedulerMetrics | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        bundles: BundleStore | None = None,
    ) -> None:
        """``bundles``: where task jobs' files are kept (None: jobs that ship files are refused)."""
        if not 0 < chunk_size <= DEFAULT_CHUNK_SIZE:
            raise InvalidArgumentError(f"chunk_size must be in (0, {DEFAULT_CHUNK_SIZE}]")
        self.store = store
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.bundles = bundles

    # ---- transport-neutral operations ----------------------------------------------------

    async def submit(self, caller: PeerIdentity, request: scheduler_pb2.SubmitJobRequest) -> JobRecord:
        require_operator(caller)
        source = request.WhichOneof("source")
        if source == "toml":
            spec = parse_job_toml(request.toml)
        elif source == "spec":
            spec = normalize_spec(request.spec)
        else:
            raise InvalidArgumentError("submit: set toml or spec")
        return await self.submit_spec(caller, spec, request.files_bundle)

    async def submit_spec(
        self, caller: PeerIdentity, spec: common_pb2.JobSpec, files_bundle: bytes = b""
    ) -> JobRecord:
        """Persist a validated spec (with its task files) as a PENDING job and hand it to orchestration."""
        require_operator(caller)
        await self._attach_files(spec, files_bundle)
        await self.orchestrator.admit(spec)
        job = await self.store.create(spec, submitted_by=caller.peer_id)
        log.info("job %s (%s) submitted by %s", job.job_id, job.kind, caller.name or caller.peer_id)
        if self.metrics is not None:
            self.metrics.jobs_submitted.inc()
        try:
            await self.orchestrator.submit(job)
        except HyphaError as err:
            with contextlib.suppress(HyphaError):
                await self.store.transition(job.job_id, JobState.FAILED, reason=f"refused: {err.message}")
            raise
        return await self.store.get(job.job_id)

    async def _attach_files(self, spec: common_pb2.JobSpec, files_bundle: bytes) -> None:
        """Keep a task's files bundle and name it (sha256, size) in the spec."""
        kind = kind_of(spec)
        task = kind.files(spec) if kind is not None else None
        if task is not None:  # only the scheduler names a bundle: one it has checked and kept
            task.files_sha256, task.files_size = "", 0
        if task is None or not (files_bundle or task.files):
            if files_bundle:
                raise InvalidArgumentError("files_bundle: only task jobs ship files")
            return
        if not files_bundle:
            raise InvalidArgumentError(
                "job.files: declared, but no files came with the job (hypha submit packs them)"
            )
        if self.bundles is None:
            raise FailedPreconditionError("this scheduler keeps no task files")
        task.files_sha256 = await asyncio.to_thread(self.bundles.put, files_bundle)
        task.files_size = len(files_bundle)

    async def get(self, caller: PeerIdentity, job_id: str) -> JobRecord:
        require_operator(caller)
        if not job_id:
            raise InvalidArgumentError("job_id: missing")
        return await self.store.get(job_id)

    async def job_metrics(self, caller: PeerIdentity, job_id: str) -> scheduler_pb2.JobMetrics:
        """Every per-round figure the job's workers reported (training loss, throughput, tensor bytes)."""
        await self.get(caller, job_id)  # the same checks, and NOT_FOUND for an unknown job
        return scheduler_pb2.JobMetrics(
            points=[
                scheduler_pb2.MetricPoint(
                    round=m.round, worker_id=m.worker_id, name=m.name, value=m.value, at=to_timestamp(m.at)
                )
                for m in await self.store.metrics(job_id)
            ]
        )

    async def list_jobs(
        self, caller: PeerIdentity, states: Sequence[JobState] = (), kind: str = ""
    ) -> list[JobRecord]:
        require_operator(caller)
        return await self.store.list_jobs(states or None, kind=kind or None)

    async def cancel(self, caller: PeerIdentity, job_id: str = "", all_jobs: bool = False) -> list[str]:
        """Cancel one job (an error if it already ended) or all active ones; returns the ids cancelled."""
        require_operator(caller)
        if all_jobs == bool(job_id):
            raise InvalidArgumentError("cancel: give either a job_id or all")
        reason = Reason.CANCELLED.format(who=caller.name or caller.peer_id)
        if job_id:
            job = await self.store.get(job_id)
            self._check_owner(caller, job)
            await self._cancel(job, reason)
            return [job_id]
        owner = None if caller.role is Role.ADMIN else caller.peer_id
        cancelled = []
        for job in await self.store.list_jobs(ACTIVE, submitted_by=owner, limit=1_000_000):
            try:
                await self._cancel(job, reason)
            except FailedPreconditionError:
                continue  # it ended (or moved) meanwhile
            cancelled.append(job.job_id)
        return cancelled

    async def _cancel(self, job: JobRecord, reason: str) -> None:
        # The store first: from here on orchestration cannot move the job to RUNNING.
        await self.store.transition(job.job_id, JobState.CANCELLED, reason=reason)
        try:
            await self.orchestrator.cancel(job.job_id)
        except Exception:  # the job is cancelled either way; its leases lapse on their own
            log.exception("orchestrator failed to release job %s", job.job_id)

    async def scale(self, caller: PeerIdentity, job_id: str, workers: int) -> JobRecord:
        """Grow or shrink a running DiLoCo job to ``workers`` trainers (its submitter or an admin)."""
        require_operator(caller)
        if not job_id:
            raise InvalidArgumentError("job_id: missing")
        if workers < 1:
            raise InvalidArgumentError(f"workers: a job needs at least 1 trainer, got {workers}")
        job = await self.store.get(job_id)
        self._check_owner(caller, job, "scale")
        await self.orchestrator.scale(job_id, workers)
        return await self.store.get(job_id)

    def _check_owner(self, caller: PeerIdentity, job: JobRecord, action: str = "cancel") -> None:
        if caller.role is not Role.ADMIN and job.submitted_by != caller.peer_id:
            raise PermissionDeniedError(
                f"job {job.job_id} was submitted by someone else; only they or an admin may {action} it"
            )

    async def workers(self, caller: PeerIdentity) -> list[scheduler_pb2.WorkerView]:
        require_operator(caller)
        return list(await self.orchestrator.list_workers())

    async def watch(self, caller: PeerIdentity, job_id: str) -> AsyncIterator[scheduler_pb2.JobEvent]:
        """The job as it is now, then every change, until it reaches a final state."""
        require_operator(caller)
        feed, key = self.store.feed, f"job:{job_id}"
        token = feed.token(key)  # before reading: no change can slip between read and wait
        job = await self.store.get(job_id)
        last_seq = await self.store.last_event_seq(job_id)
        yield job_event(
            job,
            caller,
            at=job.updated_at,
            message=job.reason,
            workers=await self.store.worker_metrics(job_id),
        )
        if job.state.terminal:
            return
        while True:
            events = await self.store.events(job_id, after=last_seq)
            if not events:
                await token.wait()
                token = feed.token(key)
                continue
            job = await self.store.get(job_id)
            for event in events:
                last_seq = event.seq
                yield self._event(job, event, caller)
                if event.kind == "state" and event.state.terminal:
                    return
            token = feed.token(key)

    @staticmethod
    def _event(job: JobRecord, event: JobEventRecord, viewer: PeerIdentity) -> scheduler_pb2.JobEvent:
        at_event = dataclasses.replace(
            job,
            state=event.state,
            round=event.round,
            loss=event.loss,
            reason=event.message if event.kind == "state" else job.reason,
        )
        return job_event(at_event, viewer, at=event.at, message=event.message, workers=event.workers)

    async def logs(
        self, caller: PeerIdentity, job_id: str, follow: bool = False
    ) -> AsyncIterator[scheduler_pb2.LogLine]:
        """The job's kept log lines; with ``follow``, new ones until the job ends."""
        require_operator(caller)
        await self.store.get(job_id)
        feed = self.store.feed
        after = 0
        while True:
            tokens = (feed.token(f"logs:{job_id}"), feed.token(f"job:{job_id}"))
            records = await self.store.logs(job_id, after=after)
            for record in records:
                after = record.seq
                yield record.to_proto()
            if records:
                continue
            if not follow or (await self.store.get(job_id)).state.terminal:
                return
            await _first(tokens)

    async def fetch(self, caller: PeerIdentity, job_id: str) -> AsyncIterator[scheduler_pb2.FileChunk]:
        """Each result file as chunks; ``path`` is set on a file's first chunk."""
        require_operator(caller)
        job = await self.store.get(job_id)
        if job.state is not JobState.SUCCEEDED:
            raise FailedPreconditionError(
                f"job {job_id} is {job.state.value}: only a succeeded job has a result"
            )
        root = await self.orchestrator.fetch_result(job_id)
        sent = False
        label = f"the result of job {job_id}"
        async for name, chunk in send_dir(root, label=label, chunk_size=self.chunk_size):
            sent = True
            if self.metrics is not None:
                self.metrics.bytes_moved.labels(kind="result").inc(len(chunk.data))
            yield scheduler_pb2.FileChunk(path=name, chunk=chunk)
        if not sent:
            raise NotFoundError(f"job {job_id} has no result files")

    # ---- gRPC ---------------------------------------------------------------------------

    async def SubmitJob(
        self, request: scheduler_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Job:
        caller = peer_identity(context)
        return (await self.submit(caller, request)).to_proto(caller)

    async def GetJob(
        self, request: scheduler_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Job:
        caller = peer_identity(context)
        return (await self.get(caller, request.job_id)).to_proto(caller)

    async def GetJobMetrics(
        self, request: scheduler_pb2.GetJobMetricsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.JobMetrics:
        return await self.job_metrics(peer_identity(context), request.job_id)

    async def ListJobs(
        self, request: scheduler_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListJobsResponse:
        states = [JobState.from_proto(s) for s in request.states]
        caller = peer_identity(context)
        jobs = await self.list_jobs(caller, states)
        return scheduler_pb2.ListJobsResponse(jobs=[job.to_proto(caller) for job in jobs])

    async def CancelJob(
        self, request: scheduler_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CancelJobsResponse:
        ids = await self.cancel(peer_identity(context), request.job_id, request.all)
        return scheduler_pb2.CancelJobsResponse(cancelled=ids)

    async def ScaleJob(
        self, request: scheduler_pb2.ScaleJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Job:
        caller = peer_identity(context)
        return (await self.scale(caller, request.job_id, int(request.workers))).to_proto(caller)

    async def WatchJob(
        self, request: scheduler_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.JobEvent]:
        async for event in self.watch(peer_identity(context), request.job_id):
            yield event

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        return scheduler_pb2.ListWorkersResponse(workers=await self.workers(peer_identity(context)))

    async def GetLogs(
        self, request: scheduler_pb2.GetLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.LogLine]:
        async for line in self.logs(peer_identity(context), request.job_id, request.follow):
            yield line

    async def FetchResult(
        self, request: scheduler_pb2.FetchResultRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.FileChunk]:
        async for chunk in self.fetch(peer_identity(context), request.job_id):
            yield chunk


async def _first(events: Sequence[asyncio.Event]) -> None:
    """Wait until any of ``events`` is set."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
