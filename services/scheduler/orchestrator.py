"""Job orchestration: from a submitted job to workers running it, and back to a result.

One asyncio task per active job drives it through its life
(``hypha.scheduler.lifecycle``), with the store as the only record of where it
stands; the market leases the workers; ``Worker.DispatchJob`` /
``CancelJob`` / ``GetJobStatus`` (direct or relayed through the connector)
control what they run; the ``SchedulerControl`` servicer hands every report
from a worker to this object (``JobControl``).

**DiLoCo jobs.** ALLOCATING: lease one parameter server and ``num_workers``
trainers with the job's requirements, prices and policy; find the dataset's
providers in the DHT; dispatch the parameter server (it learns the trainer
ids), then the trainers (they learn the parameter server). RUNNING: progress
reports are answered by the job's ``RoundPlanner`` (performance-aware
rounds), slice requests by its ``SliceTracker`` (with the providers as
``PeerInfo``), metrics go to the store. A trainer that is lost (its lease
lapsed) or fails gives its slices back, is replaced through the market and
the replacement starts at the current round, pulling θ_global from the
parameter server; the parameter server is re-dispatched with the new trainer
list so it adopts the newcomer. The job ends when the parameter server
reports success after the configured rounds: its result (``config.json`` +
safetensors) is pulled into ``<state_dir>/results/<job_id>/`` for
``FetchResult``, and every lease is released.

**Task jobs.** Queued (PENDING, honouring a retry's ``not_before``),
allocated one worker by the job's policy, dispatched, watched (status
reports, lease loss, a backstop ``GetJobStatus`` poll, the timeout plus a
grace), retried by the job's retry policy with exponential backoff, and
finished with the exit code.

Decisions (NOTE):
- A scheduler that stops leaves running jobs as they are in the store; its
  leases are released by the market, so the workers cancel the executions,
  and ``JobStore.recover`` settles the jobs at the next start.
- Progress is written to the store at most every
  ``jobs.progress_store_interval_s`` per job (every batch of every trainer
  reports; watchers only need the latest), and always when a round completes.
- A report about a job from a worker that does not work on it is refused
  with PERMISSION_DENIED: a worker can only speak for its own executions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import shutil
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
from opentelemetry import trace

from hypha.dht.node import DhtNode
from hypha.dht.records import ProviderRecord, RecordVerifier
from hypha.errors import (
    DataLossError,
    FailedPreconditionError,
    HyphaError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from hypha.market.allocator import HeldLease
from hypha.market.pricing import PriceRange
from hypha.market.resources import Requirements, Resources
from hypha.net.tls import TlsMaterial
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.market import LeaseEvent, LeaseEventKind, SchedulerMarket, held_lease_to_proto
from hypha.scheduler.metrics import SchedulerMetrics, StatusBridge
from hypha.scheduler.rounds import Progress, RoundPlanner, batch_size_for
from hypha.scheduler.slices import SliceTracker
from hypha.scheduler.store import JobRecord, JobStore, LogEntry, WorkerMetric
from hypha.scheduler.tasks import Outcome, RetryPolicy
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("hypha.scheduler")

RESULTS_DIR = "results"
#: Longest pause of a queued task between two attempts to find a worker.
MAX_QUEUE_RETRY_S = 30.0
#: ``PullTensors`` kind a worker streams a finished job's result files under.
RESULT_KIND = "result"

#: Worker-side execution end states, as the report states the scheduler receives.
_STATUS_TO_REPORT: dict[int, int] = {
    worker_pb2.EXECUTION_STATE_SUCCEEDED: scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED,
    worker_pb2.EXECUTION_STATE_FAILED: scheduler_pb2.EXECUTION_STATE_REPORT_FAILED,
    worker_pb2.EXECUTION_STATE_CANCELLED: scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED,
    worker_pb2.EXECUTION_STATE_TIMED_OUT: scheduler_pb2.EXECUTION_STATE_REPORT_TIMED_OUT,
}
_FINAL_REPORTS = frozenset(_STATUS_TO_REPORT.values())
#: How an attempt ended: the outcome, the exit code, what the worker said.
AttemptEnd = tuple[Outcome, int, str]


# ---- finding data ------------------------------------------------------------------------


class DatasetProviders:
    """The scheduler's DHT endpoint, used only to look up who serves a dataset."""

    def __init__(self, tls: TlsMaterial, section: SchedulerSection) -> None:
        self.tls = tls
        self.section = section
        self.dht: DhtNode | None = None

    async def start(self) -> None:
        self.dht = await DhtNode.create(
            self.section.dht_host,
            self.section.dht_port,
            self.section.dht_bootstrap,
            verifier=RecordVerifier(self.tls.trusted_cas),
            rpc_timeout_s=self.section.dht_rpc_timeout_s,
            lookup_timeout_s=self.section.dht_lookup_timeout_s,
        )

    async def stop(self) -> None:
        dht, self.dht = self.dht, None
        if dht is not None:
            await dht.stop()

    async def find(self, dataset: str) -> list[ProviderRecord]:
        if self.dht is None:
            raise UnavailableError("the scheduler's DHT endpoint is not running")
        return await self.dht.find_providers(dataset)


def provider_peer(record: ProviderRecord) -> common_pb2.PeerInfo:
    return common_pb2.PeerInfo(
        peer_id=record.provider, role=common_pb2.ROLE_DATA, addresses=list(record.addresses)
    )


