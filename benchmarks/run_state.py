"""What a DiLoCo run writes to keep its state through a scheduler restart, per epoch of hand-outs.

    python benchmarks/run_state.py [--quick] [--slices N]

Ours: a real ``DilocoRun`` (its registry and a SQLite ``JobStore`` on disk are the real ones;
the market and the worker calls are stand-ins) hands every slice of a job to two trainers once,
each request reporting the slice it used before; each hand-out saves the run's state as it
does in a job (``hypha.scheduler.diloco.snapshot.RunSaver``: only the parts that changed).

Baseline: the same run and hand-outs, saving the whole state at each hand-out (the layout
before the incremental save: every slice's state and owner in one row), in the same run.

figure = MB written per epoch by ours (JSON bytes handed to the store); ratio = figure /
baseline. The JSON also carries the seconds each took for the epoch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from _common import report

from hypha.market.allocator import HeldLease
from hypha.market.resources import ExecutorKind, Requirements, Resources
from hypha.scheduler.config import JobsSection, SchedulerSection
from hypha.scheduler.diloco.round_planner import round_planners
from hypha.scheduler.diloco.run import DilocoRun
from hypha.scheduler.diloco.slice_tracker import SliceTracker
from hypha.scheduler.diloco.snapshot import run_parts
from hypha.scheduler.diloco.trainers import add_trainer
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.runs import RunRegistry
from hypha.scheduler.store import JobStore
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2

SPEC = common_pb2.JobSpec(
    name="bench",
    diloco=common_pb2.DilocoJobSpec(
        dataset="d", rounds=3, samples_per_round=64, num_workers=2, min_batch_size=8, max_batch_size=8
    ),
)
TRAINERS = ("trainer-0", "trainer-1")


class _Market:
    """Hands out leases on any worker; knows no addresses."""

    def __init__(self) -> None:
        self._leases = 0

    def lease(self, worker_id: str) -> HeldLease:
        self._leases += 1
        requirement = Requirements(Resources(), ExecutorKind.parse("task"))
        return HeldLease(f"L{self._leases}", worker_id, "r", requirement, Resources(cpu=1), 1.0, 1e12, 10.0)

    async def allocate(self, *args: Any, exclude: Collection[str] = (), **kwargs: Any) -> list[HeldLease]:
        return []

    async def release(self, lease_id: str) -> None:
        return

    def addresses(self) -> list[str]:
        return []

    def worker_addresses(self, worker_id: str) -> tuple[str, ...]:
        return ("127.0.0.1:7000",)

    def worker_capacity(self, worker_id: str) -> Resources:
        return Resources(cpu=8, memory_gb=32)


class _Calls:
    async def dispatch(self, worker_id: str, request: worker_pb2.DispatchJobRequest) -> None:
        return

    async def cancel(self, worker_id: str, job_id: str) -> None:
        return


class _CountingStore(JobStore):
    """The real store; counts the JSON bytes each save hands it."""

    written = 0

    async def save_run_state(self, job_id: str, parts: Mapping[str, Any], *, replace: bool = False) -> bool:
        self.written += sum(len(k) + len(json.dumps(v, sort_keys=True)) for k, v in parts.items())
        return await super().save_run_state(job_id, parts, replace=replace)


class _WholeStateRun(DilocoRun):
    """The baseline: the whole state, every slice included, written at each save."""

    async def save(self) -> None:
        tracker = self.state.tracker
        assert tracker is not None
        count = tracker.slice_count
        slices = {
            **tracker.snapshot().header,
            "states": [str(tracker.state(i)) for i in range(count)],
            "owners": [tracker.owner(i) for i in range(count)],
        }
        await self.runs.store.save_run_state(self.job_id, {"state": {**run_parts(self), "slices": slices}})


async def _epoch(run_class: type[DilocoRun], slices: int, directory: Path) -> tuple[int, float]:
    """(bytes written, seconds) for one epoch of hand-outs by a run of ``run_class``."""
    store = _CountingStore(directory / "scheduler.db")
    await store.start()
    try:
        market = _Market()
        runs = RunRegistry(market, store, _Calls(), SchedulerSection(jobs=JobsSection()))  # type: ignore[arg-type]
        job = await store.create(SPEC)
        await store.transition(job.job_id, JobState.ALLOCATING)
        await store.transition(job.job_id, JobState.RUNNING)
        run = run_class(job, runs, round_planners(), None, directory)
        state = run.state
        state.ended = asyncio.get_running_loop().create_future()
        state.tracker = SliceTracker(slices)
        state.planner = run.planners(SPEC.diloco)
        state.ps = market.lease("ps")
        runs.track_lease(run, state.ps)
        for worker in TRAINERS:
            lease = market.lease(worker)
            runs.track_lease(run, lease)
            add_trainer(run, lease, attempt=0, start_round=0)
        state.ps_started = True
        await run.save()  # the run starts running
        store.written = 0
        used: dict[str, list[int]] = {w: [] for w in TRAINERS}
        started = time.perf_counter()
        while state.tracker.epoch == 0:
            for worker in TRAINERS:
                reply = await run.next_slice(worker, scheduler_pb2.NextSliceRequest(used=used[worker]))
                used[worker] = [reply.index] if reply.available else []
        return store.written, time.perf_counter() - started
    finally:
        await store.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 slices instead of 10,000")
    parser.add_argument("--slices", type=int, default=0, help="slices in the job (overrides --quick)")
    args = parser.parse_args()
    slices = args.slices or (1_000 if args.quick else 10_000)
    with tempfile.TemporaryDirectory(prefix="hypha-bench-") as tmp:
        ours, ours_s = await _epoch(DilocoRun, slices, Path(tmp) / "ours")
        base, base_s = await _epoch(_WholeStateRun, slices, Path(tmp) / "baseline")
    mb, base_mb = ours / 1e6, base / 1e6
    print(
        f"{slices} slices, one epoch: ours {mb:.2f} MB in {ours_s:.2f}s;"
        f" whole state {base_mb:.1f} MB in {base_s:.1f}s"
    )
    report(
        "run_state",
        mb,
        "MB per epoch",
        base_mb,
        mb / base_mb,
        slices=slices,
        seconds=round(ours_s, 3),
        baseline_seconds=round(base_s, 3),
        time_ratio=round(ours_s / base_s, 4),
    )


if __name__ == "__main__":
    asyncio.run(main())
