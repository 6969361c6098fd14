"""The active jobs of one scheduler: the interface each job kind implements, and their registry.

A ``JobRun`` is one job while an asyncio task drives it; each kind (a task
job, ``hypha.scheduler.task_job``; a DiLoCo job, ``hypha.scheduler.diloco.run``)
is a subclass, and the orchestrator never asks which kind it holds: it hands
a worker's report to the run (``on_status``, ``on_progress``, ``next_slice``,
``on_metrics``) and a lost lease to ``on_lease_lost``.

``RunRegistry`` owns what every run shares: the runs by job id, the leases
each holds (and which run holds a lease, so a lost lease finds its job), the
calls that lease and release workers, and the life of a run's task:
``launch`` drives it in one trace span, finishes the job if the run raised,
and always cancels what still runs for it on workers and releases its leases.

Decisions (NOTE):
- A run that raises ``JobFailed`` ends FAILED with that message; any other
  error ends it FAILED as "orchestration failed", unless the job was ended
  elsewhere meanwhile (a client's cancel), which is left as it is.
- A run cancelled because the scheduler stops is not finished: the job stays
  as it is in the store and ``JobStore.recover`` settles it at the next start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterator
from typing import Any, ClassVar

import grpc
from opentelemetry import trace

from hypha.errors import FailedPreconditionError, HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.pricing import PriceRange
from hypha.market.resources import Requirements
from hypha.net.backoff import Backoff
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.market import SchedulerMarket
from hypha.scheduler.metrics import SchedulerMetrics
from hypha.scheduler.store import JobRecord, JobStore
from hypha.scheduler.worker_calls import WorkerCalls
from hypha.service import BackgroundTasks
from hypha.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("hypha.scheduler")


#: The longest pause between two market tries of a queued single-worker job.
MAX_QUEUE_RETRY_S = 30.0
#: The longest pause between two market tries of a DiLoCo job missing workers (``lease_many``).
MAX_LEASE_PAUSE_S = 8.0
#: First pause between two dispatches that found an execution of the job still winding down.
REDISPATCH_PAUSE_S = 0.2
REDISPATCH_PAUSE_MAX_S = 2.0


class JobFailed(HyphaError):
    """Ends a job as FAILED with this message as the reason."""


class Shortfall(JobFailed):
    """Fewer free workers than wanted within the wait; the leases that were got are given back.

    A job that has not started yet waits in the queue for its next try instead of failing:
    two starting jobs that each hold part of what they need must not keep it from each other.
    """


class JobRun(ABC):
    """One active job: what the orchestrator asks of every kind."""

    #: The job kind, as in ``JobRecord.kind`` and the trace span.
    kind: ClassVar[str]

    def __init__(self, job: JobRecord, runs: RunRegistry) -> None:
        self.job_id = job.job_id
        self.spec = job.spec
        self.runs = runs
        self.task: asyncio.Task[None] | None = None
        #: Who cancelled it (None: not cancelled).
        self.cancelled_by: str | None = None
        #: Every worker that ever ran a part of it (their late reports and logs are still accepted).
        self.participants: set[str] = set()
        #: Being rebuilt after a scheduler restart (a kind that resumes sets it from the start):
        #: its workers are not all known yet, so a report from one that is not a participant (yet)
        #: is answered "try again", not refused.
        self.resuming = False
        #: The leases it holds, by lease id.
        self.leases: dict[str, HeldLease] = {}

    @property
    def resumable(self) -> bool:
        """A restarted scheduler takes the job back as it runs (``diloco.resume``), so a graceful
        stop leaves its leases to expire on the workers rather than stopping its executions."""
        return False

    @abstractmethod
    async def drive(self, job: JobRecord) -> None:
        """Take the job from PENDING to its end; raising ``JobFailed`` ends it FAILED."""

    @abstractmethod
    def on_lease_lost(self, lease: HeldLease, reason: str) -> None:
        """One of its leases lapsed (the worker is gone or cut off); the lease is no longer held."""

    @abstractmethod
    def on_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None:
        """A worker reported that its execution of this job ended (a final state)."""

    async def on_progress(
        self, worker_id: str, report: scheduler_pb2.ProgressReport
    ) -> scheduler_pb2.Directive:
        """A trainer's progress: what it does next."""
        raise FailedPreconditionError(f"job {self.job_id} is not a running DiLoCo job")

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse:
        """The next data slice a trainer works on."""
        raise FailedPreconditionError(f"job {self.job_id} has no data slices")

    async def on_metrics(self, worker_id: str, round_: int, values: dict[str, float]) -> None:
        """A worker's metrics for a round (already stored); kinds that steer by them override this."""
        return

    def samples_per_second(self, worker_id: str) -> float:
        """How fast ``worker_id`` works on this job (0: not measured)."""
        return 0.0


