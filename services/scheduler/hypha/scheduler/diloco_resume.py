"""A running DiLoCo job outlives its scheduler: what is saved while it runs, and how it resumes.

While a DiLoCo job runs, its run saves (``snapshot``, into the store's
``run_state`` row of the job) everything the scheduler's memory alone held:
the leases of its parameter server and trainers (with the workers'
addresses and capacity, so they can be reached without a new offer), each
trainer's batch size, attempt and start round, the slice assignments
(``SliceTracker.snapshot``), the completed rounds, the replacements used and
the target trainer count (``hypha scale``, ``hypha.scheduler.elastic``: a
growth cut short by the restart goes on, a shrink waits for the next round).
It is saved when the job starts running, after each completed round and
after each replacement or restore. The parameter server's state (θ_global,
momentum) is already kept per round in the state dir (``ps_state``).

After a restart (same identity, same state dir), ``JobStore.recover`` hands
the job back as resumed and ``resume`` rebuilds the run:

- the dataset's providers are looked up again; the slice tracker, the
  rounds and the newest kept parameter-server state come back from disk;
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
from typing import TYPE_CHECKING, Any

import grpc

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.scheduler.elastic import grow
from hypha.scheduler.providers import provider_peer
from hypha.scheduler.ps_state import KeptState, StateKeeper, packed_round
from hypha.scheduler.retry import Outcome
from hypha.scheduler.slices import SliceSnapshot, SliceTracker
from hypha.scheduler.worker_calls import describe

if TYPE_CHECKING:
    from hypha.scheduler.diloco_job import DilocoRun

log = logging.getLogger(__name__)

#: Bumped when the saved layout changes; a state of another version is not resumed from.
VERSION = 1


def _resources(r: Resources) -> dict[str, float]:
    return {
        "cpu": r.cpu,
        "memory_gb": r.memory_gb,
        "storage_gb": r.storage_gb,
        "gpu": r.gpu,
        "gpu_memory_gb": r.gpu_memory_gb,
    }


def _resources_from(d: dict[str, Any]) -> Resources:
    return Resources(**{k: float(v) for k, v in d.items()}).require_non_negative()


def lease_to_dict(lease: HeldLease, addresses: tuple[str, ...], capacity: Resources) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "worker_id": lease.worker_id,
        "request_id": lease.request_id,
        "minimum": _resources(lease.requirement.minimum),
        "executor": lease.requirement.executor.value,
        "resources": _resources(lease.resources),
        "price": lease.price,
        "expires_at": lease.expires_at,
        "ttl_s": lease.ttl_s,
        "job_id": lease.job_id,
        "addresses": list(addresses),
        "capacity": _resources(capacity),
    }


def lease_from_dict(d: dict[str, Any]) -> tuple[HeldLease, tuple[str, ...], Resources]:
    lease = HeldLease(
        lease_id=str(d["lease_id"]),
        worker_id=str(d["worker_id"]),
        request_id=str(d["request_id"]),
        requirement=Requirements(_resources_from(d["minimum"]), ExecutorKind(d["executor"])),
        resources=_resources_from(d["resources"]),
        price=float(d["price"]),
        expires_at=float(d["expires_at"]),
        ttl_s=float(d["ttl_s"]),
        job_id=str(d["job_id"]),
    )
    return lease, tuple(str(a) for a in d["addresses"]), _resources_from(d["capacity"])


def snapshot(run: DilocoRun) -> dict[str, Any]:
    """What resuming ``run`` after a restart needs (JSON-able; see the module docstring)."""
    market = run.runs.market

    def lease(held: HeldLease) -> dict[str, Any]:
        worker = held.worker_id
        return lease_to_dict(held, market.worker_addresses(worker), market.worker_capacity(worker))

    assert run.ps is not None and run.tracker is not None
    return {
        "version": VERSION,
        "completed": run.completed,
        "replacements_used": run.replacements_used,
        "ps_attempt": run.ps_attempt,
        "ps": lease(run.ps),
        "target_workers": run.target_workers,
        "trainers": [
            {
                "lease": lease(t.lease),
                "batch_size": t.batch_size,
                "attempt": t.attempt,
                "start_round": t.start_round,
                "finished": t.finished,
                "joined": t.joined,
            }
            for t in run.trainers.values()
        ],
        "slices": run.tracker.snapshot().to_dict(),
    }


def load_kept(keeper: StateKeeper) -> KeptState | None:
    """The newest parameter-server state kept on disk by a previous process (None: none)."""
    files = sorted(Path(keeper.directory).glob("round-*.safetensors"))
    if not files:
        return None
    blob = files[-1].read_bytes()
    return KeptState(packed_round(blob), files[-1], len(blob), hashlib.sha256(blob).hexdigest())


async def resume(run: DilocoRun, saved: dict[str, Any]) -> None:
    """Rebuild ``run`` from ``saved`` and take its workers back (see the module docstring)."""
    if saved.get("version") != VERSION:
        raise ValueError(f"saved run state has version {saved.get('version')!r}, not {VERSION}")
    runs, spec, market = run.runs, run.diloco, run.runs.market
    records = await run._find_providers(spec.dataset)
    run.data_providers = [provider_peer(record) for record in records]
    run.tracker = SliceTracker.from_snapshot(SliceSnapshot.from_dict(saved["slices"]))
    run.planner = run.planners(spec)
    run.completed = int(saved["completed"])
    run.replacements_used = int(saved["replacements_used"])
    run.ps_attempt = int(saved["ps_attempt"])
    run.target_workers = int(saved.get("target_workers", len(saved["trainers"])))
    run.state.latest = await asyncio.to_thread(load_kept, run.state)
    run.ps_started = True

    ps_lease, ps_addresses, ps_capacity = lease_from_dict(saved["ps"])
    trainers = [(entry, *lease_from_dict(entry["lease"])) for entry in saved["trainers"]]
    adopted = await asyncio.gather(
        market.adopt(ps_lease, ps_addresses, ps_capacity),
        *(market.adopt(lease, addresses, capacity) for _, lease, addresses, capacity in trainers),
    )
    ps_held, trainer_held = adopted[0], adopted[1:]
    run.ps = ps_held or ps_lease
    if ps_held is not None:
        runs.track_lease(run, ps_held)
    else:
        run.participants.add(ps_lease.worker_id)
    lost: list[str] = []
    for (entry, lease, _, _), held in zip(trainers, trainer_held, strict=True):
        if held is None:
            lost.append(lease.worker_id)
            run.participants.add(lease.worker_id)
        else:
            runs.track_lease(run, held)
        trainer = run._add_trainer(
            held or lease, attempt=int(entry["attempt"]), start_round=int(entry["start_round"])
        )
        trainer.finished = bool(entry["finished"])
        trainer.joined = int(entry.get("joined", trainer.joined))
    run.joins = max((t.joined for t in run.trainers.values()), default=-1) + 1
    taken = sum(held is not None for held in adopted)
    message = f"resuming from round {run.completed}: {taken} of {len(adopted)} leases taken back" + (
        f"; kept parameter-server state of round {run.state.latest.round}" if run.state.latest else ""
    )
    log.info("job %s: %s", run.job_id, message)
    await runs.store.note(run.job_id, message)

    # NOTE: the server first (a replacement trainer pulls θ_global from it); its restore
    # re-points only the trainers whose lease is held, and leases no server on a trainer's worker.
    if ps_held is None:
        why = f"parameter server {ps_lease.worker_id} lost while the scheduler was away"
        await run._restore_ps(why, True, run.ps_attempt)
    else:
        ended = await runs.calls.poll_status(ps_held.worker_id, run.job_id)
        if ended is not None:
            outcome, _, why = ended
            if outcome is Outcome.SUCCEEDED:
                run._end(True, why or outcome.value)
            else:
                run._ps_trouble(
                    f"parameter server {outcome.value} while the scheduler was away: {why}", lost=False
                )
    for worker_id in lost:
        runs.spawn(_retake_trainer(run, worker_id), f"take back trainer {worker_id}")
    if len(run.trainers) < run.target_workers:
        runs.spawn(grow(run), f"grow job {run.job_id}")


async def _retake_trainer(run: DilocoRun, worker_id: str) -> None:
    """Lease a trainer whose lease expired again, preferably on its own worker (where it still runs).

    NOTE: it stays in the run meanwhile, so its reports are answered as before
    (a trainer no longer in the run is told DONE and would stop). The offers
    come from its own worker or from workers outside the job: its own one
    takes the running execution back under the new lease (same attempt and
    round: nothing restarts); another one is released, and the trainer is
    replaced as a lost one (``DilocoRun._replace_trainer``).
    """
    runs = run.runs
    trainer = run.trainers.get(worker_id)
    if trainer is None or run.over:
        return
    why = f"trainer {worker_id} lost while the scheduler was away"
    exclude = (set(run.trainers) - {worker_id}) | ({run.ps.worker_id} if run.ps else set())
    try:
        (lease,) = await run.lease_trainers(1, exclude=exclude)
    except HyphaError as err:
        log.warning("job %s: %s; leasing it again failed: %s", run.job_id, why, err)
        await run._replace_trainer(worker_id, why, lost=True)
        return
    if lease.worker_id != worker_id or run.over or worker_id not in run.trainers:
        await runs.release_lease(run, lease, cancel=False)
        await run._replace_trainer(worker_id, why, lost=True)
        return
    trainer.lease = lease
    try:
        await run._dispatch_trainer(trainer)
    except (grpc.aio.AioRpcError, HyphaError) as err:
        await run._replace_trainer(worker_id, f"{why}; taking it back failed: {describe(err)}", lost=False)
        return
    await runs.store.note(run.job_id, f"trainer {worker_id} taken back under lease {lease.lease_id}")
    await run._save()


__all__ = ["VERSION", "lease_from_dict", "lease_to_dict", "load_kept", "resume", "snapshot"]
