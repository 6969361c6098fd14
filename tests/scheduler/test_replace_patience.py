"""A DiLoCo job short of free workers waits for them: a running one that lost a part waits
``jobs.replace_patience_s`` for a replacement; a starting one waits in the queue.

Under chaos every worker may be busy, or the one that died not back yet, at the
moment a parameter server or trainer is lost. The run must keep trying the
market (with backoff) and go on once a worker frees up; only when none does
within the patience does the job fail, saying why. The market and the worker
calls are stand-ins (the real ones need a cluster: ``tests/e2e``); the run, its
registry and the store are the real ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hypha.dht.records import ProviderRecord
from hypha.market.allocator import HeldLease
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.scheduler.config import JobsSection, SchedulerSection
from hypha.scheduler.diloco.round_planner import round_planners
from hypha.scheduler.diloco.run import DilocoRun
from hypha.scheduler.diloco.slice_tracker import SliceTracker
from hypha.scheduler.diloco.trainers import add_trainer
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.runs import RunRegistry
from hypha.scheduler.store import JobStore
from hypha.testing.polling import eventually
from hypha.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.timeout(30)

SPEC = common_pb2.JobSpec(
    name="patience",
    diloco=common_pb2.DilocoJobSpec(
        dataset="d",
        rounds=3,
        samples_per_round=64,
        num_workers=2,
        min_batch_size=8,
        max_batch_size=8,
        worker_requirements=common_pb2.Requirements(executor=common_pb2.EXECUTOR_KIND_DILOCO_TRAINER),
        parameter_server_requirements=common_pb2.Requirements(
            executor=common_pb2.EXECUTOR_KIND_PARAMETER_SERVER
        ),
    ),
)


@dataclass
class _Market:
    """Leases whichever of ``free`` is not excluded; counts the tries."""

    free: list[str] = field(default_factory=list)
    tries: int = 0
    released: list[str] = field(default_factory=list)
    #: Leases watched for a quick loss (parameter servers' and trainers').
    watched: list[str] = field(default_factory=list)
    _leases: int = 0

    def watch(self, lease_id: str) -> None:
        self.watched.append(lease_id)

    async def allocate(
        self,
        requirement: Requirements,
        count: int,
        price: Any,
        policy: Any,
        *,
        tag: str = "",
        exclude: Collection[str] = (),
    ) -> list[HeldLease]:
        self.tries += 1
        picked = [w for w in self.free if w not in exclude][:count]
        for worker in picked:
            self.taken(worker)
        return [self.lease(worker) for worker in picked]

    def taken(self, worker_id: str) -> None:
        """A worker leased is no longer free."""
        self.free.remove(worker_id)

    def lease(self, worker_id: str) -> HeldLease:
        self._leases += 1
        requirement = Requirements(Resources(), ExecutorKind.parse("task"))
        return HeldLease(f"L{self._leases}", worker_id, "r", requirement, Resources(cpu=1), 1.0, 1e12, 10.0)

    async def release(self, lease_id: str) -> None:
        self.released.append(lease_id)

    def addresses(self) -> list[str]:
        return []

    def worker_addresses(self, worker_id: str) -> tuple[str, ...]:
        return ()

    def worker_capacity(self, worker_id: str) -> Resources:
        return Resources()


@dataclass
class _Calls:
    """Records dispatches (worker, executor, parameter server named) instead of sending them."""

    dispatched: list[tuple[str, int, str]] = field(default_factory=list)
    #: The trainer list of each dispatch to a parameter server, in order.
    server_lists: list[list[str]] = field(default_factory=list)

    async def dispatch(self, worker_id: str, request: worker_pb2.DispatchJobRequest) -> None:
        self.dispatched.append((worker_id, int(request.executor), request.parameter_server_id))
        if request.executor == common_pb2.EXECUTOR_KIND_PARAMETER_SERVER:
            self.server_lists.append(sorted(request.trainer_ids))

    async def cancel(self, worker_id: str, job_id: str) -> None:
        return


@pytest.fixture
async def store() -> AsyncIterator[JobStore]:
    job_store = await JobStore.open(":memory:")
    yield job_store
    await job_store.close()


async def running_job(
    store: JobStore, market: _Market, tmp_path: Path, patience_s: float
) -> tuple[DilocoRun, RunRegistry, _Calls]:
    """A started job: a parameter server on ps0, trainers on t0 and t1, no worker free."""
    # allocate_wait_s (the start's wait) is far shorter than the patience: replacements must use the latter.
    jobs = JobsSection(replace_patience_s=patience_s, allocate_wait_s=0.05, queue_retry_s=0.02)
    calls = _Calls()
    runs = RunRegistry(market, store, calls, SchedulerSection(jobs=jobs))  # type: ignore[arg-type]
    job = await store.create(SPEC)
    await store.transition(job.job_id, JobState.ALLOCATING)
    await store.transition(job.job_id, JobState.RUNNING, workers=["ps0", "t0", "t1"])
    run = DilocoRun(job, runs, round_planners(), None, tmp_path)
    run.state.ended = asyncio.get_running_loop().create_future()
    run.state.tracker = SliceTracker(4)
    run.state.planner = run.planners(SPEC.diloco)
    run.state.ps = market.lease("ps0")
    runs.track_lease(run, run.state.ps)
    for worker in ("t0", "t1"):
        lease = market.lease(worker)
        runs.track_lease(run, lease)
        add_trainer(run, lease, attempt=0, start_round=0)
    run.state.ps_started = True
    return run, runs, calls


def lose(run: DilocoRun, runs: RunRegistry, worker_id: str) -> None:
    """The market lost the lease on ``worker_id`` (as ``Orchestrator`` hands it to the run)."""
    lease = next(lease for lease in run.leases.values() if lease.worker_id == worker_id)
    assert runs.lease_lost(lease) is run
    run.on_lease_lost(lease, "lease expired")


async def test_a_lost_parameter_server_waits_for_a_free_worker_and_the_job_goes_on(
    store: JobStore, tmp_path: Path
) -> None:
    market = _Market()
    run, runs, calls = await running_job(store, market, tmp_path, patience_s=20.0)
    try:
        lose(run, runs, "ps0")
        # Well past allocate_wait_s, and tried again more than once: still waiting, not failed.
        await eventually(lambda: market.tries >= 3, message="the market tried again")
        assert not run.state.over
        assert (await store.get(run.job_id)).state is JobState.ALLOCATING
        market.free.append("w9")  # a worker frees up (a job ended, a killed one came back)
        await eventually(
            lambda: run.state.ps is not None and run.state.ps.worker_id == "w9", message="restored"
        )
        await eventually(
            lambda: sorted(w for w, _, ps in calls.dispatched if ps == "w9") == ["t0", "t1"],
            message="trainers re-pointed at the new server",
        )
        assert ("w9", int(common_pb2.EXECUTOR_KIND_PARAMETER_SERVER), "") in calls.dispatched
        job = await eventually(
            lambda: _state_is(store, run.job_id, JobState.RUNNING), message="RUNNING again"
        )
        assert "w9" in job.workers
        assert not run.state.over
        ps = run.state.ps
        assert ps is not None and ps.lease_id in market.watched  # its loss is noticed in seconds
    finally:
        await runs.stop()


async def test_a_lost_parameter_server_with_no_worker_within_the_patience_fails_the_job_saying_why(
    store: JobStore, tmp_path: Path
) -> None:
    market = _Market()
    run, runs, _ = await running_job(store, market, tmp_path, patience_s=0.5)
    try:
        lose(run, runs, "ps0")
        assert run.state.ended is not None
        succeeded, message = await asyncio.wait_for(asyncio.shield(run.state.ended), 10)
        assert not succeeded
        assert "parameter server ps0 lost" in message
        assert "no free worker within 0.5s" in message
        assert market.tries >= 2  # it did try again before giving up
    finally:
        await runs.stop()


async def test_a_lost_trainer_waits_for_a_free_worker_and_is_replaced(
    store: JobStore, tmp_path: Path
) -> None:
    market = _Market()
    run, runs, calls = await running_job(store, market, tmp_path, patience_s=20.0)
    try:
        lose(run, runs, "t1")
        await eventually(lambda: market.tries >= 3, message="the market tried again")
        assert not run.state.over and "t1" not in run.state.trainers
        market.free.append("w9")
        await eventually(lambda: "w9" in run.state.trainers, message="replacement trainer")
        await eventually(
            lambda: ("w9", int(common_pb2.EXECUTOR_KIND_DILOCO_TRAINER), "ps0") in calls.dispatched
        )
        await eventually(lambda: _state_is(store, run.job_id, JobState.RUNNING), message="RUNNING again")
        assert not run.state.over
        # The replacement's loss is noticed in seconds too, not at its lease's expiry.
        assert run.state.trainers["w9"].lease.lease_id in market.watched
    finally:
        await runs.stop()


async def test_a_job_that_ends_while_its_replacement_waits_takes_no_worker(
    store: JobStore, tmp_path: Path
) -> None:
    market = _Market()
    run, runs, _ = await running_job(store, market, tmp_path, patience_s=20.0)
    try:
        lose(run, runs, "ps0")
        await eventually(lambda: market.tries >= 2, message="waiting for a worker")
        run.state.end(False, "cancelled meanwhile")
        market.free.append("w9")
        await eventually(lambda: not market.free, message="the worker was leased")
        # Leased after the job ended: given straight back, never made its parameter server.
        await eventually(lambda: len(market.released) == 1, message="lease given back")
        assert run.state.ps is not None and run.state.ps.worker_id == "ps0"
        assert not any(lease.worker_id == "w9" for lease in run.leases.values())
    finally:
        await runs.stop()


@dataclass
class _Providers:
    """One data node serving the job's dataset (the DHT lookup is tested in ``tests/dht``)."""

    async def find_within(self, dataset: str, wait_s: float, clock: Any) -> list[ProviderRecord]:
        return [ProviderRecord(dataset, "data0", ("127.0.0.1:1",), 4, 1, 0.0, 1e12)]


