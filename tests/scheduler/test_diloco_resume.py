"""What a DiLoCo run saves for a scheduler restart survives JSON exactly, and the kept server state
is found again on disk (the resume itself runs end to end in ``tests/e2e/test_scheduler_restart_e2e.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

from hypha.market.allocator import HeldLease
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.scheduler.diloco_resume import lease_from_dict, lease_to_dict, load_kept
from hypha.scheduler.ps_state import StateKeeper
from tests.scheduler.test_ps_state import _blob


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