# ---- per-job runtime state ----------------------------------------------------------------


@dataclass
class _Trainer:
    worker_id: str
    lease: HeldLease
    batch_size: int
    attempt: int
    start_round: int
    finished: bool = False
    samples: int = 0
    samples_per_second: float = 0.0
    loss: float = 0.0


@dataclass
class _Run:
    """What the orchestrator keeps about one active job while its task runs."""

    job_id: str
    kind: str
    spec: common_pb2.JobSpec
    task: asyncio.Task[None] | None = None
    #: Why a client cancelled it (None: not cancelled).
    cancelled_by: str | None = None
    #: Every worker that ever ran a part of it (their late reports and logs are still accepted).
    participants: set[str] = field(default_factory=set)
    leases: dict[str, HeldLease] = field(default_factory=dict)  # lease id -> lease
    last_store_at: float = 0.0


@dataclass
class _TaskRun(_Run):
    attempt: int = 0
    worker_id: str = ""
    #: Resolved when the current attempt ends.
    outcome: asyncio.Future[AttemptEnd] | None = None


@dataclass
class _DilocoRun(_Run):
    ps: HeldLease | None = None
    trainers: dict[str, _Trainer] = field(default_factory=dict)
    tracker: SliceTracker | None = None
    planner: RoundPlanner | None = None
    providers: list[common_pb2.PeerInfo] = field(default_factory=list)
    #: Rounds the parameter server completed.
    completed: int = 0
    #: When the current round started (dispatch, then each completion), on the orchestrator's clock.
    round_started_at: float = 0.0
    #: Trainer loss per round, per worker.
    losses: dict[int, dict[str, float]] = field(default_factory=dict)
    replacements: int = 0
    replacing: int = 0
    #: Resolved with (succeeded, message) when the parameter server ends.
    ended: asyncio.Future[tuple[bool, str]] | None = None

    @property
    def diloco(self) -> common_pb2.DilocoJobSpec:
        return self.spec.diloco


class JobFailed(HyphaError):
    """Ends a job as FAILED with this message as the reason."""


# ---- the orchestrator --------------------------------------------------------------------


