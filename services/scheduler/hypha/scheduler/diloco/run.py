"""DiLoCo jobs: one parameter server and ``num_workers`` trainers, driven round by round.

The package's hub: its state is one ``DilocoState``; its phases (``trainers``,
``ps_recovery``, ``elastic``, ``resume``) are functions over what it offers them
(``DilocoOps``, ``hypha.scheduler.diloco.state``).

ALLOCATING: find the dataset's providers in the DHT; lease one parameter
server and ``num_workers`` trainers with the job's requirements, prices and
policy; dispatch the parameter server (it learns the trainer ids), then the
trainers (they learn the parameter server). A job that finds fewer free
workers than it needs within ``jobs.allocate_wait_s`` gives back what it got
and waits PENDING (jittered backoff) for its next try, as a task job does, so
starting jobs never hold parts of the cluster from each other. RUNNING: progress reports are
answered by the job's planner (``round_planner``), slice requests by
its ``SliceTracker`` (``slice_tracker``) (with the providers as ``PeerInfo``), metrics go to the
store. A trainer that is lost (its lease lapsed) or fails gives its slices
back and is replaced through the market (``trainers``).
``ScaleJob`` grows or shrinks a running job the same way
(``elastic``). The job ends when the parameter server reports
success after the configured rounds: its result is pulled into the
scheduler's state dir (``hypha.scheduler.results``).

The parameter server is no single point of failure: each round's metrics
report is its commit, answered once the scheduler holds the round's state
(``ps_state``). When the server's process fails, it is
dispatched again on the same worker (a new attempt under the same lease);
when its lease is lost, a new one is leased through the market. Either way
the newest kept state is pushed to it, and every trainer is dispatched again
(its worker re-sends the round's delta to the restored server and routes its
tensors there); the round in flight is collected again
(``ps_recovery``, ``docs/fault-tolerance.md``).

Decisions (NOTE):
- Progress is written to the store at most every
  ``jobs.progress_store_interval_s`` (every trainer reports several times a
  second; watchers only need the latest), and always when a round completes.
- The run saves its own state (leases, trainers, slice assignments, rounds)
  in the store whenever it changes, only what changed (``snapshot``), so a
  restarted scheduler resumes the job (``resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import grpc

from hypha.dht.records import ProviderRecord
from hypha.errors import FailedPreconditionError, HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.resources import Requirements
from hypha.net.backoff import Backoff
from hypha.scheduler.diloco import elastic, link_fit
from hypha.scheduler.diloco.dispatch import dispatch_ps, dispatch_trainer
from hypha.scheduler.diloco.ps_recovery import commit, lease_servers, ps_trouble
from hypha.scheduler.diloco.ps_state import STATE_ROUND_KEY, StateKeeper
from hypha.scheduler.diloco.resume import resume
from hypha.scheduler.diloco.round_planner import PlannerFactory, Progress
from hypha.scheduler.diloco.slice_tracker import SliceTracker
from hypha.scheduler.diloco.snapshot import RunSaver
from hypha.scheduler.diloco.state import DilocoState
from hypha.scheduler.diloco.trainers import add_trainer, lease_trainers, replace_trainer
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.providers import DatasetProviders, provider_peer
from hypha.scheduler.results import keep_result
from hypha.scheduler.retry import Outcome, attempt_end
from hypha.scheduler.runs import MAX_QUEUE_RETRY_S, JobFailed, JobRun, RunRegistry, Shortfall, price_range
from hypha.scheduler.store import JobRecord, WorkerMetric
from hypha.scheduler.worker_calls import REFUSALS, describe
from hypha.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)


class DilocoRun(JobRun):
    """A DiLoCo job while it runs (see the module docstring); satisfies ``DilocoOps``."""

    kind = "diloco"

    def __init__(
        self,
        job: JobRecord,
        runs: RunRegistry,
        planners: PlannerFactory,
        providers: DatasetProviders | None,
        state_dir: Path,
    ) -> None:
        super().__init__(job, runs)
        self.planners = planners
        self.providers = providers
        self.state_dir = state_dir
        self.state = DilocoState(target_workers=int(job.spec.diloco.num_workers))
        #: The parameter server's state after the newest committed round.
        self.keeper = StateKeeper(state_dir, job.job_id)
        self._saver = RunSaver()
        #: A job the store hands back after a restart is rebuilt (``resume``) before any
        #: report is decided on: progress is answered CONTINUE meanwhile (``JobRun.resuming``).
        self.resuming = job.state is not JobState.PENDING

    @property
    def diloco(self) -> common_pb2.DilocoJobSpec:
        return self.spec.diloco

    @property
    def resumable(self) -> bool:
        """Started (its run state is saved) and not ended: ``ended`` is cancelled, not resolved,
        when the scheduler's stop cancels the run's task that awaits it."""
        ended = self.state.ended
        return self.state.ps_started and (ended is None or not ended.done() or ended.cancelled())

    # ---- the operations its phases use (``DilocoOps``) -----------------------------------

    async def lease(
        self,
        requirements: common_pb2.Requirements,
        price: common_pb2.PriceRange,
        count: int,
        *,
        exclude: Collection[str],
        what: str,
        patience_s: float | None = None,
    ) -> list[HeldLease]:
        return await self.runs.lease_many(
            self,
            Requirements.from_proto(requirements),
            count,
            price_range(price),
            self.diloco.selection_policy,
            exclude=exclude,
            what=what,
            patience_s=patience_s,
        )

    async def release(self, lease: HeldLease, *, cancel: bool) -> None:
        await self.runs.release_lease(self, lease, cancel=cancel)

    def holds(self, lease: HeldLease) -> bool:
        return lease.lease_id in self.leases

    def track(self, lease: HeldLease) -> None:
        self.runs.track_lease(self, lease)

    async def dispatch_anew(self, worker_id: str, dispatch: Callable[[], Awaitable[None]]) -> None:
        await self.runs.dispatch_anew(self, worker_id, dispatch)

    async def find_providers(self, dataset: str) -> list[ProviderRecord]:
        if self.providers is None:
            raise JobFailed(f"cannot look up dataset {dataset!r}: scheduler.dht_bootstrap is not configured")
        records = await self.providers.find_within(
            dataset, self.runs.jobs_cfg.provider_wait_s, self.runs.clock
        )
        if not records:
            raise JobFailed(f"no data node serves dataset {dataset!r}")
        return records

    async def save(self) -> None:
        await self._saver.save(self)

    # ---- what workers report ------------------------------------------------------------

    def on_lease_lost(self, lease: HeldLease, reason: str) -> None:
        state, worker_id = self.state, lease.worker_id
        if state.ps is not None and lease.lease_id == state.ps.lease_id:
            ps_trouble(self, f"parameter server {worker_id} lost: {reason}", lost=True)
        elif worker_id in state.trainers and not state.over:
            why = f"trainer {worker_id} lost: {reason}"
            self.runs.spawn(replace_trainer(self, worker_id, why, lost=True), f"replace trainer {worker_id}")

    def on_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None:
        state = self.state
        outcome = attempt_end(int(report.state), int(report.exit_code), report.message)[0]
        if state.ps is not None and worker_id == state.ps.worker_id:
            if int(report.attempt) != state.ps_attempt:
                return  # a server this job already replaced
            if outcome is Outcome.SUCCEEDED:
                state.end(True, report.message or outcome.value)
            else:
                ps_trouble(
                    self, f"parameter server on {worker_id} {outcome.value}: {report.message}", lost=False
                )
            return
        trainer = state.trainers.get(worker_id)
        if trainer is None or int(report.attempt) != trainer.attempt:
            return  # not a trainer, or the end of one this job already replaced on that worker
        if outcome is Outcome.SUCCEEDED:
            trainer.finished = True
        elif not state.over:
            why = f"trainer on {worker_id} {outcome.value}: {report.message}"
            self.runs.spawn(replace_trainer(self, worker_id, why), f"replace trainer {worker_id}")

    async def on_progress(
        self, worker_id: str, report: scheduler_pb2.ProgressReport
    ) -> scheduler_pb2.Directive:
        if self.resuming:
            # Its trainers are not all back yet (a restarted scheduler): DONE would stop one.
            return scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_CONTINUE, round=report.round)
        state = self.state
        if state.planner is None:
            raise FailedPreconditionError(f"job {self.job_id} is not a running DiLoCo job")
        trainer = state.trainers.get(worker_id)
        if trainer is None:
            return scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_DONE, round=report.round)
        progress = Progress.from_proto(report)
        directive = state.planner.report(worker_id, progress, self.runs.clock())
        trainer.samples = progress.samples
        trainer.loss = progress.loss
        rate = state.planner.rates().get(worker_id)
        if rate is not None:
            trainer.samples_per_second = rate
        await self._store_progress()
        return directive.to_proto()

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse:
        state = self.state
        tracker = state.tracker
        if tracker is None:
            raise FailedPreconditionError(f"job {self.job_id} has no data slices")
        marked = False
        for used in request.used:
            try:
                epoch = tracker.epoch
                tracker.mark_used(worker_id, int(used))
                marked = True
                # The audit trail the chaos benchmark checks "each slice once per epoch" against.
                log.debug("job %s: slice %d used in epoch %d by %s", self.job_id, used, epoch, worker_id)
            except HyphaError as err:  # a slice it lost (replaced, or reported twice): ignore
                log.debug("job %s: used slice %d from %s ignored: %s", self.job_id, used, worker_id, err)
        dataset = self.diloco.dataset
        if worker_id not in state.trainers:
            return scheduler_pb2.NextSliceResponse(available=False, dataset=dataset)
        try:
            index = tracker.next_slice(worker_id)
        except FailedPreconditionError:
            index = None  # it holds its prefetch allowance already
        if index is not None or marked:
            # Hand-outs and used marks must outlive a scheduler restart before the trainer hears
            # back: a trainer does not report a slice used twice, and a slice left handed out to
            # it would keep its epoch (and the job) from ever ending.
            await self.save()
        if index is None:
            return scheduler_pb2.NextSliceResponse(available=False, epoch=tracker.epoch, dataset=dataset)
        return scheduler_pb2.NextSliceResponse(
            available=True, index=index, epoch=tracker.epoch, dataset=dataset, providers=state.data_providers
        )

    async def on_metrics(self, worker_id: str, round_: int, values: dict[str, float]) -> None:
        state = self.state
        if state.ps is not None and worker_id == state.ps.worker_id:
            # The parameter server completed a round; its report is the round's commit.
            if STATE_ROUND_KEY in values:
                await commit(self, worker_id, int(values[STATE_ROUND_KEY]))
            if round_ + 1 > state.completed:
                now = self.runs.clock()
                metrics = self.runs.metrics
                if metrics is not None and state.round_started_at:
                    metrics.round_seconds.observe(now - state.round_started_at)
                state.round_started_at = now
                state.completed = round_ + 1
            await self._store_progress(force=True, message=f"round {round_} complete")
            await self.save()
            if len(state.trainers) > state.target_workers:  # a round boundary: scaled down
                self.runs.spawn(elastic.shrink_at_boundary(self), f"shrink job {self.job_id}")
            return
        if "loss" in values and math.isfinite(values["loss"]):
            state.losses.setdefault(round_, {})[worker_id] = values["loss"]
        trainer = state.trainers.get(worker_id)
        if trainer is not None and "samples_per_second" in values:
            trainer.samples_per_second = values["samples_per_second"]
            link_fit.refit(state.link_fit, state.planner, round_, values, self.job_id)
        await self._store_progress()

    def samples_per_second(self, worker_id: str) -> float:
        trainer = self.state.trainers.get(worker_id)
        return trainer.samples_per_second if trainer is not None else 0.0

    # ---- driving the job ----------------------------------------------------------------

    async def drive(self, job: JobRecord) -> None:
        runs, store, spec, state = self.runs, self.runs.store, self.diloco, self.state
        state.ended = asyncio.get_running_loop().create_future()
        if job.state is JobState.PENDING:
            await self.start()
        else:  # a job a restarted scheduler resumes (``JobStore.recover``)
            saved = await store.run_state(self.job_id)
            if saved is None:
                raise JobFailed(
                    Reason.SCHEDULER_RESTARTED.format(state=job.state.value) + "; nothing to resume"
                )
            try:
                await resume(self, saved)
            finally:
                self.resuming = False
            with contextlib.suppress(HyphaError):
                await store.transition(
                    self.job_id,
                    JobState.RUNNING,
                    expected=JobState.ALLOCATING,
                    reason=f"resumed from round {state.completed} on {len(state.trainers)} workers",
                    workers=state.worker_list(),
                )
        await self.save()
        state.round_started_at = runs.clock()
        succeeded, message = await state.ended
        if not succeeded:
            raise JobFailed(f"parameter server: {message}")
        assert state.ps is not None
        target = await keep_result(runs, state.ps.worker_id, self.job_id, self.state_dir)
        await self._store_progress(force=True)
        await self.keeper.drop()
        await runs.finish_job(
            self,
            JobState.SUCCEEDED,
            f"{spec.rounds} rounds done" + (f" ({message})" if message else ""),
            result_path=str(target),
            round=max(state.completed, int(spec.rounds)),
        )

    async def start(self) -> None:
        """PENDING to RUNNING: providers, leases, then the parameter server and the trainers."""
        runs, store, spec, state = self.runs, self.runs.store, self.diloco, self.state
        await store.transition(self.job_id, JobState.ALLOCATING, expected=JobState.PENDING)
        records = await self.find_providers(spec.dataset)
        state.data_providers = [provider_peer(record) for record in records]
        state.tracker = SliceTracker(max(record.slice_count for record in records))
        state.planner, state.link_fit = self.planners(spec), link_fit.link_fit_for(spec)
        queued = Backoff(runs.jobs_cfg.queue_retry_s, MAX_QUEUE_RETRY_S)
        while True:
            try:
                state.ps, trainer_leases = await self._lease_workers()
                break
            except Shortfall as short:
                # Nothing is held now: wait in the queue, so that two starting jobs that each got
                # part of the cluster do not keep it from each other, and try again.
                pause = queued.next_delay()
                await store.transition(
                    self.job_id,
                    JobState.PENDING,
                    expected=JobState.ALLOCATING,
                    reason=f"{short.message}; queued, trying again in {pause:.0f}s",
                )
                await asyncio.sleep(pause)
                await store.transition(self.job_id, JobState.ALLOCATING, expected=JobState.PENDING)
        for lease in trainer_leases:
            add_trainer(self, lease, attempt=0, start_round=0)
        try:
            await dispatch_ps(self)
            state.ps_started = True
            await asyncio.gather(*(dispatch_trainer(self, t) for t in list(state.trainers.values())))
        except grpc.aio.AioRpcError as err:
            # A worker refusing the job itself (e.g. a model factory off its allowlist) will
            # refuse it again: fail at once with its reason instead of an "orchestration failed".
            if err.code() in REFUSALS:
                raise JobFailed(f"a worker refused the job: {describe(err)}") from err
            raise
        await store.transition(
            self.job_id,
            JobState.RUNNING,
            reason=f"training on {len(state.trainers)} workers",
            workers=state.worker_list(),
        )

    async def _lease_workers(self) -> tuple[HeldLease, list[HeldLease]]:
        """The parameter server's lease and the trainers', on distinct workers, or ``Shortfall``
        with none of them held."""
        (ps,) = await lease_servers(self, exclude=(), what="a parameter server")
        try:
            trainers = await lease_trainers(self, int(self.diloco.num_workers), exclude={ps.worker_id})
        except Shortfall:
            await self.release(ps, cancel=False)
            raise
        return ps, trainers

    async def _store_progress(self, *, force: bool = False, message: str = "") -> None:
        state, now = self.state, self.runs.clock()
        if not force and now - state.last_store_at < self.runs.jobs_cfg.progress_store_interval_s:
            return
        state.last_store_at = now
        loss = state.latest_loss()
        metrics = [
            WorkerMetric(t.worker_id, t.samples_per_second, t.samples, t.loss, t.batch_size)
            for t in state.trainers.values()
        ]
        changes: dict[str, Any] = {"round": state.completed}
        if loss is not None:
            changes["loss"] = loss
        try:
            await self.runs.store.update(self.job_id, message=message, worker_metrics=metrics, **changes)
        except HyphaError as err:
            log.debug("job %s: progress not stored: %s", self.job_id, err)


__all__ = ["DilocoRun"]
