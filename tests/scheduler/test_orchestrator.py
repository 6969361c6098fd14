"""Orchestration edges that need no cluster: who may report on a job, and how a job is traced.

The whole path (market, dispatch, executors, rounds, replacement) runs in
``tests/e2e``; these pin the rules a real cluster rarely exercises.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hypha.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.control_servicer import SchedulerControlServicer
from hypha.scheduler.diloco import elastic
from hypha.scheduler.diloco import run as diloco_run
from hypha.scheduler.diloco.link_fit import link_fit_for
from hypha.scheduler.diloco.round_planner import round_planners
from hypha.scheduler.diloco.run import DilocoRun
from hypha.scheduler.diloco.state import Trainer
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.orchestrator import Orchestrator
from hypha.scheduler.store import JobStore
from hypha.v1 import common_pb2, scheduler_pb2
from tests.conftest import Pki
from tests.helpers import eventually

TASK = common_pb2.JobSpec(name="t", task=common_pb2.TaskJobSpec(command="true"))


async def aiter(items: Iterator[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class _Market:
    """Just enough of SchedulerMarket for an orchestrator that is never started."""

    peer_id = "scheduler"
    connector = None

    def leases(self) -> list[Any]:
        return []

    def worker_addresses(self, worker_id: str) -> tuple[str, ...]:
        return ()


@pytest.fixture
async def store() -> AsyncIterator[JobStore]:
    job_store = await JobStore.open(":memory:")
    yield job_store
    await job_store.close()


@pytest.fixture
def orchestrator(store: JobStore, tmp_path: Path) -> Orchestrator:
    return Orchestrator(
        _Market(),  # type: ignore[arg-type]
        store,
        SchedulerSection(),
        tmp_path,
        planners=round_planners(),
    )


async def finished_job(store: JobStore, worker: str) -> str:
    job = await store.create(TASK)
    await store.transition(job.job_id, JobState.ALLOCATING)
    await store.transition(job.job_id, JobState.RUNNING, workers=[worker], attempt=1)
    await store.transition(job.job_id, JobState.SUCCEEDED)
    return job.job_id


async def test_late_reports_of_a_finished_job_are_acknowledged_only_from_its_workers(
    orchestrator: Orchestrator, store: JobStore
) -> None:
    job_id = await finished_job(store, "w1")
    status = scheduler_pb2.JobStatusReport(job_id=job_id, state=scheduler_pb2.EXECUTION_STATE_REPORT_FAILED)

    await orchestrator.report_job_status("w1", status)
    directive = await orchestrator.report_progress("w1", scheduler_pb2.ProgressReport(job_id=job_id, round=2))
    await orchestrator.append_logs("w1", [scheduler_pb2.LogLine(job_id=job_id, line="late", stream="stdout")])

    assert directive.kind == scheduler_pb2.DIRECTIVE_KIND_DONE
    assert (await store.get(job_id)).state is JobState.SUCCEEDED
    assert [r.line for r in await store.logs(job_id)] == ["late"]
    with pytest.raises(PermissionDeniedError):
        await orchestrator.report_job_status("stranger", status)
    with pytest.raises(PermissionDeniedError):
        await orchestrator.append_logs("stranger", [scheduler_pb2.LogLine(job_id=job_id, line="forged")])
    with pytest.raises(NotFoundError):
        await orchestrator.report_metrics("w1", scheduler_pb2.MetricsReport(job_id="nope", round=0))


async def test_reports_on_an_active_job_no_run_drives_yet_ask_the_worker_to_try_again(
    orchestrator: Orchestrator, store: JobStore
) -> None:
    # Prepare: a running job in the store that this (just started) scheduler does not drive yet,
    # as after a restart before the job is resumed.
    job = await store.create(TASK)
    await store.transition(job.job_id, JobState.ALLOCATING)
    await store.transition(job.job_id, JobState.RUNNING, workers=["w1"], attempt=1)
    report = scheduler_pb2.ProgressReport(job_id=job.job_id, round=2)

    # Execute / Assert: not DONE (that would stop its trainer), but UNAVAILABLE: try again.
    with pytest.raises(UnavailableError):
        await orchestrator.report_progress("w1", report)
    with pytest.raises(UnavailableError):
        await orchestrator.append_logs("w1", [scheduler_pb2.LogLine(job_id=job.job_id, line="x")])
    assert (await store.get(job.job_id)).state is JobState.RUNNING


class _Context:
    """A servicer context whose caller the relay stamped (what ``peer_identity`` reads first)."""

    def __init__(self, identity: Any) -> None:
        self.relay_identity = identity


class _Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, scheduler_pb2.LogLine]] = []

    async def append_logs(self, worker_id: str, lines: list[scheduler_pb2.LogLine]) -> None:
        self.lines += [(worker_id, line) for line in lines]


async def test_log_lines_are_attributed_to_the_authenticated_caller_whatever_they_claim(pki: Pki) -> None:
    worker = pki.tls("worker").identity
    jobs = _Recorder()
    servicer = SchedulerControlServicer(None, jobs)  # type: ignore[arg-type]
    lines = [
        scheduler_pb2.LogLine(
            job_id="j", line=f"l{i}", worker_id="someone-else", worker_name="fake", executor="task"
        )
        for i in range(3)
    ]

    ack = await servicer.AppendLogs(aiter(iter(lines)), _Context(worker))

    assert ack.lines == 3
    assert {(who, line.worker_id) for who, line in jobs.lines} == {(worker.peer_id, worker.peer_id)}
    # The name comes from the certificate too; the executor kind is the worker's to say.
    assert {(line.worker_name, line.executor) for _, line in jobs.lines} == {(worker.name, "task")}


async def test_a_job_is_traced_as_one_span(orchestrator: Orchestrator, store: JobStore) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    job = await store.create(TASK)

    await orchestrator.submit(job)  # this market cannot allocate: the job fails
    await eventually(lambda: any(s.name == "hypha.job" for s in exporter.get_finished_spans()), timeout=10)

    (span,) = [s for s in exporter.get_finished_spans() if s.name == "hypha.job"]
    assert span.attributes is not None
    assert span.attributes["hypha.job_id"] == job.job_id
    assert span.attributes["hypha.job_kind"] == "task"


# ---- scaling (``ScaleJob``; ``hypha.scheduler.diloco.elastic``) ---------------------------------------

DILOCO = common_pb2.JobSpec(
    name="d", diloco=common_pb2.DilocoJobSpec(dataset="d", rounds=4, samples_per_round=64, num_workers=2)
)


async def test_scaling_refuses_unknown_non_diloco_and_not_running_jobs(
    orchestrator: Orchestrator, store: JobStore
) -> None:
    with pytest.raises(NotFoundError):
        await orchestrator.scale("no-such-job", 2)
    task = await store.create(TASK)
    with pytest.raises(FailedPreconditionError, match="only DiLoCo jobs scale"):
        await orchestrator.scale(task.job_id, 2)
    pending = await store.create(DILOCO)
    with pytest.raises(FailedPreconditionError, match="only a running job scales"):
        await orchestrator.scale(pending.job_id, 3)


async def test_a_scale_target_must_be_a_positive_count_within_the_cap_on_a_started_run(
    orchestrator: Orchestrator, store: JobStore, tmp_path: Path
) -> None:
    job = await store.create(DILOCO)
    run = DilocoRun(job, orchestrator.runs, round_planners(), None, tmp_path)
    for bad in (0, -1, elastic.MAX_WORKERS + 1):
        with pytest.raises(InvalidArgumentError):
            elastic.check_target(run, bad)
    with pytest.raises(FailedPreconditionError, match="not running yet"):
        elastic.check_target(run, 3)  # no parameter server runs yet
    run.state.planner, run.state.ps_started = round_planners()(DILOCO.diloco), True
    elastic.check_target(run, elastic.MAX_WORKERS)
    assert run.state.target_workers == 2  # checking sets nothing


async def test_a_job_fitted_to_its_link_plans_larger_rounds_once_its_trainers_wait_on_the_link(
    store: JobStore, orchestrator: Orchestrator, tmp_path: Path
) -> None:
    # Prepare: a running job whose rounds may grow to 4x; its planner and two trainers.
    spec = common_pb2.JobSpec()
    spec.CopyFrom(DILOCO)
    spec.diloco.max_samples_per_round = 256
    job = await store.create(spec)
    run = DilocoRun(job, orchestrator.runs, round_planners(), None, tmp_path)
    run.state.planner = round_planners()(spec.diloco)
    run.state.link_fit = link_fit_for(spec.diloco)
    for worker in ("w1", "w2"):
        run.state.trainers[worker] = Trainer(worker, None, 8, 0, 0)  # type: ignore[arg-type]

    # Execute: each trainer reports two rounds of 32 samples in 0.32 s, waiting 0.1 s after each.
    for round_ in (0, 1):
        for worker in ("w1", "w2"):
            values = {"samples": 32.0, "samples_per_second": 100.0, "sync_idle_seconds": 0.1}
            await run.on_metrics(worker, round_, values)

    # Assert: a 31 % wait asks for rounds 6x longer; the job's ceiling bounds them.
    assert run.state.planner.samples_per_round == 256


# ---- a job resumed after a restart (``hypha.scheduler.diloco.resume``) -----------------------


async def test_reports_on_a_job_being_resumed_ask_its_workers_not_yet_back_to_try_again(
    orchestrator: Orchestrator, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a DiLoCo job the store hands back after a restart, whose saved run is rebuilt one
    # lease at a time: w1's is taken back at once, w2's not yet (the rebuild waits on ``go``).
    job = await store.create(DILOCO)
    job = await store.transition(job.job_id, JobState.ALLOCATING, reason="resuming from round 1")
    await store.save_run_state(job.job_id, {"version": 1})
    go, rebuilt = asyncio.Event(), asyncio.Event()

    async def rebuild(run: DilocoRun, saved: dict[str, Any]) -> None:
        run.participants.add("w1")
        await go.wait()
        rebuilt.set()

    async def save(run: DilocoRun) -> None:
        pass  # nothing real was rebuilt to save

    monkeypatch.setattr(diloco_run, "resume", rebuild)
    monkeypatch.setattr(DilocoRun, "save", save)
    orchestrator._launch(job)  # what ``start`` does with each job the store hands back
    run = orchestrator.runs.get(job.job_id)
    assert isinstance(run, DilocoRun) and run.resuming
    report = scheduler_pb2.ProgressReport(job_id=job.job_id, round=1)
    try:
        # Execute / Assert: before the rebuild even began, w1 is asked to try again; then w1, back,
        # trains on (CONTINUE), and w2, not back yet, is asked to try again: refusing either would
        # fail a trainer that never left.
        with pytest.raises(UnavailableError, match="being resumed"):
            await orchestrator.report_progress("w1", report)
        await eventually(lambda: "w1" in run.participants, timeout=10)
        directive = await orchestrator.report_progress("w1", report)
        assert directive.kind == scheduler_pb2.DIRECTIVE_KIND_CONTINUE
        with pytest.raises(UnavailableError, match="being resumed"):
            await orchestrator.report_progress("w2", report)
        with pytest.raises(UnavailableError):
            await orchestrator.next_slice("w2", scheduler_pb2.NextSliceRequest(job_id=job.job_id))

        # Once the run is rebuilt without w2, w2 is a stranger to it.
        go.set()
        await asyncio.wait_for(rebuilt.wait(), 10)
        await eventually(lambda: not run.resuming, timeout=10)
        with pytest.raises(PermissionDeniedError):
            await orchestrator.report_progress("w2", report)
    finally:
        assert run.task is not None
        run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)
