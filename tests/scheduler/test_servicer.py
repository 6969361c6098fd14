"""The client API over a real server with real mutual TLS, on a fake orchestrator."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from hypha.errors import (
    FailedPreconditionError,
    HyphaError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.metrics import SchedulerMetrics
from hypha.scheduler.servicer import SchedulerServicer
from hypha.scheduler.store import JobRecord, JobStore, LogEntry, WorkerMetric
from hypha.tensors.chunks import ChunkAssembler
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import Pki

TASK_TOML = '[job]\nname = "hello"\ncommand = "echo"\nargs = ["hi"]\n'
DILOCO_TOML = '[job]\ndataset = "d"\nrounds = 4\n[job.model]\nrepository = "a/b"\ntoken = "hf_secret"\n'


@dataclass
class FakeOrchestrator:
    """Records what the API asks of orchestration; the tests move jobs through the store.

    It refuses what the real ``Orchestrator`` refuses (``test_api_contract.py`` runs the
    same tests on both): only an allocating or running DiLoCo job scales.
    """

    result_dir: Path
    store: JobStore
    submitted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    scaled: list[tuple[str, int]] = field(default_factory=list)
    refuse: HyphaError | None = None
    views: list[scheduler_pb2.WorkerView] = field(
        default_factory=lambda: [
            scheduler_pb2.WorkerView(
                peer=common_pb2.PeerInfo(peer_id="worker-1", role=common_pb2.ROLE_WORKER),
                capacity=common_pb2.Resources(cpu=4, memory_gb=8),
                healthy=True,
                job_id="job-9",
                samples_per_second=12.5,
            )
        ]
    )

    async def admit(self, spec: common_pb2.JobSpec) -> None:
        if spec.diloco.dataset == "missing":
            raise NotFoundError("dataset 'missing' not found: no data node announces it in the DHT")

    async def submit(self, job: JobRecord) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(job.job_id)

    async def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)

    async def scale(self, job_id: str, workers: int) -> None:
        job = await self.store.get(job_id)
        if job.kind != "diloco":
            raise FailedPreconditionError(f"job {job_id} is a {job.kind} job: only DiLoCo jobs scale")
        if job.state not in (JobState.RUNNING, JobState.ALLOCATING):
            raise FailedPreconditionError(f"job {job_id} is {job.state.value}: only a running job scales")
        self.scaled.append((job_id, workers))

    async def list_workers(self) -> list[scheduler_pb2.WorkerView]:
        return list(self.views)

    async def fetch_result(self, job_id: str) -> Path:
        return self.result_dir


@dataclass
class Served:
    store: JobStore
    orchestrator: FakeOrchestrator
    api: SchedulerServicer
    metrics: SchedulerMetrics
    server: NodeServer

    @property
    def address(self) -> str:
        return self.server.address


@contextlib.asynccontextmanager
async def serve_api(pki: Pki, tmp_path: Path) -> AsyncIterator[Served]:
    """A scheduler's client API on 127.0.0.1:0 over mTLS, backed by a real store."""
    store = await JobStore.open(tmp_path / "scheduler.db")
    orchestrator = FakeOrchestrator(tmp_path / "result", store)
    metrics = SchedulerMetrics()
    metrics.watch_store(store.counts)
    api = SchedulerServicer(store, orchestrator, metrics=metrics)
    server = NodeServer(
        pki.tls("scheduler"),
        "127.0.0.1:0",
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, api, "hypha.v1.Scheduler")],
    )
    await server.start()
    try:
        yield Served(store, orchestrator, api, metrics, server)
    finally:
        await server.stop(0)
        await store.close()


@contextlib.asynccontextmanager
async def client(tls: TlsMaterial, address: str) -> AsyncIterator[scheduler_pb2_grpc.SchedulerStub]:
    async with secure_channel(tls, address) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


@pytest.fixture
async def served(pki: Pki, tmp_path: Path) -> AsyncIterator[Served]:
    async with serve_api(pki, tmp_path) as s:
        yield s


@pytest.fixture(scope="module")
def other_client(pki: Pki) -> TlsMaterial:
    return pki.issue("client", "api-other-client")


async def _submit(stub: scheduler_pb2_grpc.SchedulerStub, toml: str = TASK_TOML) -> scheduler_pb2.Job:
    return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(toml=toml), timeout=5)


