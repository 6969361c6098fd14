"""What a running DiLoCo job saves for a scheduler restart, and how it is written: incrementally.

The run saves, as parts of the store's run state (``JobStore.save_run_state``:
one row per part, in one transaction), everything the scheduler's memory alone
held: the leases of its parameter server and trainers (with the workers'
addresses and capacity, so they can be reached without a new offer), each
trainer's batch size, attempt and start round, the completed rounds, the
replacements used, the target trainer count (``hypha scale``, ``elastic``), the
samples per round fitted to the link (``link_fit``), and the slice tracker's
header and one row per slice that was ever used (``SliceTracker.take_changes``).
It is saved when the job starts running, at each slice handed out, after each
completed round and after each replacement, restore or scale. The parameter
server's state (θ_global, momentum) is kept per round in the state dir
(``ps_state``). ``resume`` rebuilds the run from it.

Decisions (NOTE):
- Only what changed is written (``RunSaver``): a part equal to the one last
  written is skipped, and only the slice rows that changed go out. A hand-out
  thus writes the tracker's small header, not every slice: O(slices) bytes
  per epoch instead of O(slices²) (``docs/performance.md``).
- A failed write is logged, not raised, and what it carried is written with
  the next save; the first save of a run replaces whatever an earlier life
  of the job left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.scheduler.diloco.slice_tracker import SliceSnapshot
from hypha.scheduler.diloco.state import DilocoOps

log = logging.getLogger(__name__)

#: Bumped when the saved layout changes; a state of another version is not resumed from.
VERSION = 2
#: The part holding the slice tracker's header; each slice's row is the part ``slice/<index>``.
SLICES = "slices"
SLICE_PART = "slice/"


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


def run_parts(run: DilocoOps) -> dict[str, Any]:
    """The saved parts of ``run`` besides its slices' (JSON-able; see the module docstring)."""
    market, state = run.runs.market, run.state

    def lease(held: HeldLease) -> dict[str, Any]:
        worker = held.worker_id
        return lease_to_dict(held, market.worker_addresses(worker), market.worker_capacity(worker))

    assert state.ps is not None
    fitted = {} if state.link_fit is None else {"link_fit": state.link_fit.saved()}
    return fitted | {
        "version": VERSION,
        "completed": state.completed,
        "replacements_used": state.replacements_used,
        "ps_attempt": state.ps_attempt,
        "ps": lease(state.ps),
        "target_workers": state.target_workers,
        "trainers": [
            {
                "lease": lease(t.lease),
                "batch_size": t.batch_size,
                "attempt": t.attempt,
                "start_round": t.start_round,
                "finished": t.finished,
                "joined": t.joined,
            }
            for t in state.trainers.values()
        ],
    }


def slices_from(saved: Mapping[str, Any]) -> SliceSnapshot:
    """The slice tracker's part of a saved run state."""
    rows = {int(k[len(SLICE_PART) :]): v for k, v in saved.items() if k.startswith(SLICE_PART)}
    return SliceSnapshot(saved[SLICES], rows)


class RunSaver:
    """Writes one run's state, each save only the parts that changed since the last write."""

    def __init__(self) -> None:
        #: Serialises saves: each takes its snapshot under it, so the newest is written last.
        self._lock = asyncio.Lock()
        #: The parts as last written (slice rows aside).
        self._written: dict[str, Any] = {}

    async def save(self, run: DilocoOps) -> None:
        state = run.state
        if state.ps is None or state.tracker is None or state.over:
            return
        async with self._lock:
            tracker = state.tracker
            parts = run_parts(run)
            changes = tracker.take_changes()
            parts[SLICES] = changes.header
            write = {k: v for k, v in parts.items() if self._written.get(k) != v}
            write.update({f"{SLICE_PART}{i}": list(row) for i, row in changes.rows.items()})
            try:
                await run.runs.store.save_run_state(run.job_id, write, replace=changes.full)
            except HyphaError as err:
                tracker.changes_lost(changes)
                self._written.clear()
                log.warning("job %s: run state not saved: %s", run.job_id, err)
                return
            self._written.update(parts)


__all__ = [
    "SLICES",
    "SLICE_PART",
    "VERSION",
    "RunSaver",
    "lease_from_dict",
    "lease_to_dict",
    "run_parts",
    "slices_from",
]
