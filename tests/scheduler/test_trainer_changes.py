"""Parts of a job changed on several paths at once stay one per worker, and a trainer replaced on
its own worker is neither undone by a late report nor refused by the execution it replaces.

Two trainers lost together are replaced side by side, and a parameter server
may be restored while a trainer is replaced; each excludes the workers it
knew when it began, so both may buy a lease on the same worker (one with room
for two). Only one part may run there (``RunRegistry.lease_many``). And a
trainer replaced on the same worker (its own worker came back first) must not
be replaced again when the final report of the execution it replaced arrives
late, nor fail to start while that execution still winds down there. The
market and the worker calls are stand-ins
(``tests/scheduler/test_replace_patience.py``); the run, its registry and the
store are the real ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from hypha.market.allocator import HeldLease
from hypha.scheduler.diloco.run import DilocoRun
from hypha.scheduler.runs import RunRegistry
from hypha.scheduler.store import JobStore
from hypha.testing.polling import eventually
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2
from tests.scheduler.test_replace_patience import _Calls, _Market, lose, running_job

pytestmark = pytest.mark.timeout(30)


@dataclass
class _RoomyMarket(_Market):
    """Each of ``free`` has room for several trainers (it is leased again and again); every call
    waits at ``gate``, so the test decides when concurrent calls come back."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    #: The worker of every lease handed out, by lease id.
    issued: dict[str, str] = field(default_factory=dict)

    def lease(self, worker_id: str) -> HeldLease:
        held = super().lease(worker_id)
        self.issued[held.lease_id] = worker_id
        return held

    def released_on(self, worker_id: str) -> int:
        return sum(self.issued.get(lease_id) == worker_id for lease_id in self.released)

    async def allocate(self, *args: Any, **kwargs: Any) -> list[HeldLease]:
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        return await super().allocate(*args, **kwargs)

    def taken(self, worker_id: str) -> None:
        """Room for another: it stays free."""


async def lose_together(run: DilocoRun, runs: RunRegistry, market: _RoomyMarket, *workers: str) -> None:
    """The leases on ``workers`` are lost at once; each path that replaces one asks the market
    before any is answered."""
    for worker in workers:
        lose(run, runs, worker)
    await eventually(lambda: market.waiting == len(workers), message="each replacement asks the market")
    market.gate.set()


@pytest.fixture
async def store() -> AsyncIterator[JobStore]:
    job_store = await JobStore.open(":memory:")
    yield job_store
    await job_store.close()


@pytest.mark.parametrize(
    ("lost", "after"),
    [(("t0", "t1"), ["ps0", "w8", "w9"]), (("ps0", "t1"), ["t0", "w8", "w9"])],
    ids=["two trainers", "the server and a trainer"],
)
async def test_parts_lost_together_never_end_up_on_one_worker(
    store: JobStore, tmp_path: Path, lost: tuple[str, str], after: list[str]
) -> None:
    # Prepare: w9 alone is free, with room for two parts of the job.
    market = _RoomyMarket(free=["w9"])
    run, runs, _ = await running_job(store, market, tmp_path, patience_s=20.0)

    def parts() -> list[str]:
        return sorted([run.state.ps.worker_id if run.state.ps else "", *run.state.trainers])

    try:
        # Execute: both parts are lost at once; both paths that replace them are offered w9.
        await lose_together(run, runs, market, *lost)

        # Assert: one takes w9; the other gives its w9 lease back and waits for another worker.
        await eventually(lambda: "w9" in parts(), message="one part on w9")
        await eventually(lambda: market.released_on("w9") == 1, message="the second w9 lease given back")
        assert parts().count("w9") == 1 and not run.state.over
        market.free.append("w8")  # another worker frees up
        await eventually(lambda: parts() == after, message="both parts back")
        assert sorted(lease.worker_id for lease in run.leases.values()) == after  # none leaked
        assert run.state.replacements_used == 2
    finally:
        await runs.stop()


async def test_a_lost_trainers_round_is_left_to_the_survivors_while_its_replacement_is_leased(
    store: JobStore, tmp_path: Path
) -> None:
    # Prepare: no worker free, so t1's replacement waits on the market.
    market = _Market()
    run, runs, calls = await running_job(store, market, tmp_path, patience_s=20.0)
    try:
        # Execute: t1's lease is lost.
        lose(run, runs, "t1")

        # Assert: before any replacement, the server is told that t0 alone trains now (it stops
        # waiting for t1's delta in the round in flight); then the replacement joins the list.
        await eventually(lambda: calls.server_lists == [["t0"]], message="the server told t0 alone")
        assert market.tries >= 1 and "t1" not in run.state.trainers
        market.free.append("w9")
        await eventually(lambda: calls.server_lists[-1:] == [["t0", "w9"]], message="w9 joins")
        assert run.state.replacements_used == 1
    finally:
        await runs.stop()


