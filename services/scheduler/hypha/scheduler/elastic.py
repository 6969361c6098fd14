"""Elastic DiLoCo jobs: ``hypha scale JOB --workers N`` grows or shrinks a running job.

The target is the run's ``target_workers`` (saved with the run's state, so a
restarted scheduler keeps it: ``diloco_resume``). Reaching it reuses the
paths a lost trainer already takes, one way to do each thing:

- **Growing** leases the missing trainers through the market one at a time,
  as a replacement is leased (never on the parameter server's or another
  trainer's worker). Each newcomer starts at the current round and pulls
  θ_global from the parameter server; the server is re-dispatched with the
  new trainer list (``DilocoRun._update_ps``) and takes the newcomer in from
  the next round (``ParameterServerCore.set_workers``). A market that has no
  worker to offer ends the growth with a job note; the job goes on.
- **Shrinking** waits for a round boundary (the parameter server's commit of
  a round), then releases the most recently joined trainers: their ASSIGNED
  slices go back to AVAILABLE (``SliceTracker.worker_lost``, as for a lost
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
from typing import TYPE_CHECKING

import grpc

from hypha.errors import FailedPreconditionError, HyphaError, InvalidArgumentError
from hypha.scheduler.runs import JobFailed
from hypha.scheduler.worker_calls import describe

if TYPE_CHECKING:
    from hypha.scheduler.diloco_job import DilocoRun

log = logging.getLogger(__name__)

#: The most trainers one job may have (the job file's own bound on ``num_workers``).
MAX_WORKERS = 1024


def check_target(run: DilocoRun, workers: int) -> None:
    """Refuse a target the job cannot take, with the reason (gRPC status by error type)."""
    if workers < 1:
        raise InvalidArgumentError(f"workers: a job needs at least 1 trainer, got {workers}")
    if workers > MAX_WORKERS:
        raise InvalidArgumentError(f"workers: at most {MAX_WORKERS} trainers per job, got {workers}")
    if run.over or run.planner is None or not run.ps_started or run.resuming:
        raise FailedPreconditionError(f"job {run.job_id} is not running yet (or any more): scale it later")


async def scale(run: DilocoRun, workers: int) -> None:
    """Set the job's target trainer count; growth starts now, shrinking at the next round boundary."""
    check_target(run, workers)
    before = run.target_workers
    run.target_workers = workers
    await run.runs.store.note(
        run.job_id, f"scaling from {len(run.trainers)} to {workers} trainers (target was {before})"
    )
    await run._save()
    if workers > len(run.trainers) and not run.growing:
        run.runs.spawn(grow(run), f"grow job {run.job_id}")


async def grow(run: DilocoRun) -> None:
    """Lease trainers until the job has ``target_workers`` (see the module docstring)."""
    runs = run.runs
    run.growing = True
    try:
        while not run.over and len(run.trainers) < run.target_workers:
            exclude = set(run.trainers) | ({run.ps.worker_id} if run.ps else set())
            try:
                (lease,) = await run.lease_trainers(1, exclude=exclude, what="more trainers")
            except JobFailed as err:
                await runs.store.note(run.job_id, f"scaling up stopped at {len(run.trainers)}: {err.message}")
                return
            if run.over or len(run.trainers) >= run.target_workers:
                await runs.release_lease(run, lease, cancel=False)
                return
            trainer = run._add_trainer(lease, attempt=run.joins, start_round=run.completed)
            try:
                await run._update_ps()
                # One that left this worker may still be winding down there (``dispatch_anew``).
                await runs.dispatch_anew(run, trainer.worker_id, partial(run._dispatch_trainer, trainer))
            except (grpc.aio.AioRpcError, HyphaError) as err:
                why = f"trainer {lease.worker_id} could not join: {describe(err)}"
                await remove_trainers(run, [lease.worker_id], why, cancel=False)
                await runs.store.note(run.job_id, f"scaling up stopped: {why}")
                return
            await runs.store.note(run.job_id, f"trainer {lease.worker_id} joins at round {run.completed}")
            with contextlib.suppress(HyphaError):
                await runs.store.update(run.job_id, workers=run._worker_list())
            await run._save()
    finally:
        run.growing = False


async def remove_trainers(run: DilocoRun, worker_ids: list[str], why: str, *, cancel: bool) -> None:
    """Trainers leave without replacement: their ASSIGNED slices go back, the planner forgets
    them, the server stops waiting for them (its new trainer list), their leases are released."""
    leaving = [t for t in (run.trainers.pop(w, None) for w in worker_ids) if t is not None]
    if not leaving:
        return
    for trainer in leaving:
        log.info("job %s: trainer %s leaves: %s", run.job_id, trainer.worker_id, why)
        if run.tracker is not None:
            run.tracker.worker_lost(trainer.worker_id)
        if run.planner is not None:
            run.planner.remove_worker(trainer.worker_id)
    await run._update_ps()
    for trainer in leaving:
        await run.runs.release_lease(run, trainer.lease, cancel=cancel)


async def shrink_at_boundary(run: DilocoRun) -> None:
    """A round completed: release the most recently joined trainers beyond the target."""
    extra = len(run.trainers) - run.target_workers
    if extra <= 0 or run.over:
        return
    newest = sorted(run.trainers.values(), key=lambda t: t.joined, reverse=True)[:extra]
    leaving = [t.worker_id for t in newest]
    why = f"scaled down to {run.target_workers} trainers"
    await remove_trainers(run, leaving, why, cancel=True)
    await run.runs.store.note(
        run.job_id, f"trainers {', '.join(leaving)} leave after round {run.completed - 1} ({why})"
    )
    with contextlib.suppress(HyphaError):
        await run.runs.store.update(run.job_id, workers=run._worker_list())
    await run._save()


__all__ = ["MAX_WORKERS", "check_target", "grow", "remove_trainers", "scale", "shrink_at_boundary"]
