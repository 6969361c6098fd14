"""Elastic DiLoCo jobs: ``hypha scale JOB --workers N`` grows or shrinks a running job.

The target is the run's ``target_workers`` (saved with the run's state, so a
restarted scheduler keeps it: ``resume``). Reaching it reuses the
paths a lost trainer already takes, one way to do each thing:

- **Growing** leases the missing trainers through the market one at a time,
  as a replacement is leased (never on the parameter server's or another
  trainer's worker). Each newcomer starts at the current round and pulls
  θ_global from the parameter server; the server is re-dispatched with the
  new trainer list (``dispatch.update_ps``) and takes the newcomer in from
  the next round (``ParameterServerCore.set_workers``). A market that has no
  worker to offer ends the growth with a job note; the job goes on.
- **Shrinking** waits for a round boundary (the parameter server's commit of
  a round), then releases the most recently joined trainers: their ASSIGNED
  slices go back to AVAILABLE (``trainers.forget_trainer``, as for a lost
  trainer), the planner forgets them, their executions are cancelled, and the
  server stops waiting for their delta of the round in flight.

Sample weighting stays exact (the server weights every delta by its
samples) and each slice is still used once per epoch (the tracker's rules).

Decisions (NOTE):
- Growth does not count against ``jobs.max_replacements``: nothing was lost.
- A scale request while another is under way only moves the target; the
  routine that is running follows it.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import grpc

from hypha.errors import FailedPreconditionError, HyphaError, InvalidArgumentError
from hypha.scheduler.diloco.dispatch import dispatch_trainer, update_ps
from hypha.scheduler.diloco.state import DilocoOps
from hypha.scheduler.diloco.trainers import add_trainer, forget_trainer, lease_trainers
from hypha.scheduler.runs import JobFailed
from hypha.scheduler.worker_calls import describe

log = logging.getLogger(__name__)

#: The most trainers one job may have (the job file's own bound on ``num_workers``).
MAX_WORKERS = 1024


def check_target(run: DilocoOps, workers: int) -> None:
    """Refuse a target the job cannot take, with the reason (gRPC status by error type)."""
    if workers < 1:
        raise InvalidArgumentError(f"workers: a job needs at least 1 trainer, got {workers}")
    if workers > MAX_WORKERS:
        raise InvalidArgumentError(f"workers: at most {MAX_WORKERS} trainers per job, got {workers}")
    state = run.state
    if state.over or state.planner is None or not state.ps_started or run.resuming:
        raise FailedPreconditionError(f"job {run.job_id} is not running yet (or any more): scale it later")


async def scale(run: DilocoOps, workers: int) -> None:
    """Set the job's target trainer count; growth starts now, shrinking at the next round boundary."""
    check_target(run, workers)
    state = run.state
    before = state.target_workers
    state.target_workers = workers
    await run.runs.store.note(
        run.job_id, f"scaling from {len(state.trainers)} to {workers} trainers (target was {before})"
    )
    await run.save()
    if workers > len(state.trainers) and not state.growing:
        run.runs.spawn(grow(run), f"grow job {run.job_id}")


async def grow(run: DilocoOps) -> None:
    """Lease trainers until the job has ``target_workers`` (see the module docstring)."""
    runs, state = run.runs, run.state
    state.growing = True
    try:
        while not state.over and len(state.trainers) < state.target_workers:
            try:
                (lease,) = await lease_trainers(run, 1, exclude=state.parts_except(), what="more trainers")
            except JobFailed as err:
                await runs.store.note(
                    run.job_id, f"scaling up stopped at {len(state.trainers)}: {err.message}"
                )
                return
            if state.over or len(state.trainers) >= state.target_workers:
                await run.release(lease, cancel=False)
                return
            trainer = add_trainer(run, lease, attempt=state.joins, start_round=state.completed)
            try:
                await update_ps(run)
                # One that left this worker may still be winding down there (``dispatch_anew``).
                await run.dispatch_anew(trainer.worker_id, partial(dispatch_trainer, run, trainer))
            except (grpc.aio.AioRpcError, HyphaError) as err:
                why = f"trainer {lease.worker_id} could not join: {describe(err)}"
                await remove_trainers(run, [lease.worker_id], why, cancel=False)
                await runs.store.note(run.job_id, f"scaling up stopped: {why}")
                return
            await runs.store.note(run.job_id, f"trainer {lease.worker_id} joins at round {state.completed}")
            with contextlib.suppress(HyphaError):
                await runs.store.update(run.job_id, workers=state.worker_list())
            await run.save()
    finally:
        state.growing = False


async def remove_trainers(run: DilocoOps, worker_ids: list[str], why: str, *, cancel: bool) -> None:
    """Trainers leave without replacement: their ASSIGNED slices go back, the planner forgets
    them, the server stops waiting for them (its new trainer list), their leases are released."""
    leaving = [t for t in (forget_trainer(run, w) for w in worker_ids) if t is not None]
    if not leaving:
        return
    for trainer in leaving:
        log.info("job %s: trainer %s leaves: %s", run.job_id, trainer.worker_id, why)
    await update_ps(run)
    for trainer in leaving:
        await run.release(trainer.lease, cancel=cancel)


async def shrink_at_boundary(run: DilocoOps) -> None:
    """A round completed: release the most recently joined trainers beyond the target."""
    state = run.state
    extra = len(state.trainers) - state.target_workers
    if extra <= 0 or state.over:
        return
    newest = sorted(state.trainers.values(), key=lambda t: t.joined, reverse=True)[:extra]
    leaving = [t.worker_id for t in newest]
    why = f"scaled down to {state.target_workers} trainers"
    await remove_trainers(run, leaving, why, cancel=True)
    await run.runs.store.note(
        run.job_id, f"trainers {', '.join(leaving)} leave after round {state.completed - 1} ({why})"
    )
    with contextlib.suppress(HyphaError):
        await run.runs.store.update(run.job_id, workers=state.worker_list())
    await run.save()


__all__ = ["MAX_WORKERS", "check_target", "grow", "remove_trainers", "scale", "shrink_at_boundary"]