def _second_on_its_worker(run: JobRun, lease: HeldLease) -> bool:
    """``run`` took another lease on ``lease``'s worker before this one (``lease_many``'s NOTE)."""
    first = next((held for held in run.leases.values() if held.worker_id == lease.worker_id), None)
    return first is not None and first.lease_id != lease.lease_id


class RunRegistry:
    """The active runs, the leases they hold, and the life of each run's task."""

    def __init__(
        self,
        market: SchedulerMarket,
        store: JobStore,
        calls: WorkerCalls,
        section: SchedulerSection,
        *,
        metrics: SchedulerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.market = market
        self.store = store
        self.calls = calls
        self.section = section
        self.jobs_cfg = section.jobs
        self.metrics = metrics
        self.clock = clock
        self.background = BackgroundTasks(log)
        self._runs: dict[str, JobRun] = {}
        self._by_lease: dict[str, JobRun] = {}
        self._allocations = asyncio.Semaphore(self.jobs_cfg.max_parallel_allocations)

    def get(self, job_id: str) -> JobRun | None:
        return self._runs.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._runs

    def __iter__(self) -> Iterator[JobRun]:
        return iter(list(self._runs.values()))

    # ---- the life of a run ------------------------------------------------------------

    def launch(self, run: JobRun, job: JobRecord) -> None:
        """Drive ``run`` in its own task until the job ends (or the scheduler stops)."""
        self._runs[run.job_id] = run
        run.task = asyncio.create_task(self._drive(run, job), name=f"job {run.job_id}")

    async def _drive(self, run: JobRun, job: JobRecord) -> None:
        # One span covers the whole job; the gRPC calls made for it (leases, dispatch, result
        # pulls) are its children, so a trace shows a job end to end.
        attributes = {"hypha.job_id": run.job_id, "hypha.job_kind": run.kind}
        with _tracer.start_as_current_span("hypha.job", attributes=attributes):
            stopping = False
            try:
                await run.drive(job)
            except asyncio.CancelledError:
                if run.cancelled_by is None:
                    stopping = True
                    raise  # the scheduler is stopping: the job stays as it is in the store
                await self.finish_job(run, JobState.CANCELLED, Reason.CANCELLED.format(who=run.cancelled_by))
            except JobFailed as err:
                await self.finish_job(run, JobState.FAILED, err.message)
            except Exception as err:
                current = await self.store.find(run.job_id)
                if current is not None and current.state.terminal:
                    # Cancelled (or otherwise ended) by someone else meanwhile: our next
                    # conditional update failed, as it should.
                    log.info("job %s ended elsewhere (%s): %s", run.job_id, current.state.value, err)
                else:
                    log.exception("job %s: orchestration failed", run.job_id)
                    await self.finish_job(run, JobState.FAILED, f"orchestration failed: {err}")
            finally:
                if stopping and run.resumable:
                    self._leave_running(run)
                else:
                    await self.release_all(run)
                self._runs.pop(run.job_id, None)

    def _leave_running(self, run: JobRun) -> None:
        """The scheduler stops and ``run`` resumes after a restart: its leases are neither
        released nor cancelled, only no longer renewed. Taken back within their life, nothing
        stops; expired, the workers keep the executions for ``worker.jobs.reattach_grace_s``."""
        leases = self._forget_leases(run)
        self.market.leave(lease.lease_id for lease in leases)
        log.info("job %s: %d leases left running for the next start to take back", run.job_id, len(leases))

    async def finish_job(self, run: JobRun, target: JobState, reason: str, **changes: Any) -> None:
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

    # ---- leases -----------------------------------------------------------------------

    def track_lease(self, run: JobRun, lease: HeldLease) -> None:
        """``run`` holds ``lease`` from now on (its worker may report on the job)."""
        run.leases[lease.lease_id] = lease
        run.participants.add(lease.worker_id)
        self._by_lease[lease.lease_id] = run

    def lease_lost(self, lease: HeldLease) -> JobRun | None:
        """Forget a lease the market lost; the run that held it, if any."""
        run = self._by_lease.pop(lease.lease_id, None)
        if run is not None:
            run.leases.pop(lease.lease_id, None)
        return run

    async def release_lease(self, run: JobRun, lease: HeldLease, *, cancel: bool = True) -> None:
        """Give ``lease`` back to the market, cancelling the job's execution on it first if ``cancel``."""
        run.leases.pop(lease.lease_id, None)
        self._by_lease.pop(lease.lease_id, None)
        if cancel:
            await self.calls.cancel(lease.worker_id, run.job_id)
        await self.market.release(lease.lease_id)

    def _forget_leases(self, run: JobRun) -> list[HeldLease]:
        """Every lease ``run`` holds, no longer its or tracked here (the caller ends them)."""
        leases = list(run.leases.values())
        run.leases.clear()
        for lease in leases:
            self._by_lease.pop(lease.lease_id, None)
        return leases

    async def release_all(self, run: JobRun) -> None:
        """Stop whatever still runs for the job and give its leases back."""
        leases = self._forget_leases(run)
        await asyncio.gather(*(self.calls.cancel(lease.worker_id, run.job_id) for lease in leases))
        await asyncio.gather(*(self.market.release(lease.lease_id) for lease in leases))

    async def lease_one_or_requeue(
        self,
        run: JobRun,
        requirement: Requirements,
        price: PriceRange | None,
        policy: str,
        misses: int,
        what: str = "worker",
    ) -> HeldLease | None:
        """One lease for a single-worker job, or back to PENDING for a while (None).

        The job must be ALLOCATING. The pause doubles with each miss (``misses``,
        counted by the caller) up to ``MAX_QUEUE_RETRY_S``, so an unservable job
        neither floods its history nor keeps the market busy.
        """
        leases = await self.allocate(run, requirement, 1, price, policy)
        if leases:
            return leases[0]
        wait_s = min(self.jobs_cfg.queue_retry_s * 2**misses, MAX_QUEUE_RETRY_S)
        await self.store.transition(
            run.job_id,
            JobState.PENDING,
            expected=JobState.ALLOCATING,
            reason=f"no {what} offered; trying again in {wait_s:.0f}s",
        )
        await asyncio.sleep(wait_s)
        return None

    async def allocate(
        self,
        run: JobRun,
        requirement: Requirements,
        count: int,
        price: PriceRange | None,
        policy: str,
        exclude: Collection[str] = (),
    ) -> list[HeldLease]:
        """One try at the market for up to ``count`` leases (at most ``max_parallel_allocations`` at once)."""
        async with self._allocations:
            started = self.clock()
            leases = await self.market.allocate(
                requirement, count, price, policy or None, tag=run.job_id, exclude=exclude
            )
            if self.metrics is not None and leases:
                self.metrics.allocation_seconds.observe(self.clock() - started)
        for lease in leases:
            self.track_lease(run, lease)
        return leases

    async def lease_many(
        self,
        run: JobRun,
        requirement: Requirements,
        count: int,
        price: PriceRange | None,
        policy: str,
        *,
        exclude: Collection[str] = (),
        what: str = "trainers",
        patience_s: float | None = None,
    ) -> list[HeldLease]:
        """``count`` leases on distinct workers not in ``exclude``.

        Tried again until ``patience_s`` (default ``allocate_wait_s``) passed,
        pausing between tries with jittered backoff from ``queue_retry_s`` up to
        ``MAX_LEASE_PAUSE_S``: a worker may free up (another job ends, a killed
        machine comes back) at any time, so a short miss must not fail the job,
        yet an empty market must not be hammered either. Gives up at once when
        the run's task ended (nothing would use the leases any more).

        NOTE: a job runs one part per worker, yet its paths lease side by side
        (two trainers lost at once are replaced together, a parameter server is
        restored while a trainer is replaced), each excluding the workers it
        knew when it began; two may be offered the same worker. The lease the
        run took first keeps it; a later one on that worker is given back and
        another bought (``_second_on_its_worker``).
        """
        wait_s = self.jobs_cfg.allocate_wait_s if patience_s is None else patience_s
        deadline = self.clock() + wait_s
        pause = Backoff(self.jobs_cfg.queue_retry_s, max(self.jobs_cfg.queue_retry_s, MAX_LEASE_PAUSE_S))
        held: list[HeldLease] = []
        #: Workers not to be offered again: taken by another of the run's paths meanwhile (NOTE).
        busy: set[str] = set()
        while len(held) < count:
            taken = set(exclude) | busy | {h.worker_id for h in held}
            got = await self.allocate(run, requirement, count - len(held), price, policy, taken)
            for lease in got:
                if lease.worker_id in taken or _second_on_its_worker(run, lease):
                    busy.add(lease.worker_id)
                    await self.release_lease(run, lease, cancel=False)
                else:
                    held.append(lease)
            if run.task is not None and run.task.done():
                for lease in held:
                    await self.release_lease(run, lease, cancel=False)
                raise JobFailed(f"the job ended while leasing {what}")
            if len(held) < count:
                left = deadline - self.clock()
                if left <= 0:
                    for lease in held:
                        await self.release_lease(run, lease, cancel=False)
                    raise Shortfall(
                        f"could lease only {len(held)} of {count} {what}: no free worker within {wait_s:g}s"
                    )
                if not got:
                    log.info("job %s: no free worker for %s yet; trying again", run.job_id, what)
                await asyncio.sleep(min(pause.next_delay(), left))
        return held

    async def dispatch_anew(
        self, run: JobRun, worker_id: str, dispatch: Callable[[], Awaitable[None]]
    ) -> None:
        """Send a new attempt of one of ``run``'s parts to ``worker_id`` (``dispatch`` sends it).

        An execution of the job still winding down there (a failed attempt, a
        part that was replaced or left) answers ALREADY_EXISTS: it is cancelled
        and the dispatch sent again, with a doubling pause, until
        ``jobs.dispatch_timeout_s`` passed.
        """
        deadline = self.clock() + self.jobs_cfg.dispatch_timeout_s
        pause = Backoff(REDISPATCH_PAUSE_S, REDISPATCH_PAUSE_MAX_S)
        while True:
            try:
                await dispatch()
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.ALREADY_EXISTS or self.clock() >= deadline:
                    raise
            await self.calls.cancel(worker_id, run.job_id)
            await asyncio.sleep(pause.next_delay())

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run a job's side work (replacing a trainer) in the background, cancelled at stop."""
        self.background.spawn(coro, name)

    async def stop(self) -> None:
        """Stop driving every run and its side work; the jobs stay as they are in the store."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await self.background.cancel()
        if tasks:
            await asyncio.wait(tasks)


def price_range(msg: common_pb2.PriceRange) -> PriceRange | None:
    """A job's price range; unset (zeros) means the scheduler's default."""
    if msg.bid == 0 and msg.max == 0:
        return None
    return PriceRange.from_proto(msg)


__all__ = ["JobFailed", "JobRun", "RunRegistry", "Shortfall", "price_range"]