async def test_submitted_jobs_are_pending_owned_by_the_certificate_and_listed(
    served: Served, pki: Pki
) -> None:
    client_tls = pki.tls("client")
    async with client(client_tls, served.address) as stub:
        job = await _submit(stub)
        assert job.state == common_pb2.JOB_STATE_PENDING and job.spec.task.command == "echo"
        assert job.submitted_by == client_tls.identity.peer_id
        assert served.orchestrator.submitted == [job.job_id]
        got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
        assert got == job
        await served.store.transition(job.job_id, JobState.ALLOCATING)
        other = await _submit(stub, DILOCO_TOML)
        pending = await stub.ListJobs(
            scheduler_pb2.ListJobsRequest(states=[common_pb2.JOB_STATE_PENDING]), timeout=5
        )
        assert [j.job_id for j in pending.jobs] == [other.job_id]
        everything = await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5)
        assert [j.job_id for j in everything.jobs] == [job.job_id, other.job_id]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_malformed_job_file_is_refused_naming_the_key(served: Served, pki: Pki) -> None:
    async with client(pki.tls("client"), served.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _submit(stub, DILOCO_TOML.replace("rounds = 4", "rounds = -1"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("job.rounds: must not be negative")
    assert await served.store.list_jobs() == []


async def test_structured_specs_get_defaults_and_secrets_never_leave(served: Served, pki: Pki) -> None:
    spec = common_pb2.JobSpec(
        diloco=common_pb2.DilocoJobSpec(
            model=common_pb2.ModelSpec(repository="a/b", token="hf_x"), dataset="d"
        )
    )
    async with client(pki.tls("client"), served.address) as stub:
        job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=5)
    assert job.spec.diloco.rounds == 10 and job.rounds == 10
    assert job.spec.diloco.model.token == "***"
    stored = await served.store.get(job.job_id)
    assert stored.spec.diloco.model.token == "hf_x"  # the workers still get it


ENV_TASK_TOML = TASK_TOML + 'env = { API_KEY = "sk-live-123", SEED = "7" }\n'


def _env(job: scheduler_pb2.Job) -> dict[str, str]:
    return dict(job.spec.task.env)


async def test_task_env_values_are_shown_only_to_the_submitter_and_admins(
    served: Served, pki: Pki, other_client: TlsMaterial
) -> None:
    # Every client may list every job, and a task's env is where its author puts an API key:
    # another client sees which keys are set, never their values (GetJob, ListJobs, WatchJob).
    secret = {"API_KEY": "sk-live-123", "SEED": "7"}
    hidden = {"API_KEY": "***", "SEED": "***"}
    async with (
        client(pki.tls("client"), served.address) as mine,
        client(other_client, served.address) as theirs,
        client(pki.tls("admin"), served.address) as admin,
    ):
        job = await _submit(mine, ENV_TASK_TOML)
        assert _env(job) == secret
        views = {"submitter": mine, "admin": admin, "other client": theirs}
        watches = {
            who: aiter(stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job.job_id)))
            for who, stub in views.items()
        }
        firsts = {who: await asyncio.wait_for(anext(events), 5) for who, events in watches.items()}
        await served.store.transition(job.job_id, JobState.CANCELLED, reason="done")
        lasts = {who: [e async for e in events][-1] for who, events in watches.items()}

        for who, stub in views.items():
            expected = hidden if who == "other client" else secret
            got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
            (listed,) = (await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5)).jobs
            assert _env(got) == _env(listed) == expected, who
            assert _env(firsts[who].job) == _env(lasts[who].job) == expected, who
            assert lasts[who].job.state == common_pb2.JOB_STATE_CANCELLED
    stored = await served.store.get(job.job_id)
    assert dict(stored.spec.task.env) == secret  # the workers still get the values


