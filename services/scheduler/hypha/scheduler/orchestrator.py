"""Job orchestration: from a submitted job to workers running it, and back to a result.

One asyncio task per active job drives it through its life
(``hypha.scheduler.lifecycle``), with the store as the only record of where it
stands; the market leases the workers; ``Worker.DispatchJob`` /
``CancelJob`` / ``GetJobStatus`` (direct or relayed through the connector)
control what they run (``hypha.scheduler.worker_calls``); the
``SchedulerControl`` servicer hands every report from a worker to this
object (``JobControl``), which hands it to the job's run.

Each job kind is a ``JobRun`` (``hypha.scheduler.runs``): task jobs in
``hypha.scheduler.task_job``, DiLoCo jobs in ``hypha.scheduler.diloco.run``,
inference jobs in ``hypha.scheduler.inference_job``.
This module asks the kind tables (``hypha.jobfile.kinds``,
``hypha.scheduler.job_kinds``) which run starts a job, which dataset it
needs and whether it scales, and routes reports and lost leases to the
run; it never asks which kind a job or run is.

Decisions (NOTE):
- A scheduler that stops leaves running jobs as they are in the store; its
  leases are released by the market, so the workers cancel the executions,
  and ``JobStore.recover`` settles the jobs at the next start. A scheduler
  that dies (SIGKILL, crash) releases nothing: at the next start a DiLoCo
  job that saved its run state resumes (``hypha.scheduler.diloco.resume``).
- A report about a job from a worker that does not work on it is refused
  with PERMISSION_DENIED: a worker can only speak for its own executions.
- A report about a job that is over, from one of its workers, is
  acknowledged and ignored (a progress report is answered DONE). One about
  an active job that no run drives yet (the scheduler is starting and is
  about to resume it) is answered UNAVAILABLE: the worker tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hypha.errors import (
    FailedPreconditionError,
    HyphaError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from hypha.jobfile.kinds import kind_of
from hypha.market.allocator import HeldLease
from hypha.market.resources import Resources
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.diloco.round_planner import PlannerFactory
from hypha.scheduler.job_kinds import RunContext, run_kind, scaling_kinds
from hypha.scheduler.lease_keeper import LeaseEvent, LeaseEventKind, held_lease_to_proto
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.market import SchedulerMarket
from hypha.scheduler.metrics import SchedulerMetrics, StatusBridge
from hypha.scheduler.providers import ADMIT_WAIT_S, DatasetProviders
from hypha.scheduler.results import result_dir
from hypha.scheduler.runs import JobRun, RunRegistry
from hypha.scheduler.store import JobRecord, JobStore, LogEntry
from hypha.scheduler.worker_calls import FINAL_REPORTS, WorkerCalls
from hypha.timestamps import to_timestamp
from hypha.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)


class Orchestrator:
    """Runs every job of one scheduler (see the module docstring)."""

    def __init__(
        self,
        market: SchedulerMarket,
        store: JobStore,
        section: SchedulerSection,
        state_dir: Path,
        *,
        planners: PlannerFactory,
        providers: DatasetProviders | None = None,
        metrics: SchedulerMetrics | None = None,
        status_bridge: StatusBridge | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.market = market
        self.store = store
        self.section = section
        self.state_dir = Path(state_dir)
        self.planners = planners
        self.providers = providers
        self.status_bridge = status_bridge
        calls = WorkerCalls(market.connector, market.worker_addresses, section)
        self.runs = RunRegistry(market, store, calls, section, metrics=metrics, clock=clock)
        self._events_task: asyncio.Task[None] | None = None
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Settle what a previous process left, then run every job that is still active."""
        if self.providers is not None:
            try:
                await self.providers.start()
            except (OSError, HyphaError) as err:
                log.warning("DHT endpoint did not start (%s): DiLoCo jobs cannot find data", err)
                self.providers = None
        events = self.market.events()
        self._events_task = asyncio.create_task(self._lease_events(events), name="orchestrator lease events")
        report = await self.store.recover()
        for job in report.failed:
            log.info("job %s failed on restart: %s", job.job_id, job.reason)
        for job in report.resumed:
            log.info("job %s resumes: %s", job.job_id, job.reason)
            self._launch(job)
        for job in report.pending:
            self._launch(job)

    async def stop(self) -> None:
        """Idempotent: stop driving jobs (their state stays in the store; the market releases leases)."""
        if self._stopping:
            return
        self._stopping = True
        if self._events_task is not None:
            self._events_task.cancel()
            await asyncio.wait([self._events_task])
        await self.runs.stop()
        if self.providers is not None:
            await self.providers.stop()

    # ---- the client API's side (servicer.JobDriver) ------------------------------------------

    async def admit(self, spec: common_pb2.JobSpec) -> None:
        """Refuse at submit a job whose dataset no data node announces (the real reason, fast)."""
        kind = kind_of(spec)
        dataset = kind.dataset(spec) if kind is not None else ""
        if dataset and self.providers is not None:
            wait_s = min(ADMIT_WAIT_S, self.section.jobs.provider_wait_s)
            await self.providers.require(dataset, wait_s)

    async def submit(self, job: JobRecord) -> None:
        """Start driving a job the store has just accepted (PENDING)."""
        self._launch(job)

    async def cancel(self, job_id: str) -> None:
        """Free what a cancelled job holds: its executions are cancelled and its leases released.

        The API marks the job CANCELLED in the store first, so every later
        conditional update of the job's own task fails; a job found still
        active here (a direct call) is marked CANCELLED now. Returns once the
        job's task has cleaned up (bounded by twice ``cancel_timeout_s``).
        """
        job = await self.store.find(job_id)
        if job is not None and not job.state.terminal:
            with contextlib.suppress(FailedPreconditionError):
                await self.store.transition(
                    job_id, JobState.CANCELLED, reason=Reason.CANCELLED.format(who="client")
                )
        run = self.runs.get(job_id)
        if run is None or run.task is None or run.task.done():
            return
        if run.cancelled_by is None:
            run.cancelled_by = "client"
            run.task.cancel()
        # NOTE: asyncio.wait neither raises the task's error nor swallows our own cancellation.
        await asyncio.wait([run.task], timeout=self.section.jobs.cancel_timeout_s * 2)

    async def scale(self, job_id: str, workers: int) -> None:
        """Grow or shrink a running job to ``workers`` trainers, if its kind scales (``job_kinds``)."""
        job = await self.store.get(job_id)
        scale = run_kind(job.kind).scale
        if scale is None:
            raise FailedPreconditionError(
                f"job {job_id} is a {job.kind} job: only {scaling_kinds()} jobs scale"
            )
        run = self.runs.get(job_id)
        if job.state not in (JobState.RUNNING, JobState.ALLOCATING) or run is None:
            raise FailedPreconditionError(f"job {job_id} is {job.state.value}: only a running job scales")
        await scale(run, workers)

    def result_dir(self, job_id: str) -> Path:
        return result_dir(self.state_dir, job_id)

    async def fetch_result(self, job_id: str) -> Path:
        """The directory holding a finished job's result files."""
        job = await self.store.get(job_id)
        path = Path(job.result_path) if job.result_path else self.result_dir(job_id)
        if job.state is not JobState.SUCCEEDED or not path.is_dir():
            raise NotFoundError(f"job {job_id} has no result (it is {job.state.value})")
        return path

    async def list_workers(self) -> list[scheduler_pb2.WorkerView]:
        """Every worker known from its offers, leased or idle, with its name, lease and job."""
        by_worker: dict[str, list[HeldLease]] = {}
        for lease in self.market.leases():
            by_worker.setdefault(lease.worker_id, []).append(lease)
        known = {worker.worker_id: worker for worker in self.market.known_workers()}
        views = []
        for worker_id in sorted(by_worker.keys() | known.keys()):
            leases = by_worker.get(worker_id, [])
            seen = known.get(worker_id)
            job_id = next((lease.job_id for lease in leases if lease.job_id), "")
            run = self.runs.get(job_id)
            view = scheduler_pb2.WorkerView(
                peer=common_pb2.PeerInfo(
                    peer_id=worker_id,
                    role=common_pb2.ROLE_WORKER,
                    name=seen.name if seen is not None else "",
                    addresses=list(
                        self.market.worker_addresses(worker_id) or (seen.addresses if seen else ())
                    ),
                ),
                capacity=(
                    self.market.worker_capacity(worker_id) if leases or seen is None else seen.capacity
                ).to_proto(),
                leased=Resources.total(lease.resources for lease in leases).to_proto(),
                leases=[held_lease_to_proto(lease, self.market.peer_id) for lease in leases],
                # NOTE: a leased worker is healthy while its lease renews (a lost one leaves the
                # book); an idle one is as healthy as its last offer says.
                healthy=True,
                samples_per_second=run.samples_per_second(worker_id) if run is not None else 0.0,
                job_id=job_id,
            )
            if seen is not None:
                view.last_seen.CopyFrom(to_timestamp(seen.seen_at))
            views.append(view)
        return views

    # ---- the workers' side (control_servicer.JobControl) -------------------------------------------

    async def _run_for(self, worker_id: str, job_id: str) -> JobRun | None:
        """The job's live run if ``worker_id`` works on it; None when the job is over (a late
        report from one of its workers, which is acknowledged and ignored)."""
        run = self.runs.get(job_id)
        if run is not None:
            if worker_id in run.participants:
                return run
            if run.resuming:
                # Its workers come back as the saved run is rebuilt (a DiLoCo job's leases are
                # taken back one by one); refusing one now would fail a trainer that never left.
                raise UnavailableError(f"job {job_id} is being resumed (the scheduler restarted); try again")
            raise PermissionDeniedError(f"worker {worker_id} does not work on job {job_id}")
        job = await self.store.find(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id} on this scheduler")
        if not job.state.terminal:
            # Active but not driven (yet): the scheduler is starting and resumes it in a moment.
            # Answering as if it were over would tell its trainers DONE.
            raise UnavailableError(f"job {job_id} is not driven yet (the scheduler is starting); try again")
        if worker_id not in job.workers:
            raise PermissionDeniedError(f"worker {worker_id} does not work on job {job_id}")
        return None

    async def report_progress(
        self, worker_id: str, report: scheduler_pb2.ProgressReport
    ) -> scheduler_pb2.Directive:
        run = await self._run_for(worker_id, report.job_id)
        if run is None:
            # The job is over: whoever still trains on it must stop.
            return scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_DONE, round=report.round)
        return await run.on_progress(worker_id, report)

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse:
        run = await self._run_for(worker_id, request.job_id)
        if run is None:
            return scheduler_pb2.NextSliceResponse(available=False)
        return await run.next_slice(worker_id, request)

    async def report_metrics(self, worker_id: str, report: scheduler_pb2.MetricsReport) -> None:
        run = await self._run_for(worker_id, report.job_id)
        values = dict(report.values)
        await self.store.record_metrics(report.job_id, int(report.round), values, worker_id)
        if self.status_bridge is not None:
            self.status_bridge.push_metrics(report.job_id, worker_id, int(report.round), values)
        if run is not None:
            await run.on_metrics(worker_id, int(report.round), values)

    async def report_job_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None:
        run = await self._run_for(worker_id, report.job_id)
        if run is not None and int(report.state) in FINAL_REPORTS:  # RUNNING: nothing to decide
            run.on_status(worker_id, report)

    async def append_logs(self, worker_id: str, lines: Sequence[scheduler_pb2.LogLine]) -> None:
        by_job: dict[str, list[LogEntry]] = {}
        for line in lines:
            by_job.setdefault(line.job_id, []).append(LogEntry.from_proto(line))
        for job_id, entries in by_job.items():
            await self._run_for(worker_id, job_id)  # only a job's own workers write its logs
            await self.store.append_logs(job_id, entries)

    # ---- runs -----------------------------------------------------------------------------

    def _launch(self, job: JobRecord) -> None:
        if self._stopping or job.job_id in self.runs:
            return
        self.runs.launch(self._new_run(job), job)

    def _new_run(self, job: JobRecord) -> JobRun:
        """The run its kind's entry starts (``hypha.scheduler.job_kinds``)."""
        context = RunContext(self.runs, self.planners, self.providers, self.state_dir)
        return run_kind(job.kind).start(job, context)

    async def _lease_events(self, queue: asyncio.Queue[LeaseEvent]) -> None:
        """Hand every lease the market lost to the run that held it."""
        while True:
            event = await queue.get()
            if event.kind is not LeaseEventKind.LOST:
                continue
            run = self.runs.lease_lost(event.lease)
            if run is not None:
                run.on_lease_lost(event.lease, event.reason)


__all__ = ["Orchestrator"]
