"""An inference run against a fake market and fake workers: retries, slices, the model job's push.

The whole path runs in ``tests/e2e/test_inference_e2e.py``; these pin what a
real cluster rarely shows: a worker lost at dispatch is replaced, each slice
goes out once and only to the current worker, and a model job's result is
pushed to the execution after its dispatch, named by its sha256 in the spec.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hypha import bundles
from hypha.errors import UnavailableError
from hypha.market.allocator import HeldLease
from hypha.market.resources import Requirements, Resources
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.inference_job import MODEL_KIND, InferenceRun
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.runs import RunRegistry
from hypha.scheduler.store import JobStore
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2
from tests.helpers import eventually


class FakeCalls:
    """Workers: dispatch fails on those listed in ``down``; every push is recorded."""

    def __init__(self, down: set[str]) -> None:
        self.down = down
        self.dispatched: list[tuple[str, worker_pb2.DispatchJobRequest]] = []
        self.pushed: list[tuple[str, str, bytes]] = []

    async def dispatch(self, worker_id: str, request: worker_pb2.DispatchJobRequest) -> None:
        if worker_id in self.down:
            raise UnavailableError(f"{worker_id} is gone")
        self.dispatched.append((worker_id, request))

    async def push_tensors(
        self, worker_id: str, job_id: str, kind: str, round_: int, payload: bytes, timeout_s: float
    ) -> worker_pb2.PushTensorsResponse:
        self.pushed.append((worker_id, kind, payload))
        return worker_pb2.PushTensorsResponse(accepted=True)

    async def cancel(self, worker_id: str, job_id: str) -> None:
        return None

    async def poll_status(self, worker_id: str, job_id: str) -> Any:
        return None


class FakeMarket:
    """Hands out one lease per call, on w1, w2, ... in turn."""

    def __init__(self) -> None:
        self.count = 0

    async def allocate(
        self, requirement: Requirements, count: int, *args: Any, **kwargs: Any
    ) -> list[HeldLease]:
        self.count += 1
        worker = f"w{self.count}"
        return [
            HeldLease(f"l{self.count}", worker, "r", requirement, Resources(cpu=1), 1.0, time.time() + 60, 60)
        ]

    async def release(self, lease_id: str) -> None:
        return None

    def addresses(self) -> list[str]:
        return []


@pytest.fixture
async def store() -> AsyncIterator[JobStore]:
    job_store = await JobStore.open(":memory:")
    yield job_store
    await job_store.close()


def registry(store: JobStore, calls: FakeCalls) -> RunRegistry:
    return RunRegistry(FakeMarket(), store, calls, SchedulerSection())  # type: ignore[arg-type]


def spec(**fields: Any) -> common_pb2.JobSpec:
    inference = common_pb2.InferenceJobSpec(inputs=[common_pb2.InferenceInput(prompt="1+1=")], **fields)
    inference.requirements.executor = common_pb2.EXECUTOR_KIND_INFERENCE
    return common_pb2.JobSpec(name="i", inference=inference)


async def test_a_worker_lost_at_dispatch_is_replaced_and_a_failed_run_fails_the_job(
    store: JobStore, tmp_path: Path
) -> None:
    calls = FakeCalls(down={"w1"})
    runs = registry(store, calls)
    job = await store.create(spec(model=common_pb2.ModelSpec(local_path="/m")))
    run = InferenceRun(job, runs, None, tmp_path)
    runs.launch(run, job)

    await eventually(lambda: len(calls.dispatched) == 1, timeout=10)
    worker, request = calls.dispatched[0]
    assert worker == "w2" and request.attempt == 2
    assert request.executor == common_pb2.EXECUTOR_KIND_INFERENCE and not calls.pushed
    run.on_status(
        "w2",
        scheduler_pb2.JobStatusReport(
            job_id=job.job_id, attempt=2, state=common_pb2.JOB_STATE_FAILED, exit_code=1, message="bad model"
        ),
    )
    assert run.task is not None
    await asyncio.wait_for(run.task, 10)

    ended = await store.get(job.job_id)
    assert ended.state is JobState.FAILED and "bad model" in ended.reason, ended.reason


async def test_slices_go_out_once_each_and_only_to_the_current_worker(
    store: JobStore, tmp_path: Path
) -> None:
    runs = registry(store, FakeCalls(down=set()))
    job = await store.create(spec(model=common_pb2.ModelSpec(local_path="/m")))
    run = InferenceRun(job, runs, None, tmp_path)
    run.slice_count, run.worker_id = 3, "w1"
    request = scheduler_pb2.NextSliceRequest(job_id=job.job_id)

    stranger = await run.next_slice("w9", request)
    handed = [await run.next_slice("w1", request) for _ in range(4)]

    assert not stranger.available
    assert [r.index for r in handed if r.available] == [0, 1, 2] and not handed[-1].available


async def test_a_model_jobs_result_is_pushed_after_the_dispatch_named_by_its_sha256(
    store: JobStore, tmp_path: Path
) -> None:
    result = tmp_path / "results" / "m"
    (result / "model").mkdir(parents=True)
    (result / "model" / "config.json").write_text("{}")
    producer = await store.create(common_pb2.JobSpec(name="p", task=common_pb2.TaskJobSpec(command="x")))
    for state in (JobState.ALLOCATING, JobState.RUNNING):
        await store.transition(producer.job_id, state)
    await store.transition(producer.job_id, JobState.SUCCEEDED, result_path=str(result))
    calls = FakeCalls(down=set())
    runs = registry(store, calls)
    job = await store.create(spec(model_job=producer.job_id))
    run = InferenceRun(job, runs, None, tmp_path)
    runs.launch(run, job)

    await eventually(lambda: len(calls.pushed) == 1, timeout=10)
    assert run.task is not None
    run.task.cancel()
    await asyncio.wait([run.task])

    (worker, request), (pushed_to, kind, payload) = calls.dispatched[0], calls.pushed[0]
    assert (worker, pushed_to, kind) == ("w1", "w1", MODEL_KIND)
    bundle = bundles.from_payload(payload)
    assert request.spec.inference.model_bundle_sha256 == bundles.sha256_hex(bundle)
    assert bundles.unpack(bundle, bundles.sha256_hex(bundle), tmp_path / "out") == ["model/config.json"]