async def test_a_job_orchestration_refuses_is_recorded_as_failed(served: Served, pki: Pki) -> None:
    served.orchestrator.refuse = ResourceExhaustedError("task queue full")
    async with client(pki.tls("client"), served.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _submit(stub)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (job,) = await served.store.list_jobs()
    assert job.state is JobState.FAILED and job.reason == "refused: task queue full"


async def test_cancel_is_for_the_submitter_or_an_admin_and_all_means_your_own(
    served: Served, pki: Pki, other_client: TlsMaterial
) -> None:
    async with (
        client(pki.tls("client"), served.address) as mine,
        client(other_client, served.address) as theirs,
        client(pki.tls("admin"), served.address) as admin,
    ):
        a, b = await _submit(mine), await _submit(mine)
        c = await _submit(theirs)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await theirs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.job_id), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        done = await mine.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.job_id), timeout=5)
        assert list(done.cancelled) == [a.job_id] and served.orchestrator.cancelled == [a.job_id]
        job = await mine.GetJob(scheduler_pb2.GetJobRequest(job_id=a.job_id), timeout=5)
        assert job.state == common_pb2.JOB_STATE_CANCELLED and job.reason == "cancelled by client"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await mine.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.job_id), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        everything = await theirs.CancelJob(scheduler_pb2.CancelJobRequest(all=True), timeout=5)
        assert list(everything.cancelled) == [c.job_id]
        by_admin = await admin.CancelJob(scheduler_pb2.CancelJobRequest(job_id=b.job_id), timeout=5)
        assert list(by_admin.cancelled) == [b.job_id]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await mine.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.job_id, all=True), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_scale_is_for_the_submitter_or_an_admin_with_a_positive_count(
    served: Served, pki: Pki, other_client: TlsMaterial
) -> None:
    async with (
        client(pki.tls("client"), served.address) as mine,
        client(other_client, served.address) as theirs,
        client(pki.tls("admin"), served.address) as admin,
    ):
        job = await _submit(mine, DILOCO_TOML)
        refused = [
            (theirs, job.job_id, 3, grpc.StatusCode.PERMISSION_DENIED),
            (mine, job.job_id, 0, grpc.StatusCode.INVALID_ARGUMENT),
            (mine, "", 3, grpc.StatusCode.INVALID_ARGUMENT),
            (mine, "no-such-job", 3, grpc.StatusCode.NOT_FOUND),
        ]
        for stub, job_id, workers, code in refused:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ScaleJob(scheduler_pb2.ScaleJobRequest(job_id=job_id, workers=workers), timeout=5)
            assert info.value.code() == code, (job_id, workers, info.value.details())
        assert served.orchestrator.scaled == []
        await served.store.transition(job.job_id, JobState.ALLOCATING)
        got = await mine.ScaleJob(scheduler_pb2.ScaleJobRequest(job_id=job.job_id, workers=3), timeout=5)
        await admin.ScaleJob(scheduler_pb2.ScaleJobRequest(job_id=job.job_id, workers=1), timeout=5)
        assert got.job_id == job.job_id
        assert served.orchestrator.scaled == [(job.job_id, 3), (job.job_id, 1)]


async def test_watch_streams_state_round_loss_and_worker_throughput_until_the_end(
    served: Served, pki: Pki
) -> None:
    async with client(pki.tls("client"), served.address) as stub:
        job = await _submit(stub, DILOCO_TOML)
        stream = stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job.job_id))
        events = aiter(stream)
        first = await asyncio.wait_for(anext(events), 5)
        assert first.job.state == common_pb2.JOB_STATE_PENDING

        # Execute: orchestration moves the job along.
        store = served.store
        await store.transition(job.job_id, JobState.ALLOCATING, reason="leasing 1 trainer")
        await store.transition(job.job_id, JobState.RUNNING, workers=["w1"], reason="dispatched")
        metrics = [WorkerMetric("w1", 41.5, 512, 2.25, 16)]
        await store.update(job.job_id, round=1, loss=2.25, worker_metrics=metrics, message="round 0 complete")
        await store.transition(job.job_id, JobState.SUCCEEDED, reason="all rounds done")
        rest = [event async for event in events]

    # Assert
    assert [(e.job.state, e.message) for e in rest] == [
        (common_pb2.JOB_STATE_ALLOCATING, "leasing 1 trainer"),
        (common_pb2.JOB_STATE_RUNNING, "dispatched"),
        (common_pb2.JOB_STATE_RUNNING, "round 0 complete"),
        (common_pb2.JOB_STATE_SUCCEEDED, "all rounds done"),
    ]
    progress = rest[2]
    assert (progress.job.round, progress.job.loss, progress.job.rounds) == (1, 2.25, 4)
    assert [(w.worker_id, w.samples_per_second, w.samples) for w in progress.workers] == [("w1", 41.5, 512)]
    assert rest[-1].job.workers == ["w1"]


async def test_job_metrics_are_every_reported_figure_in_round_order(served: Served, pki: Pki) -> None:
    async with client(pki.tls("client"), served.address) as stub:
        job = await _submit(stub, DILOCO_TOML)
        await served.store.record_metrics(job.job_id, 1, {"loss": 1.5, "tensor_bytes_pushed": 4096.0}, "w1")
        await served.store.record_metrics(job.job_id, 0, {"loss": 2.5}, "w2")

        got = await stub.GetJobMetrics(scheduler_pb2.GetJobMetricsRequest(job_id=job.job_id), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetJobMetrics(scheduler_pb2.GetJobMetricsRequest(job_id="nope"), timeout=5)

    assert [(p.round, p.worker_id, p.name, p.value) for p in got.points] == [
        (0, "w2", "loss", 2.5),
        (1, "w1", "loss", 1.5),
        (1, "w1", "tensor_bytes_pushed", 4096.0),
    ]
    assert all(p.at.seconds > 0 for p in got.points)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watching_a_finished_job_shows_it_once(served: Served, pki: Pki) -> None:
    async with client(pki.tls("client"), served.address) as stub:
        job = await _submit(stub)
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)
        events = [e async for e in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job.job_id), timeout=5)]
    assert [e.job.state for e in events] == [common_pb2.JOB_STATE_CANCELLED]