async def test_a_starting_job_short_of_workers_gives_back_what_it_got_and_waits_queued(
    store: JobStore, tmp_path: Path
) -> None:
    # Two of the three workers it needs are free: it must not hold them while it waits (another
    # starting job could be holding the rest, each keeping the other from starting).
    market = _Market(free=["w0", "w1"])
    jobs = JobsSection(allocate_wait_s=0.1, queue_retry_s=0.05)
    calls = _Calls()
    runs = RunRegistry(market, store, calls, SchedulerSection(jobs=jobs))  # type: ignore[arg-type]
    job = await store.create(SPEC)
    run = DilocoRun(job, runs, round_planners(), _Providers(), tmp_path)  # type: ignore[arg-type]
    start = asyncio.create_task(run.start())
    try:
        queued = await eventually(lambda: _requeued(store, job.job_id), message="back in the queue")
        assert "could lease only 1 of 2 trainers" in queued.reason
        assert len(market.released) == 2 and not run.leases  # both leases given back
        assert not calls.dispatched and not start.done()
        tries = market.tries
        await eventually(lambda: market.tries > tries + 1, message="it tries again while queued")
        market.free[:] = ["w0", "w1", "w2"]  # a job ended: three workers free
        await asyncio.wait_for(start, 10)
        assert (await store.get(job.job_id)).state is JobState.RUNNING
        assert run.state.ps is not None and sorted([run.state.ps.worker_id, *run.state.trainers]) == [
            "w0",
            "w1",
            "w2",
        ]
        assert len(calls.dispatched) == 3
    finally:
        start.cancel()
        await runs.stop()


async def _requeued(store: JobStore, job_id: str) -> Any:
    job = await store.get(job_id)
    return job if job.state is JobState.PENDING and "queued" in job.reason else None


async def _state_is(store: JobStore, job_id: str, state: JobState) -> Any:
    job = await store.get(job_id)
    return job if job.state is state else None
