"""A DiLoCo job's trainers: who trains, how one joins, how a lost one is replaced.

One phase of a DiLoCo run (``hypha.scheduler.diloco.state``: functions over the
run's operations), as ``ps_recovery`` is for its parameter server. The trainers
change on several paths: a lost or failed trainer is replaced here, a scaled job
grows or shrinks (``elastic``), a restarted scheduler takes its trainers back
(``resume``). Each path uses the same
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

import contextlib
import logging
from collections.abc import Collection
from functools import partial

import grpc

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.scheduler.diloco.dispatch import dispatch_trainer, update_ps
from hypha.scheduler.diloco.round_planner import batch_size_for
from hypha.scheduler.diloco.state import DilocoOps, Trainer
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.runs import JobFailed
from hypha.scheduler.worker_calls import describe

log = logging.getLogger(__name__)


async def lease_trainers(
    run: DilocoOps,
    count: int,
    *,
    exclude: Collection[str],
    what: str = "trainers",
    patience_s: float | None = None,
) -> list[HeldLease]:
    """``count`` trainer leases by the job's requirements, price and policy (``lease_many``)."""
    spec = run.diloco
    return await run.lease(
        spec.worker_requirements, spec.worker_price, count, exclude=exclude, what=what, patience_s=patience_s
    )


def add_trainer(run: DilocoOps, lease: HeldLease, *, attempt: int, start_round: int) -> Trainer:
    """A trainer on ``lease``, sized by its worker's capacity and known to the planner."""
    spec, state = run.diloco, run.state
    capacity = run.runs.market.worker_capacity(lease.worker_id)
    size = batch_size_for(
        capacity if not capacity.is_zero() else lease.resources,
        gpu_memory_per_sample_gb=spec.gpu_memory_per_sample_gb,
        min_batch_size=int(spec.min_batch_size),
        max_batch_size=int(spec.max_batch_size),
    )
    trainer = Trainer(lease.worker_id, lease, size, attempt, start_round, joined=state.joins)
    state.joins += 1
    state.trainers[lease.worker_id] = trainer
    assert state.planner is not None
    state.planner.add_worker(lease.worker_id, size)
    return trainer


def forget_trainer(run: DilocoOps, worker_id: str) -> Trainer | None:
    """Take a trainer out of the job: its ASSIGNED slices go back, the planner forgets it."""
    state = run.state
    trainer = state.trainers.pop(worker_id, None)
    if trainer is None:
        return None
    if state.tracker is not None:
        state.tracker.worker_lost(worker_id)
    if state.planner is not None:
        state.planner.remove_worker(worker_id)
    return trainer


async def replace_trainer(run: DilocoOps, worker_id: str, why: str, *, lost: bool = False) -> None:
    """A trainer is gone: its slices go back, a new worker takes its place.

    ``lost``: its lease lapsed, so the worker is gone or cut off; it stops the
    execution itself when the lease ends, and nobody waits on a cancel call to it.

    NOTE: where other trainers remain, the parameter server stops waiting for
    the gone one's delta at once (``drop_from_round``): the round in flight
    completes with the survivors' deltas (weighted by their samples) instead
    of waiting for a replacement's lease and cold start, and the replacement
    joins from the next round, as a trainer added by ``hypha scale`` does.
    """
    state = run.state
    trainer = forget_trainer(run, worker_id)
    if trainer is None:
        return
    runs, store = run.runs, run.runs.store
    log.warning("job %s: %s", run.job_id, why)
    await run.release(trainer.lease, cancel=not lost)
    # Beside the replacement's lease, never before it: a server being lost too would hold it up.
    runs.spawn(drop_from_round(run, worker_id), f"drop trainer {worker_id} from the round")
    if state.replacements_used >= runs.jobs_cfg.max_replacements:
        state.end(False, f"{why}; no replacements left ({state.replacements_used} used)")
        return
    state.replacements_used += 1
    state.replacements_under_way += 1
    try:
        with contextlib.suppress(HyphaError):
            await store.transition(
                run.job_id,
                JobState.ALLOCATING,
                expected=JobState.RUNNING,
                reason=Reason.WORKER_LOST.format(worker=worker_id),
            )
        try:
            leases = await lease_trainers(
                run,
                1,
                exclude=state.parts_except(),
                what="replacement trainers",
                patience_s=runs.jobs_cfg.replace_patience_s,
            )
        except JobFailed as err:
            state.end(False, f"{why}; {err.message}")
            return
        if state.over:
            await run.release(leases[0], cancel=False)
            return
        # Its join number as its attempt: unique within the job, so a late final report of
        # an execution it replaced on the same worker is told apart (``on_status``).
        replacement = add_trainer(run, leases[0], attempt=state.joins, start_round=state.completed)
        await update_ps(run)
        # Its worker may still be winding down the execution it replaces (``dispatch_anew``).
        await run.dispatch_anew(replacement.worker_id, partial(dispatch_trainer, run, replacement))
        await store.note(run.job_id, f"trainer {replacement.worker_id} replaces {worker_id}")
        await run.save()
    except (grpc.aio.AioRpcError, HyphaError) as err:
        state.end(False, f"{why}; replacing it failed: {describe(err)}")
    finally:
        state.replacements_under_way -= 1
        if state.replacements_under_way == 0:
            with contextlib.suppress(HyphaError):
                await store.transition(
                    run.job_id,
                    JobState.RUNNING,
                    expected=JobState.ALLOCATING,
                    reason=f"training on {len(state.trainers)} workers",
                    workers=state.worker_list(),
                )


async def drop_from_round(run: DilocoOps, worker_id: str) -> None:
    """Tell the parameter server the remaining trainers, so it completes the round in flight
    without ``worker_id``; a server that cannot be told now (it is being restored) hears the
    list with the replacement's dispatch instead."""
    state = run.state
    if not state.trainers or not state.ps_started or state.over:
        return  # a lone trainer's round can only be completed by its replacement
    if state.ps is None or not run.holds(state.ps):
        return  # the server is lost too: its restore dispatches the current list
    try:
        await update_ps(run)
    except (grpc.aio.AioRpcError, HyphaError) as err:
        log.info("job %s: the server was not told that %s left: %s", run.job_id, worker_id, describe(err))


__all__ = ["add_trainer", "drop_from_round", "forget_trainer", "lease_trainers", "replace_trainer"]
