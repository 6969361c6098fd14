"""What a DiLoCo run saves for a scheduler restart survives JSON exactly, its slices saved bit by
bit rebuild the tracker it had, and the kept server state is found again on disk (the resume
itself runs end to end in ``tests/e2e/test_scheduler_restart_e2e.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

from hypha.market.allocator import HeldLease
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.scheduler.diloco.ps_state import StateKeeper
from hypha.scheduler.diloco.resume import load_kept
from hypha.scheduler.diloco.slice_tracker import SliceTracker
from hypha.scheduler.diloco.snapshot import lease_from_dict, lease_to_dict, slices_from
from hypha.scheduler.store import JobStore
from hypha.v1 import scheduler_pb2
from tests.scheduler.test_ps_state import _blob
from tests.scheduler.test_replace_patience import _Market, running_job


def test_a_saved_lease_comes_back_equal_with_its_worker_addresses_and_capacity() -> None:
    lease = HeldLease(
        lease_id="l1",
        worker_id="w1",
        request_id="r1",
        requirement=Requirements(Resources(cpu=2.0, memory_gb=1.5), ExecutorKind.DILOCO_TRAINER),
        resources=Resources(cpu=2.0, memory_gb=1.5, gpu=1.0, gpu_memory_gb=24.0),
        price=0.25,
        expires_at=1_800_000_000.5,
        ttl_s=10.0,
        job_id="job1",
    )
    capacity = Resources(cpu=8.0, memory_gb=32.0, storage_gb=100.0, gpu=1.0, gpu_memory_gb=24.0)

    again = lease_from_dict(json.loads(json.dumps(lease_to_dict(lease, ("127.0.0.1:7000",), capacity))))

    assert again == (lease, ("127.0.0.1:7000",), capacity)


def test_the_newest_kept_state_is_found_on_disk_by_a_new_process(tmp_path: Path) -> None:
    keeper = StateKeeper(tmp_path, "job1")
    asyncio.run(keeper.keep(_blob(2), 2))
    asyncio.run(keeper.keep(_blob(3, b"\1" * 16), 3))

    found = load_kept(StateKeeper(tmp_path, "job1"))

    assert found is not None and found.round == 3
    assert found.sha256 == hashlib.sha256(_blob(3, b"\1" * 16)).hexdigest()
    assert load_kept(StateKeeper(tmp_path, "other")) is None


async def test_the_slices_a_run_saves_change_by_change_rebuild_the_tracker_it_had(tmp_path: Path) -> None:
    # Prepare: a running job of 50 slices on two trainers, saved once as it starts.
    store = await JobStore.open(tmp_path / "scheduler.db")
    try:
        run, _, _ = await running_job(store, _Market(), tmp_path, patience_s=1.0)
        run.state.tracker = tracker = SliceTracker(50)
        await run.save()

        # Execute: hand-outs into the second epoch, each request reporting the slice used before.
        used: dict[str, list[int]] = {"t0": [], "t1": []}
        for _ in range(40):
            for worker in used:
                reply = await run.next_slice(worker, scheduler_pb2.NextSliceRequest(used=used[worker]))
                used[worker] = [reply.index] if reply.available else []
        saved = await store.run_state(run.job_id)

        # Assert: what the saves wrote, a row at a time, is the tracker as it is now.
        assert tracker.epoch == 1 and saved is not None
        assert SliceTracker.from_snapshot(slices_from(saved)).snapshot() == tracker.snapshot()
    finally:
        await store.close()


async def test_slices_reported_used_are_saved_even_when_no_slice_is_left_to_hand_out(tmp_path: Path) -> None:
    # At an epoch's end a trainer reports its last slices used and gets none (the other trainer
    # still holds the rest). Those marks were saved only with the next hand-out: a scheduler
    # killed then came back with the slices still handed out to a trainer that had used them,
    # and the epoch, and the job, never ended (the container chaos test's stall).
    store = await JobStore.open(tmp_path / "scheduler.db")
    try:
        run, _, _ = await running_job(store, _Market(), tmp_path, patience_s=1.0)
        run.state.tracker = tracker = SliceTracker(4)
        await run.save()
        held: dict[str, list[int]] = {"t0": [], "t1": []}
        for _ in range(2):  # each trainer takes its prefetch allowance: all 4 slices handed out
            for worker in held:
                reply = await run.next_slice(worker, scheduler_pb2.NextSliceRequest())
                assert reply.available
                held[worker].append(reply.index)

        reply = await run.next_slice("t0", scheduler_pb2.NextSliceRequest(used=held["t0"]))
        saved = await store.run_state(run.job_id)

        assert not reply.available and saved is not None
        assert SliceTracker.from_snapshot(slices_from(saved)).snapshot() == tracker.snapshot()
    finally:
        await store.close()
