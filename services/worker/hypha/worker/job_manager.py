"""The job manager: one executor process per dispatched job, from work dir to cleanup.

For each ``DispatchJob`` the manager

1. refuses a model factory not on its allowlist (``hypha.factories``), checks
   capacity (concurrent jobs, GPU slots: ``gpu_slots``) and turns the spec
   into an ``ExecutorPlan`` (``executors``);
2. prepares the job's private work dir (``work_dirs``), opens the job's
   tensor inboxes and starts its bridge;
3. has its ``supervisor`` start the executor's process group in the sandbox
   and watch it (timeout, completion marker, the memory and disk its lease
   grants: ``lease_limits``), and stop it on cancellation or
   lease expiry (a DiLoCo execution waits ``reattach_grace_s`` for its
   restarted scheduler first);
4. when the supervisor has settled the final state, reports it to the
   scheduler, keeps the result dir, frees the GPU slots and cleans up the
   work dir per policy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from hypha import factories
from hypha.errors import (
    AlreadyExistsError,
    HyphaError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from hypha.market.resources import ExecutorKind, Resources
from hypha.service import Service
from hypha.worker.bridge import BridgeContext, JobBridge
from hypha.worker.bridge_slices import SliceSource
from hypha.worker.execution import Execution, is_reattach, is_rewiring
from hypha.worker.execution_cleanup import ExecutionCleanup
from hypha.worker.execution_state import ExecutionRecord, JobDispatch, StopCause
from hypha.worker.gpu_slots import GpuSlots
from hypha.worker.jobs_config import ConfiguredExecutor, JobsSection
from hypha.worker.model_fetch import ResourceFetcher
from hypha.worker.reference_job import execution_plan
from hypha.worker.scheduler_link import LogForwarder, LogSink, SchedulerLink
from hypha.worker.supervisor import Supervisor
from hypha.worker.transfer import TensorExchange
from hypha.worker.work_dirs import WorkDirs

log = logging.getLogger(__name__)

#: Builds the scheduler link of one execution (the dispatching scheduler, by id and addresses).
LinkFactory = Callable[[JobDispatch], SchedulerLink]
#: What a lease (by id) grants, or None when this worker does not know it.
LeaseGrants = Callable[[str], Resources | None]


class JobManager(Service):
    """Runs executions; ``start()``/``stop()`` (idempotent) bracket its life, ``async with`` too."""

    def __init__(
        self,
        settings: JobsSection,
        work_root: Path,
        *,
        exchange: TensorExchange,
        link_factory: LinkFactory,
        worker_id: str = "",
        cpu_count: int | None = None,
        gpu_count: int = 0,
        slices: SliceSource | None = None,
        resources: ResourceFetcher | None = None,
        log_sink: LogSink | None = None,
        clock: Callable[[], float] = time.time,
        max_finished: int = 1000,
        hidden: Sequence[Path] = (),
        lease_grants: LeaseGrants | None = None,
        configured_executors: Sequence[ConfiguredExecutor] = (),
    ) -> None:
        """``hidden``: the worker's own files (key, config, state dir) no sandbox may show.

        ``lease_grants``: what each lease grants, which bounds the threads,
        memory and disk of the jobs under it; without it (or for a lease it
        does not know), the job's own minimum requirements do.
        """
        self.settings = settings
        self.work_root = Path(work_root)
        self.dirs = WorkDirs(self.work_root)
        self.exchange = exchange
        self.link_factory = link_factory
        self.worker_id = worker_id
        self.cpu_count = max(1, cpu_count or os.cpu_count() or 1)
        self.gpus = GpuSlots(
            settings.gpus if settings.gpus is not None else gpu_count, settings.max_jobs_per_gpu
        )
        self.slices = slices
        self.resources = resources or ResourceFetcher(settings.hub_settings(self.work_root))
        self.log_sink = log_sink
        self.lease_grants = lease_grants
        #: ``[[executors]]``: trainer programs a DiLoCo job may name (``reference_job``).
        self.configured_executors = tuple(configured_executors)
        self._clock = clock
        self._max_finished = max_finished
        self._active: dict[tuple[str, ExecutorKind], Execution] = {}
        self._finished: OrderedDict[str, Execution] = OrderedDict()
        self._accepting = False
        self._stopped = False
        self.supervisor = Supervisor(settings, hidden=(self.work_root, *hidden), clock=clock)
        self.cleanup = ExecutionCleanup(self.gpus, self.exchange, self.dirs, settings)

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the sandbox, kill a previous run's executors, sweep old dirs; then accept jobs."""
        await self.supervisor.start(self.dirs.jobs_dir)
        await asyncio.to_thread(self.dirs.create)
        busy = {execution.work_dir for execution in self._active.values()}
        await asyncio.to_thread(self.dirs.sweep, self.settings.retain_s, busy)
        await self.supervisor.start_warm(self.dirs.jobs_dir)
        self._accepting = True

    async def stop(self, reason: str = "worker shutting down") -> None:
        """Stop intake, stop every execution (grace, then kill), wait for their cleanup."""
        self._accepting = False
        if self._stopped:
            return
        self._stopped = True
        running = list(self._active.values())
        for execution in running:
            self.supervisor.stop(execution, StopCause.CANCEL, reason)
        bound = self.settings.stop_grace_s + self.settings.status_timeout_s + 10.0
        waits = [execution.done.wait() for execution in running]
        if waits:
            try:
                async with asyncio.timeout(bound):
                    await asyncio.gather(*waits)
            except TimeoutError:
                log.warning("%d job(s) did not finish cleaning up within %.0f s", len(running), bound)
        await self.supervisor.stop_warm()

    # ---- the API the servicer and the lease side call ------------------------------------

    async def dispatch(self, dispatch: JobDispatch) -> ExecutionRecord:
        """Start an execution; its record is returned once the process runs (or failed to start)."""
        if not self._accepting:
            raise UnavailableError("this worker is not accepting jobs (starting or shutting down)")
        dispatch.validate()
        model = dispatch.profile.job.model(dispatch.spec)
        if model is not None and model.torch_factory:
            factories.check(model.torch_factory, self.settings.model_factories)
        running = self._active.get(dispatch.key)
        if running is not None:
            if is_reattach(running, dispatch):
                running.leased = self._leased(dispatch)
                running.reattach(dispatch)
                return running.record
            if is_rewiring(running.dispatch, dispatch):
                running.rewire(dispatch)
                return running.record
            raise AlreadyExistsError(f"job {dispatch.job_id} ({dispatch.executor.value}) already runs here")
        if len(self._active) >= self.settings.max_concurrent_jobs:
            raise ResourceExhaustedError(f"{len(self._active)} jobs already run on this worker")
        work_dir = self.dirs.job_dir(dispatch.job_id, dispatch.executor.value)
        plan = execution_plan(dispatch, work_dir, self.settings, self.configured_executors)
        requirements = dispatch.requirements().minimum
        wanted_gpus = max(math.ceil(requirements.gpu), dispatch.profile.gpus(dispatch.spec))
        leased = self._leased(dispatch)
        gpus = self.gpus.acquire(wanted_gpus, dispatch.key)
        now = self._clock()
        record = ExecutionRecord(
            dispatch.job_id, f"{dispatch.job_id}-{dispatch.attempt}-{uuid.uuid4().hex[:8]}", created_at=now
        )
        link = self.link_factory(dispatch)
        execution = Execution(
            dispatch=dispatch,
            record=record,
            work_dir=work_dir,
            plan=plan,
            gpus=gpus,
            threads=self._threads(leased.cpu),
            link=link,
            logs=LogForwarder(
                link,
                dispatch.job_id,
                worker_id=self.worker_id,
                attempt=dispatch.attempt,
                executor=dispatch.executor.value,
                max_pending=self.settings.log_queue_max,
                max_line_bytes=self.settings.max_log_line_bytes,
                sink=self.log_sink,
                clock=self._clock,
            ),
            leased=leased,
        )
        self._active[dispatch.key] = execution
        execution.logs.start()
        try:
            await self._prepare(execution)
            if not record.state.terminal:
                await self.supervisor.spawn(execution)
        except Exception as err:
            message = err.message if isinstance(err, HyphaError) else f"{type(err).__name__}: {err}"
            log.warning("job %s failed to start: %s", dispatch.job_id, message)
            if not record.state.terminal:
                record.start_failed(self._clock(), f"failed to start: {message}")
        if record.state.terminal:  # failed to start, or cancelled while starting
            await self._finish(execution)
            return record
        execution.supervisor = asyncio.create_task(
            self._supervise(execution), name=f"job-{dispatch.job_id}-{dispatch.executor.value}"
        )
        return record

    def dispatched_by(self, job_id: str, executor: ExecutorKind) -> str | None:
        """The scheduler that dispatched the live ``executor`` execution of ``job_id``, if one runs."""
        execution = self._active.get((job_id, executor))
        return None if execution is None else execution.dispatch.scheduler_id

    def live_dispatches(self, job_id: str) -> list[JobDispatch]:
        """The dispatches of ``job_id``'s live executions here (one per executor kind), for
        ``job_scope``'s owner and member checks."""
        return [
            execution.dispatch for execution in self._active.values() if execution.dispatch.job_id == job_id
        ]

    async def cancel(self, job_id: str, reason: str, *, scheduler_id: str | None = None) -> bool:
        """Stop every execution of ``job_id`` (only those ``scheduler_id`` dispatched, when given)."""
        hit = False
        for execution in list(self._active.values()):
            dispatch = execution.dispatch
            if dispatch.job_id != job_id:
                continue
            if scheduler_id is not None and dispatch.scheduler_id != scheduler_id:
                continue
            self.supervisor.stop(execution, StopCause.CANCEL, reason or "cancelled")
            hit = True
        return hit

    async def cancel_jobs_for_lease(self, lease_id: str, reason: str, *, expired: bool = False) -> list[str]:
        """The lease side's hook: a lease ended, so every job under it stops. Returns their ids.

        ``expired`` (nobody renewed it, rather than its holder releasing it): a
        DiLoCo execution keeps running for ``reattach_grace_s`` in case its
        scheduler is restarting, and stops then unless it was taken back
        (``execution.is_reattach``); it is not among the ids returned.
        """
        stopped = []
        grace_s = self.settings.reattach_grace_s
        for execution in list(self._active.values()):
            if execution.dispatch.lease_id != lease_id:
                continue
            if expired and grace_s > 0 and execution.dispatch.profile.reattachable:
                execution.orphaned = lease_id
                line = (
                    f"lease {lease_id} expired: its scheduler is away; "
                    f"running on up to {grace_s:g} s for it to take the job back"
                )
                execution.logs.line("system", line)
                log.info("job %s (%s) %s", execution.dispatch.job_id, execution.dispatch.executor.value, line)
                execution.helper(self._end_orphan(execution, lease_id, grace_s), "orphan")
                continue
            self.supervisor.stop(execution, StopCause.CANCEL, reason or f"lease {lease_id} ended")
            stopped.append(execution.dispatch.job_id)
        return stopped

    async def _end_orphan(self, execution: Execution, lease_id: str, grace_s: float) -> None:
        """Stop an execution whose expired lease nobody took back within ``grace_s``."""
        if await execution.exited_within(grace_s) or execution.orphaned != lease_id:
            return
        self.supervisor.stop(
            execution,
            StopCause.CANCEL,
            f"lease {lease_id} expired and its scheduler did not take the job back within {grace_s:g} s",
        )

    def get(self, job_id: str) -> ExecutionRecord:
        """The job's execution here: a live one first, else the latest finished; NotFoundError if none."""
        live = [e.record for e in self._active.values() if e.record.job_id == job_id]
        if live:
            return max(live, key=lambda record: record.created_at)
        done = [e.record for e in self._finished.values() if e.record.job_id == job_id]
        if done:
            return max(done, key=lambda record: record.created_at)
        raise NotFoundError(f"no job {job_id!r} on this worker")

    def records(self) -> list[ExecutionRecord]:
        return [e.record for e in self._active.values()] + [e.record for e in self._finished.values()]

    def result_dir(self, job_id: str) -> Path | None:
        """Where the job's result is (``/v1/result``), if it named one; see ``result_of``."""
        found = self.result_of(job_id)
        return None if found is None else found[0]

    def result_of(self, job_id: str) -> tuple[Path, str] | None:
        """(result dir, dispatching scheduler id) of the job's newest execution that named a result.

        Live executions are searched too: the final status report (after which
        a scheduler may pull the result) goes out just before an execution
        leaves the live set, and the result is already in its kept place then.
        """
        executions = [*self._active.values(), *reversed(self._finished.values())]
        for execution in executions:
            record = execution.record
            if record.job_id == job_id and record.result_dir and Path(record.result_dir).is_dir():
                return Path(record.result_dir), execution.dispatch.scheduler_id
        return None

    async def wait(self, job_id: str, timeout_s: float | None = None) -> ExecutionRecord:
        """Wait until no execution of ``job_id`` runs; its (latest) record."""
        async with asyncio.timeout(timeout_s):
            for execution in [e for e in self._active.values() if e.dispatch.job_id == job_id]:
                await execution.done.wait()
        return self.get(job_id)

    # ---- preparing and starting -------------------------------------------------------------

    def _leased(self, dispatch: JobDispatch) -> Resources:
        """What the dispatch's lease grants; the job's own minimum where the lease is unknown here.

        NOTE: a lease can grant more than the job's minimum (``whole`` offers
        sell the whole free machine), and the job may use all it paid for.
        """
        granted = self.lease_grants(dispatch.lease_id) if self.lease_grants is not None else None
        if granted is not None:
            return granted
        return Resources.from_proto(dispatch.requirements().minimum)

    def _threads(self, cpu: float) -> int:
        if self.settings.threads_per_job is not None:
            wanted = self.settings.threads_per_job
        elif cpu > 0:
            wanted = math.ceil(cpu)
        else:
            wanted = self.cpu_count // (len(self._active) + 1)  # this job included
        return max(1, min(self.cpu_count, wanted))

    async def _prepare(self, execution: Execution) -> None:
        work_dir = execution.work_dir
        self.supervisor.claim_warm(execution)  # before anything is put in the work dir
        await asyncio.to_thread(self.dirs.make_private, work_dir)
        dispatch = execution.dispatch
        if dispatch.profile.prepare is not None:
            await asyncio.to_thread(dispatch.profile.prepare, dispatch.spec, dispatch.files_bundle, work_dir)
        self.exchange.open_job(execution.dispatch.job_id)
        execution.exchange_open = True
        bridge = JobBridge(
            BridgeContext(
                dispatch=execution.dispatch,
                work_dir=work_dir,
                record=execution.record,
                link=execution.link,
                exchange=self.exchange,
                logs=execution.logs,
                resources=self.resources,
                slices=self.slices,
                limits=self.settings.bridge_limits(),
            )
        )
        await bridge.start()
        execution.bridge = bridge

    # ---- supervising and finishing ------------------------------------------------------------

    async def _supervise(self, execution: Execution) -> None:
        """The execution's supervisor task: its process to its final state, then its cleanup."""
        try:
            await self.supervisor.supervise(execution)
        finally:
            await self._finish(execution)

    async def _finish(self, execution: Execution) -> None:
        """Free everything the execution held (``ExecutionCleanup``); runs once, whatever happened."""
        dispatch, record = execution.dispatch, execution.record
        try:
            await self.cleanup.run(execution)
        finally:
            self._active.pop(dispatch.key, None)
            self._finished[record.execution_id] = execution
            while len(self._finished) > self._max_finished:
                self._finished.popitem(last=False)
            execution.done.set()
            log.info(
                "job %s (%s) %s: %s",
                dispatch.job_id,
                dispatch.executor.value,
                record.state.value,
                record.message,
            )


__all__ = ["JobManager", "LinkFactory"]