async def test_logs_are_read_back_and_followed_until_the_job_ends(served: Served, pki: Pki) -> None:
    async with client(pki.tls("client"), served.address) as stub:
        job = await _submit(stub)
        store = served.store
        await store.transition(job.job_id, JobState.ALLOCATING)
        await store.transition(job.job_id, JobState.RUNNING, attempt=1)
        await store.append_logs(
            job.job_id, [LogEntry(f"line {i}", worker_id="w1", attempt=1) for i in range(3)]
        )
        kept = [
            line async for line in stub.GetLogs(scheduler_pb2.GetLogsRequest(job_id=job.job_id), timeout=5)
        ]
        assert [(line.line, line.worker_id, line.attempt) for line in kept] == [
            (f"line {i}", "w1", 1) for i in range(3)
        ]

        follow = aiter(stub.GetLogs(scheduler_pb2.GetLogsRequest(job_id=job.job_id, follow=True)))
        seen = [(await asyncio.wait_for(anext(follow), 5)).line for _ in range(3)]
        await store.append_logs(job.job_id, [LogEntry("boom", stream="stderr")])
        seen.append((await asyncio.wait_for(anext(follow), 5)).line)
        await store.transition(job.job_id, JobState.FAILED, exit_code=1)
        seen += [line.line async for line in follow]
    assert seen == ["line 0", "line 1", "line 2", "boom"]


async def test_fetch_streams_each_file_in_bounded_chunks_with_its_checksum(served: Served, pki: Pki) -> None:
    # Prepare: a result with a multi-chunk file, a small one and an empty one.
    result = served.orchestrator.result_dir
    (result / "sub").mkdir(parents=True)
    files = {
        "model.safetensors": os.urandom(2 * 1024 * 1024 + 12345),
        "config.json": b'{"model_type": "gpt2"}',
        "sub/empty.txt": b"",
    }
    for name, data in files.items():
        (result / name).write_bytes(data)
    async with client(pki.tls("client"), served.address) as stub:
        job = await _submit(stub)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=job.job_id))]
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for state in (JobState.ALLOCATING, JobState.RUNNING, JobState.SUCCEEDED):
            await served.store.transition(job.job_id, state)

        # Execute
        received: dict[str, ChunkAssembler] = {}
        current = ""
        async for item in stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=job.job_id), timeout=10):
            assert len(item.chunk.data) <= 1024 * 1024
            if item.path:
                current = item.path
                received[current] = ChunkAssembler(max_bytes=1 << 30)
            received[current].feed(item.chunk)

    # Assert: every file whole and verified (the assembler checks the sha256).
    assert sorted(received) == sorted(files)
    assert {name: a.finish() for name, a in received.items()} == files
    assert received["model.safetensors"].content_type == "application/safetensors"
    assert served.metrics.value("hypha_scheduler_bytes_moved_total", kind="result") == sum(
        len(d) for d in files.values()
    )


async def test_list_workers_comes_from_orchestration(served: Served, pki: Pki) -> None:
    async with client(pki.tls("admin"), served.address) as stub:
        response = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
    assert list(response.workers) == served.orchestrator.views


async def test_unauthenticated_foreign_and_wrong_role_callers_are_refused(
    served: Served, pki: Pki, foreign_pki: Pki
) -> None:
    request = scheduler_pb2.ListJobsRequest()
    anonymous = grpc.ssl_channel_credentials(root_certificates=pki.tls("client").trust_pem)
    async with grpc.aio.secure_channel(served.address, anonymous) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await scheduler_pb2_grpc.SchedulerStub(channel).ListJobs(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    async with client(foreign_pki.tls("client"), served.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    for role in ("worker", "scheduler", "gateway"):
        async with client(pki.tls(role), served.address) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(toml=TASK_TOML), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The API checks again itself, for transports without the gRPC guard (REST).
    with pytest.raises(PermissionDeniedError):
        await served.api.list_jobs(pki.tls("worker").identity)
    assert await served.store.list_jobs() == []


async def test_a_job_the_driver_refuses_at_admission_is_never_stored(served: Served, pki: Pki) -> None:
    toml = DILOCO_TOML.replace('dataset = "d"', 'dataset = "missing"')
    async with client(pki.tls("client"), served.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _submit(stub, toml)

    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "dataset 'missing' not found" in (refused.value.details() or "")
    assert await served.store.list_jobs() == []
    assert served.orchestrator.submitted == []