class Orchestrator:
    """Runs every job of one scheduler (see the module docstring)."""

    def __init__(
        self,
        market: SchedulerMarket,
        store: JobStore,
        section: SchedulerSection,
        state_dir: Path,
        providers: DatasetProviders | None = None,
        *,
        metrics: SchedulerMetrics | None = None,
        status_bridge: StatusBridge | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.market = market
        self.metrics = metrics
        self.status_bridge = status_bridge
        self.store = store
        self.section = section
        self.jobs_cfg = section.jobs
        self.state_dir = Path(state_dir)
        self.providers = providers
        self._clock = clock
        self._runs: dict[str, _Run] = {}
        self._by_lease: dict[str, _Run] = {}
        self._allocations = asyncio.Semaphore(self.jobs_cfg.max_parallel_allocations)
        self._tasks: set[asyncio.Task[Any]] = set()
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
        for job in report.pending:
            self._launch(job)

    async def stop(self) -> None:
        """Idempotent: stop driving jobs (their state stays in the store; the market releases leases)."""
        if self._stopping:
            return
        self._stopping = True
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        tasks += [*self._tasks]
        if self._events_task is not None:
            tasks.append(self._events_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.providers is not None:
            await self.providers.stop()

    # ---- the client API's side (api.Orchestrator) ---------------------------------------

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
        run = self._runs.get(job_id)
        if run is None or run.task is None or run.task.done():
            return
        if run.cancelled_by is None:
            run.cancelled_by = "client"
            run.task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(run.task), self.jobs_cfg.cancel_timeout_s * 2)

    def result_dir(self, job_id: str) -> Path:
        return self.state_dir / RESULTS_DIR / job_id

    async def fetch_result(self, job_id: str) -> Path:
        """The directory holding a finished job's result files."""
        job = await self.store.get(job_id)
        path = Path(job.result_path) if job.result_path else self.result_dir(job_id)
        if job.state is not JobState.SUCCEEDED or not path.is_dir():
            raise NotFoundError(f"job {job_id} has no result (it is {job.state.value})")
        return path

    async def list_workers(self) -> list[scheduler_pb2.WorkerView]:
        """The workers this scheduler holds leases on, with what they do for which job."""
        by_worker: dict[str, list[HeldLease]] = {}
        for lease in self.market.leases():
            by_worker.setdefault(lease.worker_id, []).append(lease)
        views = []
        for worker_id, leases in sorted(by_worker.items()):
            job_id = next((lease.job_id for lease in leases if lease.job_id), "")
            rate = 0.0
            run = self._runs.get(job_id)
            if isinstance(run, _DilocoRun) and worker_id in run.trainers:
                rate = run.trainers[worker_id].samples_per_second
            views.append(
                scheduler_pb2.WorkerView(
                    peer=common_pb2.PeerInfo(
                        peer_id=worker_id,
                        role=common_pb2.ROLE_WORKER,
                        addresses=list(self.market.worker_addresses(worker_id)),
                    ),
                    capacity=self.market.worker_capacity(worker_id).to_proto(),
                    leased=Resources.total(lease.resources for lease in leases).to_proto(),
                    leases=[held_lease_to_proto(lease, self.market.peer_id) for lease in leases],
                    healthy=True,
                    samples_per_second=rate,
                    job_id=job_id,
                )
            )
        return views

    # ---- the workers' side (control.JobControl) -------------------------------------------

    async def _run_for(self, worker_id: str, job_id: str) -> _Run | None:
        """The job's live run if ``worker_id`` works on it; None when the job is over (a late
        report from one of its workers, which is acknowledged and ignored)."""
        run = self._runs.get(job_id)
        if run is not None:
            if worker_id not in run.participants:
                raise PermissionDeniedError(f"worker {worker_id} does not work on job {job_id}")
            return run
        job = await self.store.find(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id} on this scheduler")
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
        if not isinstance(run, _DilocoRun) or run.planner is None:
            raise FailedPreconditionError(f"job {report.job_id} is not a running DiLoCo job")
        trainer = run.trainers.get(worker_id)
        if trainer is None:
            return scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_DONE, round=report.round)
        progress = Progress.from_proto(report)
        directive = run.planner.report(worker_id, progress, self._clock())
        trainer.samples = progress.samples
        trainer.loss = progress.loss
        rate = run.planner.rates().get(worker_id)
        if rate is not None:
            trainer.samples_per_second = rate
        await self._store_progress(run)
        return directive.to_proto()

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse:
        run = await self._run_for(worker_id, request.job_id)
        if run is None:
            return scheduler_pb2.NextSliceResponse(available=False)
        if not isinstance(run, _DilocoRun) or run.tracker is None:
            raise FailedPreconditionError(f"job {request.job_id} has no data slices")
        tracker = run.tracker
        for used in request.used:
            try:
                tracker.mark_used(worker_id, int(used))
            except HyphaError as err:  # a slice it lost (replaced, or reported twice): ignore
                log.debug("job %s: used slice %d from %s ignored: %s", run.job_id, used, worker_id, err)
        if worker_id not in run.trainers:
            return scheduler_pb2.NextSliceResponse(available=False, dataset=run.diloco.dataset)
        try:
            index = tracker.next_slice(worker_id)
        except FailedPreconditionError:
            index = None  # it holds its prefetch allowance already
        if index is None:
            return scheduler_pb2.NextSliceResponse(
                available=False, epoch=tracker.epoch, dataset=run.diloco.dataset
            )
        return scheduler_pb2.NextSliceResponse(
            available=True,
            index=index,
            epoch=tracker.epoch,
            dataset=run.diloco.dataset,
            providers=run.providers,
        )

    async def report_metrics(self, worker_id: str, report: scheduler_pb2.MetricsReport) -> None:
        run = await self._run_for(worker_id, report.job_id)
        values = dict(report.values)
        await self.store.record_metrics(report.job_id, int(report.round), values, worker_id)
        if self.status_bridge is not None:
            self.status_bridge.push_metrics(report.job_id, worker_id, int(report.round), values)
        if not isinstance(run, _DilocoRun):
            return
        if run.ps is not None and worker_id == run.ps.worker_id:
            # The parameter server completed a round.
            if int(report.round) + 1 > run.completed:
                now = self._clock()
                if self.metrics is not None and run.round_started_at:
                    self.metrics.round_seconds.observe(now - run.round_started_at)
                run.round_started_at = now
                run.completed = int(report.round) + 1
            await self._store_progress(run, force=True, message=f"round {report.round} complete")
            return
        if "loss" in values and math.isfinite(values["loss"]):
            run.losses.setdefault(int(report.round), {})[worker_id] = values["loss"]
        trainer = run.trainers.get(worker_id)
        if trainer is not None and "samples_per_second" in values:
            trainer.samples_per_second = values["samples_per_second"]
        await self._store_progress(run)

    async def report_job_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None:
        run = await self._run_for(worker_id, report.job_id)
        if run is None or int(report.state) not in _FINAL_REPORTS:
            return  # over already, or RUNNING: nothing to decide
        outcome = _attempt_end(int(report.state), int(report.exit_code), report.message)
        if isinstance(run, _TaskRun):
            if worker_id == run.worker_id and report.attempt == run.attempt:
                _resolve(run.outcome, outcome)
            return
        if not isinstance(run, _DilocoRun):
            return
        if run.ps is not None and worker_id == run.ps.worker_id:
            _resolve(run.ended, (outcome[0] is Outcome.SUCCEEDED, report.message or outcome[0].value))
            return
        trainer = run.trainers.get(worker_id)
        if trainer is None:
            return
        if outcome[0] is Outcome.SUCCEEDED:
            trainer.finished = True
        elif not _finished_job(run):
            why = f"trainer on {worker_id} {outcome[0].value}: {report.message}"
            self._spawn(self._replace_trainer(run, worker_id, why), f"replace trainer {worker_id}")

    async def append_logs(self, worker_id: str, lines: Sequence[scheduler_pb2.LogLine]) -> None:
        by_job: dict[str, list[LogEntry]] = {}
        for line in lines:
            by_job.setdefault(line.job_id, []).append(LogEntry.from_proto(line))
        for job_id, entries in by_job.items():
            await self._run_for(worker_id, job_id)  # only a job's own workers write its logs
            await self.store.append_logs(job_id, entries)

    # ---- driving one job ---------------------------------------------------------------------

    def _launch(self, job: JobRecord) -> None:
        if self._stopping or job.job_id in self._runs:
            return
        run: _Run
        if job.kind == "diloco":
            run = _DilocoRun(job.job_id, job.kind, job.spec)
        else:
            run = _TaskRun(job.job_id, job.kind, job.spec, attempt=job.attempt)
        self._runs[job.job_id] = run
        run.task = asyncio.create_task(self._drive(run, job), name=f"job {job.job_id}")

    async def _drive(self, run: _Run, job: JobRecord) -> None:
        # One span covers the whole job; the gRPC calls made for it (leases, dispatch, result
        # pulls) are its children, so a trace shows a job end to end.
        kind = "diloco" if isinstance(run, _DilocoRun) else "task"
        attributes = {"hypha.job_id": run.job_id, "hypha.job_kind": kind}
        with _tracer.start_as_current_span("hypha.job", attributes=attributes):
            await self._drive_job(run, job)

    async def _drive_job(self, run: _Run, job: JobRecord) -> None:
        try:
            if isinstance(run, _DilocoRun):
                await self._run_diloco(run, job)
            elif isinstance(run, _TaskRun):
                await self._run_task(run, job)
        except asyncio.CancelledError:
            if run.cancelled_by is None:
                raise  # the scheduler is stopping: the job stays as it is in the store
            await self._settle(run, JobState.CANCELLED, Reason.CANCELLED.format(who=run.cancelled_by))
        except JobFailed as err:
            await self._settle(run, JobState.FAILED, err.message)
        except Exception as err:
            current = await self.store.find(run.job_id)
            if current is not None and current.state.terminal:
                # Cancelled (or otherwise ended) by someone else meanwhile: our next
                # conditional update failed, as it should.
                log.info("job %s ended elsewhere (%s): %s", run.job_id, current.state.value, err)
            else:
                log.exception("job %s: orchestration failed", run.job_id)
                await self._settle(run, JobState.FAILED, f"orchestration failed: {err}")
        finally:
            await self._cleanup(run)
            self._runs.pop(run.job_id, None)

    async def _settle(self, run: _Run, target: JobState, reason: str, **changes: Any) -> None:
        """Move the job to a terminal state from wherever it is (ALLOCATING first steps to RUNNING
        when the table requires it); a job already terminal is left alone."""
        try:
            job = await self.store.get(run.job_id)
            if job.state.terminal:
                return
            if target is JobState.SUCCEEDED and job.state is not JobState.RUNNING:
                await self.store.transition(run.job_id, JobState.RUNNING, expected=job.state)
            await self.store.transition(run.job_id, target, reason=reason, **changes)
        except HyphaError as err:
            log.warning("job %s: could not record %s: %s", run.job_id, target.value, err)

    async def _cleanup(self, run: _Run) -> None:
        """Stop whatever still runs for the job and give its leases back."""
        leases = list(run.leases.values())
        run.leases.clear()
        for lease in leases:
            self._by_lease.pop(lease.lease_id, None)
        await asyncio.gather(*(self._cancel_on(lease.worker_id, run.job_id) for lease in leases))
        await asyncio.gather(*(self.market.release(lease.lease_id) for lease in leases))

    def _hold(self, run: _Run, lease: HeldLease) -> None:
        run.leases[lease.lease_id] = lease
        run.participants.add(lease.worker_id)
        self._by_lease[lease.lease_id] = run

    async def _drop(self, run: _Run, lease: HeldLease, *, cancel: bool = True) -> None:
        run.leases.pop(lease.lease_id, None)
        self._by_lease.pop(lease.lease_id, None)
        if cancel:
            await self._cancel_on(lease.worker_id, run.job_id)
        await self.market.release(lease.lease_id)

    async def _allocate(
        self,
        run: _Run,
        requirement: Requirements,
        count: int,
        price: PriceRange | None,
        policy: str,
        exclude: Collection[str] = (),
    ) -> list[HeldLease]:
        async with self._allocations:
            started = self._clock()
            leases = await self.market.allocate(
                requirement, count, price, policy or None, tag=run.job_id, exclude=exclude
            )
            if self.metrics is not None and leases:
                self.metrics.allocation_seconds.observe(self._clock() - started)
        for lease in leases:
            self._hold(run, lease)
        return leases

    # ---- task jobs -------------------------------------------------------------------------

    async def _run_task(self, run: _TaskRun, job: JobRecord) -> None:
        spec = run.spec.task
        requirement = Requirements.from_proto(spec.requirements)
        price = _price(spec.price)
        policy = RetryPolicy.from_proto(spec.retry)
        misses = 0
        while True:
            job = await self.store.get(run.job_id)
            if job.state is not JobState.PENDING:
                raise JobFailed(f"job is {job.state.value}, expected pending")
            delay = job.not_before - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.store.transition(run.job_id, JobState.ALLOCATING, expected=JobState.PENDING)
            leases = await self._allocate(run, requirement, 1, price, spec.selection_policy)
            if not leases:
                # Back in the queue; the pause grows while nothing fits, so an unservable
                # job neither floods its history nor keeps the market busy.
                wait_s = min(self.jobs_cfg.queue_retry_s * 2**misses, MAX_QUEUE_RETRY_S)
                misses += 1
                await self.store.transition(
                    run.job_id,
                    JobState.PENDING,
                    expected=JobState.ALLOCATING,
                    reason=f"no worker offered; trying again in {wait_s:.0f}s",
                )
                await asyncio.sleep(wait_s)
                continue
            misses = 0
            lease = leases[0]
            run.attempt = job.attempt + 1
            run.worker_id = lease.worker_id
            run.outcome = asyncio.get_running_loop().create_future()
            try:
                await self._dispatch(
                    lease,
                    worker_pb2.DispatchJobRequest(
                        job_id=run.job_id,
                        lease_id=lease.lease_id,
                        executor=common_pb2.EXECUTOR_KIND_TASK,
                        spec=run.spec,
                        attempt=run.attempt,
                        scheduler_addresses=self.market.addresses(),
                    ),
                )
            except (grpc.aio.AioRpcError, HyphaError) as err:
                outcome: AttemptEnd = (
                    Outcome.WORKER_LOST,
                    -1,
                    f"dispatch to {lease.worker_id} failed: {_describe(err)}",
                )
                await self.store.transition(
                    run.job_id, JobState.RUNNING, expected=JobState.ALLOCATING, attempt=run.attempt
                )
            else:
                await self.store.transition(
                    run.job_id,
                    JobState.RUNNING,
                    expected=JobState.ALLOCATING,
                    reason=f"attempt {run.attempt} running on {lease.worker_id}",
                    attempt=run.attempt,
                    workers=[lease.worker_id],
                )
                outcome = await self._await_task_outcome(run, lease, spec.timeout_s)
            ended, code, message = outcome
            await self._drop(run, lease, cancel=ended not in (Outcome.SUCCEEDED, Outcome.FAILED))
            if ended is Outcome.SUCCEEDED:
                await self.store.transition(
                    run.job_id,
                    JobState.SUCCEEDED,
                    expected=JobState.RUNNING,
                    reason=message or "exit code 0",
                    exit_code=code,
                )
                return
            decision = policy.decide(run.attempt, ended, time.time())
            described = ended.value + (f" ({message})" if message else "")
            if not decision.retry:
                await self.store.transition(
                    run.job_id,
                    JobState.FAILED,
                    expected=JobState.RUNNING,
                    reason=Reason.OUT_OF_RETRIES.format(attempt=run.attempt, outcome=described),
                    exit_code=code,
                )
                return
            await self.store.transition(
                run.job_id,
                JobState.PENDING,
                expected=JobState.RUNNING,
                reason=Reason.RETRY_SCHEDULED.format(
                    attempt=run.attempt, outcome=described, delay_s=decision.delay_s
                ),
                not_before=decision.at,
                exit_code=code,
            )

    async def _await_task_outcome(self, run: _TaskRun, lease: HeldLease, timeout_s: float) -> AttemptEnd:
        """Until the attempt ends: a status report, the lease's loss, a poll, or the timeout."""
        assert run.outcome is not None
        limit = timeout_s + self.jobs_cfg.task_timeout_grace_s if timeout_s > 0 else math.inf
        started = self._clock()
        while True:
            left = limit - (self._clock() - started)
            if left <= 0:
                return (Outcome.TIMED_OUT, -1, f"no end reported within {timeout_s:g}s")
            wait = min(self.jobs_cfg.status_poll_s, left)
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(run.outcome), wait)
            polled = await self._poll_status(lease.worker_id, run.job_id)
            if polled is not None:
                return polled

    async def _poll_status(self, worker_id: str, job_id: str) -> AttemptEnd | None:
        """The execution's end if ``GetJobStatus`` says it ended (None: running or unreachable)."""
        try:
            stub = await self._worker_stub(worker_id)
            status = await stub.GetJobStatus(
                worker_pb2.GetJobStatusRequest(job_id=job_id), timeout=self.section.rpc_timeout_s
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.NOT_FOUND:
                return (Outcome.WORKER_LOST, -1, f"worker {worker_id} no longer knows the job")
            return None
        report = _STATUS_TO_REPORT.get(int(status.state))
        return None if report is None else _attempt_end(report, int(status.exit_code), status.message)

    # ---- DiLoCo jobs ---------------------------------------------------------------------------

    async def _run_diloco(self, run: _DilocoRun, job: JobRecord) -> None:
        spec = run.diloco
        loop = asyncio.get_running_loop()
        run.ended = loop.create_future()
        await self.store.transition(run.job_id, JobState.ALLOCATING, expected=JobState.PENDING)
        records = await self._find_providers(spec.dataset)
        slice_count = max(record.slice_count for record in records)
        run.providers = [provider_peer(record) for record in records]
        run.tracker = SliceTracker(slice_count)
        run.planner = RoundPlanner(
            int(spec.samples_per_round), int(spec.rounds), lookahead=self.jobs_cfg.sync_lookahead
        )
        run.ps = await self._lease_until(
            run,
            Requirements.from_proto(spec.parameter_server_requirements),
            1,
            _price(spec.parameter_server_price),
            spec.selection_policy,
            "a parameter server",
        )
        trainer_leases = await self._lease_many(
            run,
            Requirements.from_proto(spec.worker_requirements),
            int(spec.num_workers),
            _price(spec.worker_price),
            spec.selection_policy,
            exclude={run.ps.worker_id},
        )
        for lease in trainer_leases:
            self._add_trainer(run, lease, attempt=0, start_round=0)
        await self._dispatch_ps(run)
        await asyncio.gather(*(self._dispatch_trainer(run, t) for t in list(run.trainers.values())))
        await self.store.transition(
            run.job_id,
            JobState.RUNNING,
            reason=f"training on {len(run.trainers)} workers",
            workers=self._worker_list(run),
        )
        run.round_started_at = self._clock()
        succeeded, message = await run.ended
        if not succeeded:
            raise JobFailed(f"parameter server: {message}")
        result = await self._pull_result(run)
        await self._store_progress(run, force=True)
        await self._settle(
            run,
            JobState.SUCCEEDED,
            f"{spec.rounds} rounds done" + (f" ({message})" if message else ""),
            result_path=str(result),
            round=max(run.completed, int(spec.rounds)),
        )

    async def _find_providers(self, dataset: str) -> list[ProviderRecord]:
        if self.providers is None:
            raise JobFailed(f"cannot look up dataset {dataset!r}: scheduler.dht_bootstrap is not configured")
        deadline = self._clock() + self.jobs_cfg.provider_wait_s
        while True:
            try:
                records = await self.providers.find(dataset)
            except HyphaError as err:
                log.info("provider lookup of %s failed: %s", dataset, err.message)
                records = []
            if records:
                return records
            if self._clock() >= deadline:
                raise JobFailed(f"no data node serves dataset {dataset!r}")
            await asyncio.sleep(1.0)

    async def _lease_until(
        self,
        run: _Run,
        requirement: Requirements,
        count: int,
        price: PriceRange | None,
        policy: str,
        what: str,
    ) -> HeldLease:
        leases = await self._lease_many(run, requirement, count, price, policy, exclude=set(), what=what)
        return leases[0]

    async def _lease_many(
        self,
        run: _Run,
        requirement: Requirements,
        count: int,
        price: PriceRange | None,
        policy: str,
        *,
        exclude: set[str],
        what: str = "trainers",
    ) -> list[HeldLease]:
        """``count`` leases on distinct workers not in ``exclude``, trying until ``allocate_wait_s``."""
        deadline = self._clock() + self.jobs_cfg.allocate_wait_s
        held: list[HeldLease] = []
        while len(held) < count:
            taken = exclude | {h.worker_id for h in held}
            got = await self._allocate(run, requirement, count - len(held), price, policy, taken)
            for lease in got:
                if lease.worker_id in taken:
                    await self._drop(run, lease, cancel=False)
                else:
                    held.append(lease)
            if len(held) < count:
                if self._clock() >= deadline:
                    raise JobFailed(f"could lease only {len(held)} of {count} {what}")
                await asyncio.sleep(self.jobs_cfg.queue_retry_s)
        return held

    def _add_trainer(self, run: _DilocoRun, lease: HeldLease, *, attempt: int, start_round: int) -> _Trainer:
        spec = run.diloco
        capacity = self.market.worker_capacity(lease.worker_id)
        size = batch_size_for(
            capacity if not capacity.is_zero() else lease.resources,
            gpu_memory_per_sample_gb=spec.gpu_memory_per_sample_gb,
            min_batch_size=int(spec.min_batch_size),
            max_batch_size=int(spec.max_batch_size),
        )
        trainer = _Trainer(lease.worker_id, lease, size, attempt, start_round)
        run.trainers[lease.worker_id] = trainer
        assert run.planner is not None
        run.planner.add_worker(lease.worker_id, size)
        return trainer

    def _worker_list(self, run: _DilocoRun) -> list[str]:
        return ([run.ps.worker_id] if run.ps is not None else []) + sorted(run.trainers)

    async def _dispatch_ps(self, run: _DilocoRun) -> None:
        assert run.ps is not None
        await self._dispatch(
            run.ps,
            worker_pb2.DispatchJobRequest(
                job_id=run.job_id,
                lease_id=run.ps.lease_id,
                executor=common_pb2.EXECUTOR_KIND_PARAMETER_SERVER,
                spec=run.spec,
                trainer_ids=sorted(run.trainers),
                scheduler_addresses=self.market.addresses(),
                start_round=run.completed,
            ),
        )

    async def _update_ps(self, run: _DilocoRun) -> None:
        """Tell the running parameter server the new trainer list (a second dispatch of the job).

        A worker whose job manager cannot update a running execution answers
        ALREADY_EXISTS: the parameter server then keeps the old list, refuses
        the newcomer's deltas and completes each round with the remaining
        trainers once ``round_timeout_s`` passed (``quorum``).
        """
        try:
            await self._dispatch_ps(run)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            log.warning(
                "job %s: the parameter server cannot take the new trainer list (%s); "
                "rounds complete by quorum",
                run.job_id,
                _describe(err),
            )

    async def _dispatch_trainer(self, run: _DilocoRun, trainer: _Trainer) -> None:
        assert run.ps is not None
        await self._dispatch(
            trainer.lease,
            worker_pb2.DispatchJobRequest(
                job_id=run.job_id,
                lease_id=trainer.lease.lease_id,
                executor=common_pb2.EXECUTOR_KIND_DILOCO_TRAINER,
                spec=run.spec,
                parameter_server_id=run.ps.worker_id,
                parameter_server_addresses=list(self.market.worker_addresses(run.ps.worker_id)),
                scheduler_addresses=self.market.addresses(),
                batch_size=trainer.batch_size,
                attempt=trainer.attempt,
                start_round=trainer.start_round,
            ),
        )

    async def _replace_trainer(
        self, run: _DilocoRun, worker_id: str, why: str, *, lost: bool = False
    ) -> None:
        """A trainer is gone: its slices go back, a new worker takes its place at the current round.

        ``lost``: its lease lapsed, so the worker is gone or cut off; it stops the
        execution itself when the lease ends, and nobody waits on a cancel call to it.
        """
        trainer = run.trainers.pop(worker_id, None)
        if trainer is None:
            return
        log.warning("job %s: %s", run.job_id, why)
        if run.tracker is not None:
            run.tracker.worker_lost(worker_id)
        if run.planner is not None:
            run.planner.remove_worker(worker_id)
        await self._drop(run, trainer.lease, cancel=not lost)
        if run.replacements >= self.jobs_cfg.max_replacements:
            _resolve(run.ended, (False, f"{why}; no replacements left ({run.replacements} used)"))
            return
        run.replacements += 1
        run.replacing += 1
        try:
            with contextlib.suppress(HyphaError):
                await self.store.transition(
                    run.job_id,
                    JobState.ALLOCATING,
                    expected=JobState.RUNNING,
                    reason=Reason.WORKER_LOST.format(worker=worker_id),
                )
            exclude = set(run.trainers) | ({run.ps.worker_id} if run.ps else set())
            spec = run.diloco
            try:
                leases = await self._lease_many(
                    run,
                    Requirements.from_proto(spec.worker_requirements),
                    1,
                    _price(spec.worker_price),
                    spec.selection_policy,
                    exclude=exclude,
                    what="replacement trainers",
                )
            except JobFailed as err:
                _resolve(run.ended, (False, f"{why}; {err.message}"))
                return
            if _finished_job(run):
                await self._drop(run, leases[0], cancel=False)
                return
            replacement = self._add_trainer(
                run, leases[0], attempt=run.replacements, start_round=run.completed
            )
            await self._update_ps(run)
            await self._dispatch_trainer(run, replacement)
            await self.store.note(run.job_id, f"trainer {replacement.worker_id} replaces {worker_id}")
        except (grpc.aio.AioRpcError, HyphaError) as err:
            _resolve(run.ended, (False, f"{why}; replacing it failed: {_describe(err)}"))
        finally:
            run.replacing -= 1
            if run.replacing == 0:
                with contextlib.suppress(HyphaError):
                    await self.store.transition(
                        run.job_id,
                        JobState.RUNNING,
                        expected=JobState.ALLOCATING,
                        reason=f"training on {len(run.trainers)} workers",
                        workers=self._worker_list(run),
                    )

    async def _pull_result(self, run: _DilocoRun) -> Path:
        """Copy the parameter server's result directory into the scheduler's state dir.

        Retried a few times: a worker that is still filing the finished
        execution away answers NOT_FOUND for a moment, and a stream may break.
        """
        assert run.ps is not None
        worker_id = run.ps.worker_id
        target = self.result_dir(run.job_id)
        partial = target.with_name(target.name + ".partial")
        deadline = self._clock() + self.jobs_cfg.result_timeout_s
        delay = 0.2
        while True:
            await asyncio.to_thread(_fresh_dir, partial)
            try:
                stub = await self._worker_stub(worker_id)
                stream = stub.PullTensors(
                    worker_pb2.PullTensorsRequest(job_id=run.job_id, kind=RESULT_KIND),
                    timeout=max(1.0, deadline - self._clock()),
                )
                files = await _write_files(stream, partial)
                if not files:
                    raise DataLossError("the result stream held no files")
                break
            except (grpc.aio.AioRpcError, HyphaError, OSError) as err:
                if self._clock() + delay >= deadline or _is_refusal(err):
                    await asyncio.to_thread(shutil.rmtree, partial, True)
                    raise JobFailed(f"pulling the result from {worker_id} failed: {_describe(err)}") from err
                log.info(
                    "job %s: result pull from %s failed (%s); retrying", run.job_id, worker_id, _describe(err)
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        size = sum(path.stat().st_size for path in files)
        await asyncio.to_thread(_replace_dir, partial, target)
        if self.metrics is not None:
            self.metrics.bytes_moved.inc(size, kind="result_pull")
        return target

    async def _store_progress(self, run: _DilocoRun, *, force: bool = False, message: str = "") -> None:
        now = self._clock()
        if not force and now - run.last_store_at < self.jobs_cfg.progress_store_interval_s:
            return
        run.last_store_at = now
        loss = _latest_loss(run)
        metrics = [
            WorkerMetric(t.worker_id, t.samples_per_second, t.samples, t.loss, t.batch_size)
            for t in run.trainers.values()
        ]
        changes: dict[str, Any] = {"round": run.completed}
        if loss is not None:
            changes["loss"] = loss
        try:
            await self.store.update(run.job_id, message=message, worker_metrics=metrics, **changes)
        except HyphaError as err:
            log.debug("job %s: progress not stored: %s", run.job_id, err)

    # ---- leases lost ---------------------------------------------------------------------------

    async def _lease_events(self, queue: asyncio.Queue[LeaseEvent]) -> None:
        while True:
            event = await queue.get()
            if event.kind is not LeaseEventKind.LOST:
                continue
            run = self._by_lease.pop(event.lease.lease_id, None)
            if run is None:
                continue
            run.leases.pop(event.lease.lease_id, None)
            worker_id = event.lease.worker_id
            if isinstance(run, _TaskRun):
                if worker_id == run.worker_id:
                    _resolve(
                        run.outcome, (Outcome.WORKER_LOST, -1, f"worker {worker_id} lost: {event.reason}")
                    )
            elif isinstance(run, _DilocoRun):
                if run.ps is not None and event.lease.lease_id == run.ps.lease_id:
                    _resolve(run.ended, (False, f"parameter server {worker_id} lost: {event.reason}"))
                elif worker_id in run.trainers and not _finished_job(run):
                    self._spawn(
                        self._replace_trainer(
                            run, worker_id, f"trainer {worker_id} lost: {event.reason}", lost=True
                        ),
                        f"replace trainer {worker_id}",
                    )

    # ---- worker calls ----------------------------------------------------------------------------

    async def _worker_stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        channel = await self.market.connector.channel(
            worker_id, list(self.market.worker_addresses(worker_id))
        )
        return worker_pb2_grpc.WorkerStub(channel)

    async def _dispatch(self, lease: HeldLease, request: worker_pb2.DispatchJobRequest) -> None:
        stub = await self._worker_stub(lease.worker_id)
        try:
            await stub.DispatchJob(request, timeout=self.jobs_cfg.dispatch_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                await self.market.connector.invalidate(lease.worker_id)
            raise

    async def _cancel_on(self, worker_id: str, job_id: str) -> None:
        try:
            stub = await self._worker_stub(worker_id)
            await stub.CancelJob(
                worker_pb2.CancelExecutionRequest(job_id=job_id, reason="job ended"),
                timeout=self.jobs_cfg.cancel_timeout_s,
            )
        except (grpc.aio.AioRpcError, HyphaError) as err:
            # Releasing the lease ends the execution on the worker anyway.
            log.debug("cancelling job %s on %s failed: %s", job_id, worker_id, _describe(err))

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# ---- helpers -----------------------------------------------------------------------------------


def _resolve(future: asyncio.Future[Any] | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _finished_job(run: _DilocoRun) -> bool:
    return run.ended is not None and run.ended.done()


def _price(msg: common_pb2.PriceRange) -> PriceRange | None:
    """The job's price range; unset (zeros) means the scheduler's default."""
    if msg.bid == 0 and msg.max == 0:
        return None
    return PriceRange.from_proto(msg)


def _attempt_end(state: int, exit_code: int, message: str) -> AttemptEnd:
    """A final report as an attempt's end.

    NOTE: a worker only cancels on its own when it goes away (shutdown, its
    lease ended): for the job that is a lost worker, not a client's cancel.
    """
    outcome = Outcome.from_report(state, exit_code)
    if outcome is Outcome.CANCELLED:
        outcome = Outcome.WORKER_LOST
    return outcome, exit_code, message


def _latest_loss(run: _DilocoRun) -> float | None:
    """Mean trainer loss of the latest round any trainer reported, else the live mean."""
    if run.losses:
        latest = max(run.losses)
        values = list(run.losses[latest].values())
        return sum(values) / len(values)
    live = [t.loss for t in run.trainers.values() if t.loss > 0 and math.isfinite(t.loss)]
    return sum(live) / len(live) if live else None


async def _write_files(stream: Any, target: Path) -> list[Path]:
    """Write a ``PullTensors`` result stream into ``target``, verifying each file's sha256.

    Each file's first chunk names it (metadata ``path``, relative) and its last
    carries its sha256; a file is written only once complete and verified.
    NOTE: one file is held in memory at a time (results are a config and one
    safetensors file; a very large model would want a spooled write).
    """
    written: list[Path] = []
    name = ""
    parts: list[bytes] = []
    digest = hashlib.sha256()
    async for piece in stream:
        chunk = piece.chunk
        if chunk.metadata.get("path"):
            if name:
                raise DataLossError(f"result file {name!r} ended without its checksum")
            name = chunk.metadata["path"]
            relative = PurePosixPath(name)
            if relative.is_absolute() or ".." in relative.parts:
                raise PermissionDeniedError(f"result file {name!r} escapes the result dir")
            parts, digest = [], hashlib.sha256()
        if not name:
            raise DataLossError("result stream started without a file name")
        parts.append(chunk.data)
        digest.update(chunk.data)
        if chunk.last:
            if chunk.sha256 and chunk.sha256 != digest.hexdigest():
                raise DataLossError(f"result file {name!r} failed its sha256 check")
            path = target / PurePosixPath(name)
            await asyncio.to_thread(_write_file, path, b"".join(parts))
            written.append(path)
            name, parts = "", []
    if name:
        raise DataLossError(f"result file {name!r} was cut off")
    return written


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _replace_dir(source: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    source.rename(target)


def _is_refusal(err: BaseException) -> bool:
    """Errors that retrying cannot fix (everything else, NOT_FOUND included, is retried)."""
    if isinstance(err, grpc.aio.AioRpcError):
        return err.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
    return isinstance(err, PermissionDeniedError)


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name} {err.details() or ''}".strip()
    if isinstance(err, HyphaError):
        return err.message
    return repr(err)


__all__ = ["DatasetProviders", "JobFailed", "Orchestrator", "provider_peer"]
