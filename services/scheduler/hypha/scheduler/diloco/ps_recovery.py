"""A DiLoCo job's parameter server, committed every round and restored when it is lost.

One phase of a DiLoCo run (functions over its operations,
``hypha.scheduler.diloco.state``). Two events concern the server:

- its round report carries ``state_round``: the scheduler pulls that state
  and keeps it (``hypha.scheduler.diloco.ps_state``) before it answers; the
  server sends the next round's update only after that answer, so at most
  one published round is not yet kept (a restored server redoes it from the
  trainers' kept deltas);
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
- One restore at a time (``DilocoState.ps_lock``); a trouble report names the attempt it
  concerns and is dropped if that server was replaced already.
- A dispatch that finds the failed execution still winding down
  (ALREADY_EXISTS) cancels it and tries again until ``dispatch_timeout_s``.
- A commit that fails is logged, not raised: the server goes on either way
  (it publishes once the report is answered), and losing it then restores
  the newest kept state, older than the trainers' round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection

import grpc

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.scheduler.diloco.dispatch import dispatch_ps, repoint_trainers
from hypha.scheduler.diloco.state import DilocoOps
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.worker_calls import describe

log = logging.getLogger(__name__)


async def lease_servers(
    run: DilocoOps, *, exclude: Collection[str], what: str, patience_s: float | None = None
) -> list[HeldLease]:
    """One parameter server's lease by the job's requirements, price and policy."""
    spec = run.diloco
    return await run.lease(
        spec.parameter_server_requirements,
        spec.parameter_server_price,
        1,
        exclude=exclude,
        what=what,
        patience_s=patience_s,
    )


# ---- commit --------------------------------------------------------------------------------


async def commit(run: DilocoOps, worker_id: str, round_: int) -> None:
    """Keep the state the server published for ``round_`` before its report is answered."""
    runs = run.runs
    timeout_s = runs.jobs_cfg.result_timeout_s
    pull = asyncio.ensure_future(run.keeper.commit(runs.calls, worker_id, run.job_id, round_, timeout_s))
    pull.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved here
    try:
        # Shielded: the report's own deadline ending must not leave a half-kept state behind.
        kept = await asyncio.shield(pull)
    except (grpc.aio.AioRpcError, HyphaError, OSError) as err:
        log.warning("job %s: state of round %d not kept: %s", run.job_id, round_, describe(err))
        return
    if runs.metrics is not None:
        runs.metrics.bytes_moved.labels(kind="ps_state_pull").inc(kept.size)


# ---- restore -------------------------------------------------------------------------------


def ps_trouble(run: DilocoOps, why: str, *, lost: bool) -> None:
    """The server failed (``lost``: its lease lapsed): restore it in the background."""
    state = run.state
    if state.over:
        return
    if not state.ps_started:
        state.end(False, why)
        return
    run.runs.spawn(restore_ps(run, why, lost, state.ps_attempt), f"restore parameter server {run.job_id}")


async def restore_ps(run: DilocoOps, why: str, lost: bool, attempt: int) -> None:
    """A new attempt of the server (on its worker, or on a new lease when ``lost``), the kept
    state pushed to it, the trainers re-pointed; ``attempt`` is the one that failed."""
    state = run.state
    async with state.ps_lock:
        if state.over or attempt != state.ps_attempt or state.ps is None:
            return  # the job ended, or that server was replaced already
        log.warning("job %s: %s", run.job_id, why)
        runs, store = run.runs, run.runs.store
        if state.replacements_used >= runs.jobs_cfg.max_replacements:
            state.end(False, f"{why}; no replacements left ({state.replacements_used} used)")
            return
        state.replacements_used += 1
        with contextlib.suppress(HyphaError):
            await store.transition(
                run.job_id, JobState.ALLOCATING, expected=JobState.RUNNING, reason=f"restoring: {why}"
            )
        old = state.ps
        try:
            lease = await _server_lease(run, old, lost)
            if state.over:  # the job ended while it waited for a worker
                if lease is not old:
                    await run.release(lease, cancel=False)
                return
            state.ps = lease
            state.ps_attempt += 1
            # A failed execution still winding down there is cancelled first (``dispatch_anew``).
            await run.dispatch_anew(lease.worker_id, lambda: dispatch_ps(run))
            kept = await run.keeper.push(
                runs.calls, lease.worker_id, run.job_id, runs.jobs_cfg.result_timeout_s
            )
            await repoint_trainers(run)
        except (grpc.aio.AioRpcError, HyphaError, OSError) as err:
            state.end(False, f"{why}; restoring it failed: {describe(err)}")
            return
        where = "the same worker" if lease.worker_id == old.worker_id else lease.worker_id
        at = f"round {kept.round} (state sha256 {kept.sha256})" if kept is not None else "round 0"
        log.info("job %s: parameter server restored on %s at %s", run.job_id, where, at)
        await store.note(run.job_id, f"parameter server restored on {where} at {at}")
        await run.save()
        with contextlib.suppress(HyphaError):
            await store.transition(
                run.job_id,
                JobState.RUNNING,
                expected=JobState.ALLOCATING,
                reason=f"parameter server restored at {at}",
                workers=state.worker_list(),
            )


async def _server_lease(run: DilocoOps, old: HeldLease, lost: bool) -> HeldLease:
    """The old lease while it is held (the process died, its worker lives), else a new one."""
    if not lost and run.holds(old):
        return old
    if run.holds(old):
        await run.release(old, cancel=False)
    # No worker may be free right now (all busy, the lost one not back yet): wait for one, up
    # to ``replace_patience_s``; then JobFailed, a HyphaError, ends the job with that reason.
    (lease,) = await lease_servers(
        run,
        exclude=set(run.state.trainers),
        what="a replacement parameter server",
        patience_s=run.runs.jobs_cfg.replace_patience_s,
    )
    return lease


__all__ = ["commit", "lease_servers", "ps_trouble", "restore_ps"]
