"""Orchestration edges that need no cluster: who may report on a job, results pulled intact.

The whole path (market, dispatch, executors, rounds, replacement) runs in
``tests/e2e``; these pin the rules a real cluster rarely exercises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hypha.errors import DataLossError, NotFoundError, PermissionDeniedError
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.control import SchedulerControlServicer
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.orchestrator import Orchestrator, _attempt_end, _write_files
from hypha.scheduler.store import JobStore
from hypha.scheduler.tasks import Outcome
from hypha.tensors.chunks import split_payload
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2
from tests.conftest import Pki
from tests.helpers import eventually

TASK = common_pb2.JobSpec(name="t", task=common_pb2.TaskJobSpec(command="true"))


def result_stream(files: dict[str, bytes], *, corrupt: str = "") -> Iterator[worker_pb2.TensorChunk]:
    for name, data in files.items():
        for chunk in split_payload(data, chunk_size=4, metadata={"path": name}):
            if name == corrupt and chunk.last:
                chunk.sha256 = "0" * 64
            yield worker_pb2.TensorChunk(job_id="j", kind="result", chunk=chunk)


async def aiter(items: Iterator[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def test_result_files_are_written_only_when_their_checksum_matches(tmp_path: Path) -> None:
    files = {"config.json": b'{"a": 1}', "model.safetensors": b"0123456789abcdef"}

    written = await _write_files(aiter(result_stream(files)), tmp_path / "ok")

    assert {p.name: p.read_bytes() for p in written} == files
    with pytest.raises(DataLossError):
        await _write_files(aiter(result_stream(files, corrupt="model.safetensors")), tmp_path / "bad")
    assert not (tmp_path / "bad" / "model.safetensors").exists()


async def test_a_result_file_may_not_escape_the_result_dir(tmp_path: Path) -> None:
    with pytest.raises(PermissionDeniedError):
        await _write_files(aiter(result_stream({"../evil": b"x"})), tmp_path / "r")
    assert not (tmp_path / "evil").exists()


def test_a_cancel_the_worker_made_itself_counts_as_a_lost_worker() -> None:
    cancelled = _attempt_end(scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED, 0, "lease ended")
    nonzero = _attempt_end(scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED, 2, "")

    assert cancelled[0] is Outcome.WORKER_LOST
    assert nonzero[0] is Outcome.FAILED


class _Market:
    """Just enough of SchedulerMarket for an orchestrator that is never started."""

    peer_id = "scheduler"

    def leases(self) -> list[Any]:
        return []


@pytest.fixture
async def store() -> AsyncIterator[JobStore]:
    job_store = await JobStore.open(":memory:")
    yield job_store
    await job_store.close()


@pytest.fixture
def orchestrator(store: JobStore, tmp_path: Path) -> Orchestrator:
    return Orchestrator(_Market(), store, SchedulerSection(), tmp_path)  # type: ignore[arg-type]


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
    lines = [scheduler_pb2.LogLine(job_id="j", line=f"l{i}", worker_id="someone-else") for i in range(3)]

    ack = await servicer.AppendLogs(aiter(iter(lines)), _Context(worker))

    assert ack.lines == 3
    assert {(who, line.worker_id) for who, line in jobs.lines} == {(worker.peer_id, worker.peer_id)}


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
