"""A DiLoCo job's trainers: who trains, how one joins, how a lost one is replaced.

``DilocoRun`` builds on this part of its run, as it does on
``hypha.scheduler.ps_recovery`` for its parameter server. The trainers change
on several paths: a lost or failed trainer is replaced here, a scaled job
grows or shrinks (``hypha.scheduler.elastic``), a restarted scheduler takes
its trainers back (``hypha.scheduler.diloco_resume``). Each path uses the same
steps, kept here so they cannot drift apart. A trainer is leased by the job's
requirements, price and policy, never on the parameter server's or another
trainer's worker. It is sized by its worker's capacity and known to the
planner. It starts at the current round and pulls θ_global from the
parameter server, which is re-dispatched with the new trainer list so it
adopts the newcomer. A trainer that leaves gives its slices back first.

Replacements are bounded by ``jobs.max_replacements`` (restores of the
parameter server count too); while no worker is free one waits up to
``jobs.replace_patience_s`` for one (``docs/fault-tolerance.md``).

Decisions (NOTE):
- The job goes back to ALLOCATING while a replacement is being leased, and
  to RUNNING once no replacement is under way any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial

import grpc

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.resources import Requirements
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.rounds import Planner, batch_size_for
from hypha.scheduler.runs import JobFailed, JobRun, price_range
from hypha.scheduler.slices import SliceTracker
from hypha.scheduler.worker_calls import describe
from hypha.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


@dataclass
class Trainer:
    """One trainer of a DiLoCo job: its lease, batch size and the figures it last reported."""

    worker_id: str
    lease: HeldLease
    batch_size: int
    #: 0 for the job's first trainers, else its join number: unique on each worker (``on_status``).
    attempt: int
    start_round: int
    #: Join order within the job (shrinking releases the highest first).
    joined: int = 0
    finished: bool = False
    samples: int = 0
    samples_per_second: float = 0.0
    loss: float = 0.0


class TrainerMembership(JobRun):
    """The trainers of a DiLoCo run and their changes (see the module docstring)."""

    ps: HeldLease | None
    trainers: dict[str, Trainer]
    tracker: SliceTracker | None
    planner: Planner | None
    completed: int
    replacements_used: int
    replacements_under_way: int
    joins: int
    ps_lock: asyncio.Lock

    @property
    @abstractmethod
    def over(self) -> bool: ...

    @property
    @abstractmethod
    def diloco(self) -> common_pb2.DilocoJobSpec: ...

    @abstractmethod
    def _end(self, succeeded: bool, message: str) -> None: ...

    @abstractmethod
    def _worker_list(self) -> list[str]: ...

    @abstractmethod
    async def _dispatch_ps(self) -> None: ...

    @abstractmethod
    async def _save(self) -> None: ...

    async def lease_trainers(
        self, count: int, *, exclude: Collection[str], what: str = "trainers", patience_s: float | None = None
    ) -> list[HeldLease]:
        """``count`` trainer leases by the job's requirements, price and policy (``lease_many``)."""
        spec = self.diloco
        return await self.runs.lease_many(
            self,
            Requirements.from_proto(spec.worker_requirements),
            count,
            price_range(spec.worker_price),
            spec.selection_policy,
            exclude=exclude,
            what=what,
            patience_s=patience_s,
        )

    def _add_trainer(self, lease: HeldLease, *, attempt: int, start_round: int) -> Trainer:
        spec = self.diloco
        capacity = self.runs.market.worker_capacity(lease.worker_id)
        size = batch_size_for(
            capacity if not capacity.is_zero() else lease.resources,
            gpu_memory_per_sample_gb=spec.gpu_memory_per_sample_gb,
            min_batch_size=int(spec.min_batch_size),
            max_batch_size=int(spec.max_batch_size),
        )
        trainer = Trainer(lease.worker_id, lease, size, attempt, start_round, joined=self.joins)
        self.joins += 1
        self.trainers[lease.worker_id] = trainer
        assert self.planner is not None
        self.planner.add_worker(lease.worker_id, size)
        return trainer

    def _trainer_ids(self) -> list[str]:
        return sorted(self.trainers)

    async def _dispatch_trainer(self, trainer: Trainer) -> None:
        assert self.ps is not None
        market = self.runs.market
        await self.runs.calls.dispatch(
            trainer.worker_id,
            worker_pb2.DispatchJobRequest(
                job_id=self.job_id,
                lease_id=trainer.lease.lease_id,
                executor=common_pb2.EXECUTOR_KIND_DILOCO_TRAINER,
                spec=self.spec,
                parameter_server_id=self.ps.worker_id,
                parameter_server_addresses=list(market.worker_addresses(self.ps.worker_id)),
                scheduler_addresses=market.addresses(),
                batch_size=trainer.batch_size,
                attempt=trainer.attempt,
                start_round=trainer.start_round,
            ),
        )

    async def _repoint_trainers(self) -> None:
        """Every trainer still training learns the restored server (a second dispatch, same lease and
        attempt); one that finished is left alone (a dispatch would start it again), and so is one
        whose lease is not held (it is being replaced)."""
        running = [t for t in self.trainers.values() if not t.finished and t.lease.lease_id in self.leases]
        await asyncio.gather(*(self._dispatch_trainer(t) for t in running))

    async def _update_ps(self) -> None:
        """Tell the running parameter server the new trainer list (a second dispatch of the job).

        A worker whose job manager cannot update a running execution answers
        ALREADY_EXISTS: the parameter server then keeps the old list, refuses
        the newcomer's deltas and completes each round with the remaining
        trainers once ``round_timeout_s`` passed (``quorum``).
        """
        try:
            async with self.ps_lock:
                await self._dispatch_ps()
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            log.warning(
                "job %s: the parameter server cannot take the new trainer list (%s); "
                "rounds complete by quorum",
                self.job_id,
                describe(err),
            )

    async def _replace_trainer(self, worker_id: str, why: str, *, lost: bool = False) -> None:
        """A trainer is gone: its slices go back, a new worker takes its place at the current round.

        ``lost``: its lease lapsed, so the worker is gone or cut off; it stops the
        execution itself when the lease ends, and nobody waits on a cancel call to it.
        """
        trainer = self.trainers.pop(worker_id, None)
        if trainer is None:
            return
        runs, store = self.runs, self.runs.store
        log.warning("job %s: %s", self.job_id, why)
        if self.tracker is not None:
            self.tracker.worker_lost(worker_id)
        if self.planner is not None:
            self.planner.remove_worker(worker_id)
        await runs.release_lease(self, trainer.lease, cancel=not lost)
        if self.replacements_used >= runs.jobs_cfg.max_replacements:
            self._end(False, f"{why}; no replacements left ({self.replacements_used} used)")
            return
        self.replacements_used += 1
        self.replacements_under_way += 1
        try:
            with contextlib.suppress(HyphaError):
                await store.transition(
                    self.job_id,
                    JobState.ALLOCATING,
                    expected=JobState.RUNNING,
                    reason=Reason.WORKER_LOST.format(worker=worker_id),
                )
            exclude = set(self.trainers) | ({self.ps.worker_id} if self.ps else set())
            try:
                leases = await self.lease_trainers(
                    1,
                    exclude=exclude,
                    what="replacement trainers",
                    patience_s=runs.jobs_cfg.replace_patience_s,
                )
            except JobFailed as err:
                self._end(False, f"{why}; {err.message}")
                return
            if self.over:
                await runs.release_lease(self, leases[0], cancel=False)
                return
            # Its join number as its attempt: unique within the job, so a late final report of
            # an execution it replaced on the same worker is told apart (``on_status``).
            replacement = self._add_trainer(leases[0], attempt=self.joins, start_round=self.completed)
            await self._update_ps()
            # Its worker may still be winding down the execution it replaces (``dispatch_anew``).
            await runs.dispatch_anew(
                self, replacement.worker_id, partial(self._dispatch_trainer, replacement)
            )
            await store.note(self.job_id, f"trainer {replacement.worker_id} replaces {worker_id}")
            await self._save()
        except (grpc.aio.AioRpcError, HyphaError) as err:
            self._end(False, f"{why}; replacing it failed: {describe(err)}")
        finally:
            self.replacements_under_way -= 1
            if self.replacements_under_way == 0:
                with contextlib.suppress(HyphaError):
                    await store.transition(
                        self.job_id,
                        JobState.RUNNING,
                        expected=JobState.ALLOCATING,
                        reason=f"training on {len(self.trainers)} workers",
                        workers=self._worker_list(),
                    )


__all__ = ["Trainer", "TrainerMembership"]
