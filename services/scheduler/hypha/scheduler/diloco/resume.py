"""A running DiLoCo job outlives its scheduler: how a restarted scheduler resumes it.

While the job runs, its run saves its state (``snapshot``: leases, trainers,
slices, rounds, target trainer count; the parameter server's state is kept per
round in the state dir, ``ps_state``). After a restart (same identity, same
state dir), ``JobStore.recover`` hands the job back as resumed and ``resume``
rebuilds the run:

- the dataset's providers are looked up again; the slice tracker, the
  rounds, the samples per round fitted to the link and the newest kept
  parameter-server state come back from disk;
  a growth cut short by the restart goes on, a shrink waits for the next round;
- every saved lease is taken back (``SchedulerMarket.adopt``: one renewal,
  which the worker honours because the holder's identity is the same);
- a lease that is gone (it expired while nobody renewed it) is leased again
  through the market: the parameter server as when it is lost
  (``ps_recovery``: the kept state is pushed), a trainer preferably on its
  own worker (``_retake_trainer``), else replaced. Workers keep such
  executions alive for ``worker.jobs.reattach_grace_s`` and re-attach them
  when this scheduler dispatches the job to them again, whatever the lease
  (``hypha.worker.execution.is_reattach``);
- executions whose lease was taken back are not dispatched again: they never
  stopped, and their reports reach this scheduler at the same address.
  A parameter server that ended while nobody listened is asked once
  (``GetJobStatus``).

NOTE: a progress, slice or metrics report that a worker sent while the
scheduler was down failed and is retried or skipped by the executor (a
trainer carries on; a parameter server whose commit failed publishes
anyway, so the kept state may be a few rounds older than the server: only a
later loss of the server costs those rounds again).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import grpc

from hypha.errors import HyphaError
from hypha.scheduler.diloco.dispatch import dispatch_trainer
from hypha.scheduler.diloco.elastic import grow
from hypha.scheduler.diloco.link_fit import resumed
from hypha.scheduler.diloco.ps_recovery import ps_trouble, restore_ps
from hypha.scheduler.diloco.ps_state import KeptState, StateKeeper, packed_round
from hypha.scheduler.diloco.slice_tracker import SliceTracker
from hypha.scheduler.diloco.snapshot import VERSION, lease_from_dict, slices_from
from hypha.scheduler.diloco.state import DilocoOps
from hypha.scheduler.diloco.trainers import add_trainer, lease_trainers, replace_trainer
from hypha.scheduler.providers import provider_peer
from hypha.scheduler.retry import Outcome
from hypha.scheduler.worker_calls import describe

log = logging.getLogger(__name__)


def load_kept(keeper: StateKeeper) -> KeptState | None:
    """The newest parameter-server state kept on disk by a previous process (None: none)."""
    files = sorted(Path(keeper.directory).glob("round-*.safetensors"))
    if not files:
        return None
    blob = files[-1].read_bytes()
    return KeptState(packed_round(blob), files[-1], len(blob), hashlib.sha256(blob).hexdigest())


async def resume(run: DilocoOps, saved: dict[str, Any]) -> None:
    """Rebuild ``run`` from ``saved`` and take its workers back (see the module docstring)."""
    if saved.get("version") != VERSION:
        raise ValueError(f"saved run state has version {saved.get('version')!r}, not {VERSION}")
    runs, spec, market, state = run.runs, run.diloco, run.runs.market, run.state
    records = await run.find_providers(spec.dataset)
    state.data_providers = [provider_peer(record) for record in records]
    state.tracker = SliceTracker.from_snapshot(slices_from(saved))
    state.planner = run.planners(spec)
    state.link_fit = resumed(spec, saved, state.planner)
    state.completed = int(saved["completed"])
    state.replacements_used = int(saved["replacements_used"])
    state.ps_attempt = int(saved["ps_attempt"])
    state.target_workers = int(saved.get("target_workers", len(saved["trainers"])))
    run.keeper.latest = await asyncio.to_thread(load_kept, run.keeper)
    state.ps_started = True

    ps_lease, ps_addresses, ps_capacity = lease_from_dict(saved["ps"])
    trainers = [(entry, *lease_from_dict(entry["lease"])) for entry in saved["trainers"]]
    adopted = await asyncio.gather(
        market.adopt(ps_lease, ps_addresses, ps_capacity),
        *(market.adopt(lease, addresses, capacity) for _, lease, addresses, capacity in trainers),
    )
    ps_held, trainer_held = adopted[0], adopted[1:]
    state.ps = ps_held or ps_lease
    if ps_held is not None:
        run.track(ps_held)
        market.watch(ps_held.lease_id)  # as ``dispatch_ps`` does: its loss stalls every trainer
    else:
        run.participants.add(ps_lease.worker_id)
    lost: list[str] = []
    for (entry, lease, _, _), held in zip(trainers, trainer_held, strict=True):
        if held is None:
            lost.append(lease.worker_id)
            run.participants.add(lease.worker_id)
        else:
            run.track(held)
            market.watch(held.lease_id)  # taken back as it runs: no dispatch to set the watch
        trainer = add_trainer(
            run, held or lease, attempt=int(entry["attempt"]), start_round=int(entry["start_round"])
        )
        trainer.finished = bool(entry["finished"])
        trainer.joined = int(entry.get("joined", trainer.joined))
    state.joins = max((t.joined for t in state.trainers.values()), default=-1) + 1
    taken = sum(held is not None for held in adopted)
    kept = run.keeper.latest
    message = f"resuming from round {state.completed}: {taken} of {len(adopted)} leases taken back" + (
        f"; kept parameter-server state of round {kept.round}" if kept else ""
    )
    log.info("job %s: %s", run.job_id, message)
    await runs.store.note(run.job_id, message)

    # NOTE: the server first (a replacement trainer pulls θ_global from it); its restore
    # re-points only the trainers whose lease is held, and leases no server on a trainer's worker.
    if ps_held is None:
        why = f"parameter server {ps_lease.worker_id} lost while the scheduler was away"
        await restore_ps(run, why, True, state.ps_attempt)
    else:
        ended = await runs.calls.poll_status(ps_held.worker_id, run.job_id)
        if ended is not None:
            outcome, _, why = ended
            if outcome is Outcome.SUCCEEDED:
                state.end(True, why or outcome.value)
            else:
                ps_trouble(
                    run, f"parameter server {outcome.value} while the scheduler was away: {why}", lost=False
                )
    for worker_id in lost:
        runs.spawn(_retake_trainer(run, worker_id), f"take back trainer {worker_id}")
    if len(state.trainers) < state.target_workers:
        runs.spawn(grow(run), f"grow job {run.job_id}")


async def _retake_trainer(run: DilocoOps, worker_id: str) -> None:
    """Lease a trainer whose lease expired again, preferably on its own worker (where it still runs).

    NOTE: it stays in the run meanwhile, so its reports are answered as before
    (a trainer no longer in the run is told DONE and would stop). The offers
    come from its own worker or from workers outside the job: its own one
    takes the running execution back under the new lease (same attempt and
    round: nothing restarts); another one is released, and the trainer is
    replaced as a lost one (``trainers.replace_trainer``).
    """
    state = run.state
    trainer = state.trainers.get(worker_id)
    if trainer is None or state.over:
        return
    why = f"trainer {worker_id} lost while the scheduler was away"
    try:
        (lease,) = await lease_trainers(run, 1, exclude=state.parts_except(worker_id))
    except HyphaError as err:
        log.warning("job %s: %s; leasing it again failed: %s", run.job_id, why, err)
        await replace_trainer(run, worker_id, why, lost=True)
        return
    if lease.worker_id != worker_id or state.over or worker_id not in state.trainers:
        await run.release(lease, cancel=False)
        await replace_trainer(run, worker_id, why, lost=True)
        return
    trainer.lease = lease
    try:
        await dispatch_trainer(run, trainer)
    except (grpc.aio.AioRpcError, HyphaError) as err:
        await replace_trainer(run, worker_id, f"{why}; taking it back failed: {describe(err)}", lost=False)
        return
    await run.runs.store.note(run.job_id, f"trainer {worker_id} taken back under lease {lease.lease_id}")
    await run.save()


__all__ = ["load_kept", "resume"]
