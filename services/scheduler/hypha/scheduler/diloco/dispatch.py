"""What a DiLoCo job's parts are sent: the parameter server learns the trainers, each trainer
learns the parameter server.

Every path that changes the job's parts (start, a replaced trainer, a
restored server, growth, a resume) ends in these dispatches, so they are kept
in one place below the phases that use them (``trainers``, ``ps_recovery``).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from hypha.scheduler.diloco.state import DilocoOps, Trainer
from hypha.scheduler.worker_calls import describe
from hypha.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


async def dispatch_ps(run: DilocoOps) -> None:
    """Send the parameter server its job: the trainer list and, restored, the round it resumes."""
    state = run.state
    assert state.ps is not None
    # Every trainer stalls while the server is gone: its loss is noticed sooner than a lease's.
    run.runs.market.watch(state.ps.lease_id)
    kept = run.keeper.latest
    await run.runs.calls.dispatch(
        state.ps.worker_id,
        worker_pb2.DispatchJobRequest(
            job_id=run.job_id,
            lease_id=state.ps.lease_id,
            executor=common_pb2.EXECUTOR_KIND_PARAMETER_SERVER,
            spec=run.spec,
            trainer_ids=sorted(state.trainers),
            scheduler_addresses=run.runs.market.addresses(),
            # > 0: a restored server, which waits for the state pushed to it.
            start_round=kept.round if kept is not None else 0,
            attempt=state.ps_attempt,
        ),
    )


async def dispatch_trainer(run: DilocoOps, trainer: Trainer) -> None:
    """Send a trainer its job: where the parameter server is, its batch size and start round."""
    ps = run.state.ps
    assert ps is not None
    market = run.runs.market
    # Its loss is noticed in seconds too: the round goes on without it and a replacement is
    # leased at once, and the lease itself can outlive a scheduler's restart.
    market.watch(trainer.lease.lease_id)
    await run.runs.calls.dispatch(
        trainer.worker_id,
        worker_pb2.DispatchJobRequest(
            job_id=run.job_id,
            lease_id=trainer.lease.lease_id,
            executor=common_pb2.EXECUTOR_KIND_DILOCO_TRAINER,
            spec=run.spec,
            parameter_server_id=ps.worker_id,
            parameter_server_addresses=list(market.worker_addresses(ps.worker_id)),
            scheduler_addresses=market.addresses(),
            batch_size=trainer.batch_size,
            attempt=trainer.attempt,
            start_round=trainer.start_round,
        ),
    )


async def repoint_trainers(run: DilocoOps) -> None:
    """Every trainer still training learns the restored server (a second dispatch, same lease and
    attempt); one that finished is left alone (a dispatch would start it again), and so is one
    whose lease is not held (it is being replaced)."""
    running = [t for t in run.state.trainers.values() if not t.finished and run.holds(t.lease)]
    await asyncio.gather(*(dispatch_trainer(run, t) for t in running))


async def update_ps(run: DilocoOps) -> None:
    """Tell the running parameter server the new trainer list (a second dispatch of the job).

    A worker whose job manager cannot update a running execution answers
    ALREADY_EXISTS: the parameter server then keeps the old list, refuses
    the newcomer's deltas and completes each round with the remaining
    trainers once ``round_timeout_s`` passed (``quorum``).
    """
    try:
        async with run.state.ps_lock:
            await dispatch_ps(run)
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        log.warning(
            "job %s: the parameter server cannot take the new trainer list (%s); rounds complete by quorum",
            run.job_id,
            describe(err),
        )


__all__ = ["dispatch_ps", "dispatch_trainer", "repoint_trainers", "update_ps"]
