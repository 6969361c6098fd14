"""DiLoCo jobs: one parameter server and ``num_workers`` trainers, driven round by round.

ALLOCATING: find the dataset's providers in the DHT; lease one parameter
server and ``num_workers`` trainers with the job's requirements, prices and
policy; dispatch the parameter server (it learns the trainer ids), then the
trainers (they learn the parameter server). A job that finds fewer free
workers than it needs within ``jobs.allocate_wait_s`` gives back what it got
and waits PENDING (jittered backoff) for its next try, as a task job does, so
starting jobs never hold parts of the cluster from each other. RUNNING: progress reports are
answered by the job's planner (``hypha.scheduler.rounds``), slice requests by
its ``SliceTracker`` (with the providers as ``PeerInfo``), metrics go to the
store. A trainer that is lost (its lease lapsed) or fails gives its slices
back and is replaced through the market (``hypha.scheduler.diloco_trainers``).
``ScaleJob`` grows or shrinks a running job the same way
(``hypha.scheduler.elastic``). The job ends when the parameter server reports
success after the configured rounds: its result is pulled into the
scheduler's state dir (``hypha.scheduler.results``).

The parameter server is no single point of failure: each round's metrics
report is its commit, answered once the scheduler holds the round's state
(``hypha.scheduler.ps_state``). When the server's process fails, it is
dispatched again on the same worker (a new attempt under the same lease);
when its lease is lost, a new one is leased through the market. Either way
the newest kept state is pushed to it, and every trainer is dispatched again
(its worker re-sends the round's delta to the restored server and routes its
tensors there); the round in flight is collected again
(``hypha.scheduler.ps_recovery``, ``docs/fault-tolerance.md``).

Decisions (NOTE):
- Progress is written to the store at most every
  ``jobs.progress_store_interval_s`` (every trainer reports several times a
  second; watchers only need the latest), and always when a round completes.
- The run saves its own state (leases, trainers, slice assignments, rounds)
  in the store whenever it changes that much, so a restarted scheduler
  resumes the job (``hypha.scheduler.diloco_resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import grpc

from hypha.dht.records import ProviderRecord
from hypha.errors import FailedPreconditionError, HyphaError
from hypha.market.allocator import HeldLease
from hypha.net.backoff import Backoff
from hypha.scheduler import elastic
from hypha.scheduler.diloco_resume import resume, snapshot
from hypha.scheduler.diloco_trainers import Trainer, TrainerMembership
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.providers import DatasetProviders, provider_peer
from hypha.scheduler.ps_recovery import ParameterServerRecovery
from hypha.scheduler.ps_state import STATE_ROUND_KEY, StateKeeper
from hypha.scheduler.results import ResultPullError, pull_result, result_dir, result_limits
from hypha.scheduler.retry import Outcome, attempt_end
from hypha.scheduler.rounds import Planner, PlannerFactory, Progress
from hypha.scheduler.runs import MAX_QUEUE_RETRY_S, JobFailed, RunRegistry, Shortfall
from hypha.scheduler.slices import SliceTracker
from hypha.scheduler.store import JobRecord, WorkerMetric
from hypha.scheduler.worker_calls import REFUSALS, describe
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)


class DilocoRun(TrainerMembership, ParameterServerRecovery):
    """A DiLoCo job while it runs (see the module docstring)."""

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
        self.ps: HeldLease | None = None
        self.trainers: dict[str, Trainer] = {}
        self.tracker: SliceTracker | None = None
        self.planner: Planner | None = None
        self.data_providers: list[common_pb2.PeerInfo] = []
        #: Rounds the parameter server completed.
        self.completed = 0
        #: When the current round started (dispatch, then each completion), on the registry's clock.
        self.round_started_at = 0.0
        #: Trainer loss per round, per worker.
        self.losses: dict[int, dict[str, float]] = {}
        #: Replacements made so far (bounded by ``jobs.max_replacements``).
        self.replacements_used = 0
        #: Replacements being leased and dispatched right now.
        self.replacements_under_way = 0
        self.last_store_at = 0.0
        #: Resolved with (succeeded, message) when the parameter server ends.
        self.ended: asyncio.Future[tuple[bool, str]] | None = None
        #: The parameter server's state after the newest committed round.
        self.state = StateKeeper(state_dir, job.job_id)
        #: The current parameter server's attempt (each restore is a new one).
        self.ps_attempt = 0
        #: The first parameter server runs: from now on a lost one is restored, not fatal.
        self.ps_started = False
        #: Serialises dispatches to the parameter server (restores and trainer-list updates).
        self.ps_lock = asyncio.Lock()
        #: Serialises saves of the run's state (``_save``).
        self.save_lock = asyncio.Lock()
        #: A job the store hands back after a restart is rebuilt (``diloco_resume``) before any
        #: report is decided on: progress is answered CONTINUE meanwhile (``JobRun.resuming``).
        self.resuming = job.state is not JobState.PENDING
        #: Trainers the job should have (``hypha scale``; ``hypha.scheduler.elastic``).
        self.target_workers = int(job.spec.diloco.num_workers)
        #: Trainers added so far (each one's ``joined``), and whether growth is under way.
        self.joins = 0
        self.growing = False

    @property
    def diloco(self) -> common_pb2.DilocoJobSpec:
        return self.spec.diloco

    @property
    def resumable(self) -> bool:
        """Started (its run state is saved) and not ended: ``ended`` is cancelled, not resolved,
        when the scheduler's stop cancels the run's task that awaits it."""
        ended = self.ended
        return self.ps_started and (ended is None or not ended.done() or ended.cancelled())

    @property
    def over(self) -> bool:
        """The parameter server ended (or the job was given up): nothing is replaced any more."""
        return self.ended is not None and self.ended.done()

    def _end(self, succeeded: bool, message: str) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_result((succeeded, message))

    # ---- what workers report ------------------------------------------------------------

    def on_lease_lost(self, lease: HeldLease, reason: str) -> None:
        worker_id = lease.worker_id
        if self.ps is not None and lease.lease_id == self.ps.lease_id:
            self._ps_trouble(f"parameter server {worker_id} lost: {reason}", lost=True)
        elif worker_id in self.trainers and not self.over:
            why = f"trainer {worker_id} lost: {reason}"
            self.runs.spawn(self._replace_trainer(worker_id, why, lost=True), f"replace trainer {worker_id}")

    def on_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None:
        outcome = attempt_end(int(report.state), int(report.exit_code), report.message)[0]
        if self.ps is not None and worker_id == self.ps.worker_id:
            if int(report.attempt) != self.ps_attempt:
                return  # a server this job already replaced
            if outcome is Outcome.SUCCEEDED:
                self._end(True, report.message or outcome.value)
            else:
                why = f"parameter server on {worker_id} {outcome.value}: {report.message}"
                self._ps_trouble(why, lost=False)
            return
        trainer = self.trainers.get(worker_id)
        if trainer is None or int(report.attempt) != trainer.attempt:
            return  # not a trainer, or the end of one this job already replaced on that worker
        if outcome is Outcome.SUCCEEDED:
            trainer.finished = True
        elif not self.over:
            why = f"trainer on {worker_id} {outcome.value}: {report.message}"
            self.runs.spawn(self._replace_trainer(worker_id, why), f"replace trainer {worker_id}")

    async def on_progress(
        self, worker_id: str, report: scheduler_pb2.ProgressReport
    ) -> scheduler_pb2.Directive:
        if self.resuming:
            # Its trainers are not all back yet (a restarted scheduler): DONE would stop one.
            return scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_CONTINUE, round=report.round)
        if self.planner is None:
            raise FailedPreconditionError(f"job {self.job_id} is not a running DiLoCo job")
        trainer = self.trainers.get(worker_id)
        if trainer is None:
            return scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_DONE, round=report.round)
        progress = Progress.from_proto(report)
        directive = self.planner.report(worker_id, progress, self.runs.clock())
        trainer.samples = progress.samples
        trainer.loss = progress.loss
        rate = self.planner.rates().get(worker_id)
        if rate is not None:
            trainer.samples_per_second = rate
        await self._store_progress()
        return directive.to_proto()

    async def next_slice(
        self, worker_id: str, request: scheduler_pb2.NextSliceRequest
    ) -> scheduler_pb2.NextSliceResponse:
        tracker = self.tracker
        if tracker is None:
            raise FailedPreconditionError(f"job {self.job_id} has no data slices")
        for used in request.used:
            try:
                epoch = tracker.epoch
                tracker.mark_used(worker_id, int(used))
                # The audit trail the chaos benchmark checks "each slice once per epoch" against.
                log.debug("job %s: slice %d used in epoch %d by %s", self.job_id, used, epoch, worker_id)
            except HyphaError as err:  # a slice it lost (replaced, or reported twice): ignore
                log.debug("job %s: used slice %d from %s ignored: %s", self.job_id, used, worker_id, err)
        dataset = self.diloco.dataset
        if worker_id not in self.trainers:
            return scheduler_pb2.NextSliceResponse(available=False, dataset=dataset)
        try:
            index = tracker.next_slice(worker_id)
        except FailedPreconditionError:
            index = None  # it holds its prefetch allowance already
        if index is None:
            return scheduler_pb2.NextSliceResponse(available=False, epoch=tracker.epoch, dataset=dataset)
        await self._save()  # the assignment must outlive a scheduler restart
        return scheduler_pb2.NextSliceResponse(
            available=True, index=index, epoch=tracker.epoch, dataset=dataset, providers=self.data_providers
        )

    async def on_metrics(self, worker_id: str, round_: int, values: dict[str, float]) -> None:
        if self.ps is not None and worker_id == self.ps.worker_id:
            # The parameter server completed a round; its report is the round's commit.
            if STATE_ROUND_KEY in values:
                await self._commit(worker_id, int(values[STATE_ROUND_KEY]))
            if round_ + 1 > self.completed:
                now = self.runs.clock()
                metrics = self.runs.metrics
                if metrics is not None and self.round_started_at:
                    metrics.round_seconds.observe(now - self.round_started_at)
                self.round_started_at = now
                self.completed = round_ + 1
            await self._store_progress(force=True, message=f"round {round_} complete")
            await self._save()
            if len(self.trainers) > self.target_workers:  # a round boundary: scaled down
                self.runs.spawn(elastic.shrink_at_boundary(self), f"shrink job {self.job_id}")
            return
        if "loss" in values and math.isfinite(values["loss"]):
            self.losses.setdefault(round_, {})[worker_id] = values["loss"]
        trainer = self.trainers.get(worker_id)
        if trainer is not None and "samples_per_second" in values:
            trainer.samples_per_second = values["samples_per_second"]
        await self._store_progress()

    def samples_per_second(self, worker_id: str) -> float:
        trainer = self.trainers.get(worker_id)
        return trainer.samples_per_second if trainer is not None else 0.0

    # ---- driving the job ----------------------------------------------------------------

    async def drive(self, job: JobRecord) -> None:
        runs, store, spec = self.runs, self.runs.store, self.diloco
        self.ended = asyncio.get_running_loop().create_future()
        if job.state is JobState.PENDING:
            await self._start()
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
                    reason=f"resumed from round {self.completed} on {len(self.trainers)} workers",
                    workers=self._worker_list(),
                )
        await self._save()
        self.round_started_at = runs.clock()
        succeeded, message = await self.ended
        if not succeeded:
            raise JobFailed(f"parameter server: {message}")
        assert self.ps is not None
        target = result_dir(self.state_dir, self.job_id)
        try:
            size = await pull_result(
                runs.calls,
                self.ps.worker_id,
                self.job_id,
                target,
                runs.jobs_cfg.result_timeout_s,
                runs.clock,
                limits=result_limits(runs.jobs_cfg),
            )
        except ResultPullError as err:
            raise JobFailed(err.message) from err
        if runs.metrics is not None:
            runs.metrics.bytes_moved.labels(kind="result_pull").inc(size)
        await self._store_progress(force=True)
        await self.state.drop()
        await runs.finish_job(
            self,
            JobState.SUCCEEDED,
            f"{spec.rounds} rounds done" + (f" ({message})" if message else ""),
            result_path=str(target),
            round=max(self.completed, int(spec.rounds)),
        )

    async def _start(self) -> None:
        """PENDING to RUNNING: providers, leases, then the parameter server and the trainers."""
        runs, store, spec = self.runs, self.runs.store, self.diloco
        await store.transition(self.job_id, JobState.ALLOCATING, expected=JobState.PENDING)
        records = await self._find_providers(spec.dataset)
        self.data_providers = [provider_peer(record) for record in records]
        self.tracker = SliceTracker(max(record.slice_count for record in records))
        self.planner = self.planners(spec)
        queued = Backoff(runs.jobs_cfg.queue_retry_s, MAX_QUEUE_RETRY_S)
        while True:
            try:
                self.ps, trainer_leases = await self._lease_workers()
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
            self._add_trainer(lease, attempt=0, start_round=0)
        try:
            await self._dispatch_ps()
            self.ps_started = True
            await asyncio.gather(*(self._dispatch_trainer(t) for t in list(self.trainers.values())))
        except grpc.aio.AioRpcError as err:
            # A worker refusing the job itself (e.g. a model factory off its allowlist) will
            # refuse it again: fail at once with its reason instead of an "orchestration failed".
            if err.code() in REFUSALS:
                raise JobFailed(f"a worker refused the job: {describe(err)}") from err
            raise
        await store.transition(
            self.job_id,
            JobState.RUNNING,
            reason=f"training on {len(self.trainers)} workers",
            workers=self._worker_list(),
        )

    async def _lease_workers(self) -> tuple[HeldLease, list[HeldLease]]:
        """The parameter server's lease and the trainers', on distinct workers, or ``Shortfall``
        with none of them held."""
        (ps,) = await self.lease_servers(exclude=(), what="a parameter server")
        try:
            trainers = await self.lease_trainers(int(self.diloco.num_workers), exclude={ps.worker_id})
        except Shortfall:
            await self.runs.release_lease(self, ps, cancel=False)
            raise
        return ps, trainers

    async def _save(self) -> None:
        """Save what resuming the job after a scheduler restart needs (``diloco_resume``); the
        snapshot is taken under the lock, so the newest one is always written last."""
        if self.ps is None or self.tracker is None or self.over:
            return
        async with self.save_lock:
            try:
                await self.runs.store.save_run_state(self.job_id, snapshot(self))
            except HyphaError as err:
                log.warning("job %s: run state not saved: %s", self.job_id, err)

    async def _find_providers(self, dataset: str) -> list[ProviderRecord]:
        if self.providers is None:
            raise JobFailed(f"cannot look up dataset {dataset!r}: scheduler.dht_bootstrap is not configured")
        records = await self.providers.find_within(
            dataset, self.runs.jobs_cfg.provider_wait_s, self.runs.clock
        )
        if not records:
            raise JobFailed(f"no data node serves dataset {dataset!r}")
        return records

    def _worker_list(self) -> list[str]:
        return ([self.ps.worker_id] if self.ps is not None else []) + sorted(self.trainers)

    async def _dispatch_ps(self) -> None:
        assert self.ps is not None
        kept = self.state.latest
        await self.runs.calls.dispatch(
            self.ps.worker_id,
            worker_pb2.DispatchJobRequest(
                job_id=self.job_id,
                lease_id=self.ps.lease_id,
                executor=common_pb2.EXECUTOR_KIND_PARAMETER_SERVER,
                spec=self.spec,
                trainer_ids=sorted(self.trainers),
                scheduler_addresses=self.runs.market.addresses(),
                # > 0: a restored server, which waits for the state pushed to it.
                start_round=kept.round if kept is not None else 0,
                attempt=self.ps_attempt,
            ),
        )

    async def _store_progress(self, *, force: bool = False, message: str = "") -> None:
        now = self.runs.clock()
        if not force and now - self.last_store_at < self.runs.jobs_cfg.progress_store_interval_s:
            return
        self.last_store_at = now
        loss = self._latest_loss()
        metrics = [
            WorkerMetric(t.worker_id, t.samples_per_second, t.samples, t.loss, t.batch_size)
            for t in self.trainers.values()
        ]
        changes: dict[str, Any] = {"round": self.completed}
        if loss is not None:
            changes["loss"] = loss
        try:
            await self.runs.store.update(self.job_id, message=message, worker_metrics=metrics, **changes)
        except HyphaError as err:
            log.debug("job %s: progress not stored: %s", self.job_id, err)

    def _latest_loss(self) -> float | None:
        """Mean trainer loss of the latest round any trainer reported, else the live mean."""
        if self.losses:
            latest = max(self.losses)
            values = list(self.losses[latest].values())
            return sum(values) / len(values)
        live = [t.loss for t in self.trainers.values() if t.loss > 0 and math.isfinite(t.loss)]
        return sum(live) / len(live) if live else None


__all__ = ["DilocoRun"]