async def test_a_late_final_report_of_a_replaced_trainer_leaves_its_replacement_alone(
    store: JobStore, tmp_path: Path
) -> None:
    # Prepare: t1's lease lapsed and t1 itself, back first, is leased again for its replacement.
    market = _Market()
    run, runs, _ = await running_job(store, market, tmp_path, patience_s=20.0)

    def replacing() -> bool:
        return any(task.get_name().startswith("replace trainer") for task in runs.background)

    try:
        lose(run, runs, "t1")
        await eventually(lambda: market.tries >= 1, message="the replacement asks the market")
        market.free.append("t1")
        await eventually(lambda: "t1" in run.state.trainers, message="t1 replaced by itself")
        await eventually(lambda: not replacing(), message="the replacement done")
        replacement = run.state.trainers["t1"]
        assert replacement.attempt != 0  # the first execution's attempt

        # Execute: the first execution's FAILED report arrives late (its worker kept retrying it).
        def failed(attempt: int) -> scheduler_pb2.JobStatusReport:
            return scheduler_pb2.JobStatusReport(
                job_id=run.job_id, state=scheduler_pb2.EXECUTION_STATE_REPORT_FAILED, attempt=attempt
            )

        run.on_status("t1", failed(0))

        # Assert: the replacement trains on (nothing set out to replace it); its own failure is
        # what replaces it.
        assert not replacing()
        assert run.state.trainers["t1"] is replacement and run.state.replacements_used == 1
        market.free.append("w9")
        run.on_status("t1", failed(replacement.attempt))
        await eventually(lambda: "w9" in run.state.trainers, message="the failed replacement replaced")
        assert run.state.replacements_used == 2
    finally:
        await runs.stop()


@dataclass
class _WindingDownCalls(_Calls):
    """``winding_down[w]``: dispatches that ``w`` answers ALREADY_EXISTS, since an execution of
    the job still winds down there; the scheduler must cancel it before each try again."""

    winding_down: dict[str, int] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    _cancelled_since: set[str] = field(default_factory=set)

    async def dispatch(self, worker_id: str, request: worker_pb2.DispatchJobRequest) -> None:
        if self.winding_down.get(worker_id, 0) > 0:
            assert worker_id in self._cancelled_since, "dispatched again without cancelling first"
            self.winding_down[worker_id] -= 1
            self._cancelled_since.discard(worker_id)
            details = f"job {request.job_id} already runs here"
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.ALREADY_EXISTS, grpc.aio.Metadata(), grpc.aio.Metadata(), details
            )
        await super().dispatch(worker_id, request)

    async def cancel(self, worker_id: str, job_id: str) -> None:
        self.cancelled.append(worker_id)
        self._cancelled_since.add(worker_id)


async def test_a_trainer_replaced_on_a_worker_still_winding_down_its_failed_one_is_dispatched(
    store: JobStore, tmp_path: Path
) -> None:
    # Prepare: t1's execution failed; t1 is offered again for its replacement, but its failed
    # execution is still winding down there for the first two dispatches.
    market = _Market()
    run, runs, _ = await running_job(store, market, tmp_path, patience_s=20.0)
    calls = _WindingDownCalls(winding_down={"t1": 2})
    runs.calls = calls  # type: ignore[assignment]
    market.free.append("t1")
    try:
        # Execute
        run.on_status(
            "t1",
            scheduler_pb2.JobStatusReport(
                job_id=run.job_id, state=scheduler_pb2.EXECUTION_STATE_REPORT_FAILED, attempt=0
            ),
        )

        # Assert: cancelled and dispatched again until it took; the job goes on with t1's new attempt.
        trainer = int(common_pb2.EXECUTOR_KIND_DILOCO_TRAINER)
        await eventually(lambda: ("t1", trainer, "ps0") in calls.dispatched, message="dispatched")
        assert calls.winding_down["t1"] == 0 and calls.cancelled.count("t1") >= 2
        assert not run.state.over and run.state.trainers["t1"].attempt != 0
    finally:
        await runs.stop()
