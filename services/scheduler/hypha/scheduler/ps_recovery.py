"""A DiLoCo job's parameter server, committed every round and restored when it is lost.

``DilocoRun`` builds on this part of its run. Two events concern the server:

- its round report carries ``state_round``: the scheduler pulls that state
  and keeps it (``hypha.scheduler.ps_state``) before it answers, so no update
  reaches a trainer before its state outlives the server's machine;
- its execution ends in failure (the process died: a new attempt is
  dispatched on the same worker, under the same lease) or its lease is lost
  (the worker died or is cut off: a new server is leased through the
  market, never on a trainer's worker; while no worker is free it waits for
  one, up to ``jobs.replace_patience_s``, and the rounds pause meanwhile: the
  trainers keep retrying their deltas). The replacement is dispatched with
  ``start_round`` = the kept round, the kept state is pushed to it, then the
  trainers are re-dispatched with it: their workers abandon the calls to the
  old server in flight (so each trainer sends its delta again at once) and
  route them to the new one (``hypha.worker.execution.is_rewiring``).

Decisions (NOTE):
- Restores count against ``jobs.max_replacements``, like replaced trainers.
- One restore at a time (``ps_lock``); a trouble report names the attempt it
  concerns and is dropped if that server was replaced already.
- A dispatch that finds the failed execution still winding down
  (ALREADY_EXISTS) cancels it and tries again until ``dispatch_timeout_s``.
- A commit that fails is logged, not raised: the server goes on either way
  (it publishes once the report is answered), and losing it then redoes the
  rounds since the newest kept state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod
from collections.abc import Collection

import grpc

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.resources import Requirements
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.ps_state import StateKeeper
from hypha.scheduler.runs import JobRun, price_range
from hypha.scheduler.worker_calls import describe
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)


class ParameterServerRecovery(JobRun):
    """The parameter server's commit and restore (see the module docstring)."""

    ps: HeldLease | None
    state: StateKeeper
    ps_attempt: int
    ps_started: bool
    ps_lock: asyncio.Lock
    replacements_used: int

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
    def _trainer_ids(self) -> list[str]: ...

    @abstractmethod
    async def _dispatch_ps(self) -> None: ...

    @abstractmethod
    async def _repoint_trainers(self) -> None: ...

    @abstractmethod
    async def _save(self) -> None: ...

    async def lease_servers(
        self, *, exclude: Collection[str], what: str, patience_s: float | None = None
    ) -> list[HeldLease]:
        """One parameter server's lease by the job's requirements, price and policy."""
        spec = self.diloco
        return await self.runs.lease_many(
            self,
            Requirements.from_proto(spec.parameter_server_requirements),
            1,
            price_range(spec.parameter_server_price),
            spec.selection_policy,
            exclude=exclude,
            what=what,
            patience_s=patience_s,
        )

    # ---- commit --------------------------------------------------------------------------

    async def _commit(self, worker_id: str, round_: int) -> None:
        """Keep the state the server published for ``round_`` before its report is answered."""
        timeout_s = self.runs.jobs_cfg.result_timeout_s
        pull = asyncio.ensure_future(
            self.state.commit(self.runs.calls, worker_id, self.job_id, round_, timeout_s)
        )
        pull.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved here
        try:
            # Shielded: the report's own deadline ending must not leave a half-kept state behind.
            kept = await asyncio.shield(pull)
        except (grpc.aio.AioRpcError, HyphaError, OSError) as err:
            log.warning("job %s: state of round %d not kept: %s", self.job_id, round_, describe(err))
            return
        if self.runs.metrics is not None:
            self.runs.metrics.bytes_moved.labels(kind="ps_state_pull").inc(kept.size)

    # ---- restore -------------------------------------------------------------------------

    def _ps_trouble(self, why: str, *, lost: bool) -> None:
        """The server failed (``lost``: its lease lapsed): restore it in the background."""
        if self.over:
            return
        if not self.ps_started:
            self._end(False, why)
            return
        self.runs.spawn(
            self._restore_ps(why, lost, self.ps_attempt), f"restore parameter server {self.job_id}"
        )

    async def _restore_ps(self, why: str, lost: bool, attempt: int) -> None:
        async with self.ps_lock:
            if self.over or attempt != self.ps_attempt or self.ps is None:
                return  # the job ended, or that server was replaced already
            log.warning("job %s: %s", self.job_id, why)
            runs, store = self.runs, self.runs.store
            if self.replacements_used >= runs.jobs_cfg.max_replacements:
                self._end(False, f"{why}; no replacements left ({self.replacements_used} used)")
                return
            self.replacements_used += 1
            with contextlib.suppress(HyphaError):
                await store.transition(
                    self.job_id, JobState.ALLOCATING, expected=JobState.RUNNING, reason=f"restoring: {why}"
                )
            old = self.ps
            try:
                lease = await self._server_lease(old, lost)
                if self.over:  # the job ended while it waited for a worker
                    if lease is not old:
                        await runs.release_lease(self, lease, cancel=False)
                    return
                self.ps = lease
                self.ps_attempt += 1
                await self._redispatch_ps()
                kept = await self.state.push(
                    runs.calls, self.ps.worker_id, self.job_id, runs.jobs_cfg.result_timeout_s
                )
                await self._repoint_trainers()
            except (grpc.aio.AioRpcError, HyphaError, OSError) as err:
                self._end(False, f"{why}; restoring it failed: {describe(err)}")
                return
            where = "the same worker" if self.ps.worker_id == old.worker_id else self.ps.worker_id
            at = f"round {kept.round} (state sha256 {kept.sha256})" if kept is not None else "round 0"
            log.info("job %s: parameter server restored on %s at %s", self.job_id, where, at)
            await store.note(self.job_id, f"parameter server restored on {where} at {at}")
            await self._save()
            with contextlib.suppress(HyphaError):
                await store.transition(
                    self.job_id,
                    JobState.RUNNING,
                    expected=JobState.ALLOCATING,
                    reason=f"parameter server restored at {at}",
                    workers=self._worker_list(),
                )

    async def _server_lease(self, old: HeldLease, lost: bool) -> HeldLease:
        """The old lease while it is held (the process died, its worker lives), else a new one."""
        if not lost and old.lease_id in self.leases:
            return old
        if old.lease_id in self.leases:
            await self.runs.release_lease(self, old, cancel=False)
        # No worker may be free right now (all busy, the lost one not back yet): wait for one, up
        # to ``replace_patience_s``; then JobFailed, a HyphaError, ends the job with that reason.
        (lease,) = await self.lease_servers(
            exclude=set(self._trainer_ids()),
            what="a replacement parameter server",
            patience_s=self.runs.jobs_cfg.replace_patience_s,
        )
        return lease

    async def _redispatch_ps(self) -> None:
        """Dispatch the new attempt; a failed execution still winding down is cancelled first."""
        assert self.ps is not None
        await self.runs.dispatch_anew(self, self.ps.worker_id, self._dispatch_ps)


__all__ = ["ParameterServerRecovery"]
