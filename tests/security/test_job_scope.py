"""Jobs are scoped to their scheduler and their members (issue 16): a second scheduler holding a
lease on the same worker cannot dispatch under another's job id, and only a job's own members push
to it or pull its ``global`` state. Real gRPC with two schedulers' and three workers' certificates."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from hypha.errors import PermissionDeniedError, UnavailableError
from hypha.market.resources import ExecutorKind
from hypha.net.channel import secure_channel
from hypha.net.connector import PeerConnector
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.tensors.payload import encode_state
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hypha.worker.execution_state import ExecutionRecord, JobDispatch
from hypha.worker.job_scope import JobOwners
from hypha.worker.jobs_servicer import WorkerJobs, WorkerJobsMixin
from hypha.worker.tensor_frames import add_worker_servicer
from hypha.worker.transfer import TensorExchange, TransferSettings
from tests.conftest import Pki

JOB = "job-scoped"
SPEC = common_pb2.JobSpec(diloco=common_pb2.DilocoJobSpec(dataset="tiny"))
FAST = TransferSettings(backoff_base_s=0.01, backoff_cap_s=0.05, send_attempts=1)


class LiveJobs:
    """The job manager's bookkeeping only: dispatches become live executions, nothing is spawned."""

    def __init__(self) -> None:
        self.live: list[JobDispatch] = []

    async def dispatch(self, dispatch: JobDispatch) -> ExecutionRecord:
        self.live.append(dispatch)
        return ExecutionRecord(dispatch.job_id, f"{dispatch.job_id}-{len(self.live)}")

    def end(self, job_id: str) -> None:
        """Every execution of ``job_id`` ends (what the job manager's cleanup does)."""
        self.live = [d for d in self.live if d.job_id != job_id]

    def live_dispatches(self, job_id: str) -> list[JobDispatch]:
        return [d for d in self.live if d.job_id == job_id]

    def dispatched_by(self, job_id: str, executor: ExecutorKind) -> str | None:
        return next((d.scheduler_id for d in self.live if (d.job_id, d.executor) == (job_id, executor)), None)


class Worker(WorkerJobsMixin, worker_pb2_grpc.WorkerServicer):
    def __init__(self, jobs: WorkerJobs) -> None:
        self.jobs = jobs


@dataclass
class Cluster:
    server: NodeServer
    exchange: TensorExchange
    live: LiveJobs
    pki: Pki

    def dispatch(self, scheduler: TlsMaterial, executor: int, job_id: str = JOB, **fields: object) -> object:
        request = worker_pb2.DispatchJobRequest(
            job_id=job_id, lease_id="lease", executor=executor, spec=SPEC, **fields
        )
        return _call(scheduler, self.server.address, request)

    def sender(self, name: str) -> TensorExchange:
        tls = self.pki.issue("worker", name)
        return TensorExchange(PeerConnector(tls, None), FAST)


async def _call(tls: TlsMaterial, address: str, request: worker_pb2.DispatchJobRequest) -> object:
    async with secure_channel(tls, address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).DispatchJob(request, timeout=10)


@pytest.fixture
async def ps_worker(pki: Pki) -> AsyncIterator[Cluster]:
    """A worker whose leases every scheduler holds (so only the job scope can refuse)."""
    live, exchange = LiveJobs(), TensorExchange(None, FAST)
    jobs = WorkerJobs(live, exchange, lease_ok=lambda lease, scheduler: True)  # type: ignore[arg-type]
    server = NodeServer(
        pki.issue("worker", "scope-ps"),
        "127.0.0.1:0",
        [(add_worker_servicer, Worker(jobs), "hypha.v1.Worker")],
    )
    async with server:
        yield Cluster(server, exchange, live, pki)


async def test_a_second_scheduler_cannot_dispatch_under_another_schedulers_job_id(
    pki: Pki, ps_worker: Cluster
) -> None:
    first, second = pki.issue("scheduler", "scope-s1"), pki.issue("scheduler", "scope-s2")
    await ps_worker.dispatch(first, common_pb2.EXECUTOR_KIND_PARAMETER_SERVER, trainer_ids=["t"])

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ps_worker.dispatch(second, common_pb2.EXECUTOR_KIND_DILOCO_TRAINER, parameter_server_id="p")
    # The same scheduler (a trainer beside its server) and another job id are still fine.
    await ps_worker.dispatch(first, common_pb2.EXECUTOR_KIND_DILOCO_TRAINER, parameter_server_id="p")
    await ps_worker.dispatch(
        second, common_pb2.EXECUTOR_KIND_DILOCO_TRAINER, "job-other", parameter_server_id="p"
    )

    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "another scheduler" in (refused.value.details() or "")
    assert {d.scheduler_id for d in ps_worker.live.live_dispatches(JOB)} == {first.identity.peer_id}


@pytest.mark.timeout(60)
async def test_a_job_id_stays_its_schedulers_after_the_job_ended(pki: Pki, ps_worker: Cluster) -> None:
    # Prepare: scheduler 1's job ran here and ended (its result, status and logs stay under its id).
    first, second = pki.issue("scheduler", "ended-s1"), pki.issue("scheduler", "ended-s2")
    await ps_worker.dispatch(first, common_pb2.EXECUTOR_KIND_PARAMETER_SERVER, trainer_ids=["t"])
    ps_worker.live.end(JOB)

    # Execute: another scheduler takes up the ended job's id; its owner dispatches it again.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ps_worker.dispatch(second, common_pb2.EXECUTOR_KIND_PARAMETER_SERVER, trainer_ids=["t"])
    await ps_worker.dispatch(first, common_pb2.EXECUTOR_KIND_PARAMETER_SERVER, trainer_ids=["t"])

    # Assert
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "another scheduler" in (refused.value.details() or "")
    assert [d.scheduler_id for d in ps_worker.live.live_dispatches(JOB)] == [first.identity.peer_id]


@pytest.mark.timeout(60)
def test_remembered_job_owners_are_bounded_and_live_jobs_stay_held() -> None:
    # Prepare: room for two ended jobs' owners.
    owners = JobOwners(max_entries=2)
    for job in ("a", "b", "c"):
        owners.claim(job, "s1", [])
    request = worker_pb2.DispatchJobRequest(
        job_id="a", executor=common_pb2.EXECUTOR_KIND_PARAMETER_SERVER, trainer_ids=["t"], spec=SPEC
    )
    live_a = [JobDispatch.from_proto(request, "s1")]

    # Execute / Assert: "b" and "c" are still s1's; "a", the least recent, was forgotten, so only
    # its live execution holds it.
    assert len(owners) == 2
    for job in ("b", "c"):
        with pytest.raises(PermissionDeniedError):
            owners.claim(job, "s2", [])
        owners.claim(job, "s1", [])
    with pytest.raises(PermissionDeniedError):
        owners.claim("a", "s2", live_a)
    owners.claim("a", "s2", [])


async def test_only_the_jobs_members_push_to_it_and_pull_its_global_state(
    pki: Pki, ps_worker: Cluster, tmp_path: Path
) -> None:
    # Prepare: scheduler 1's parameter server for JOB, with one trainer; it has published `global`.
    member, stranger = ps_worker.sender("scope-member"), ps_worker.sender("scope-stranger")
    member_id = member.connector._tls.identity.peer_id  # type: ignore[union-attr]
    await ps_worker.dispatch(
        pki.issue("scheduler", "scope-owner"),
        common_pb2.EXECUTOR_KIND_PARAMETER_SERVER,
        trainer_ids=[member_id],
    )
    ps_worker.exchange.open_job(JOB)
    state = tmp_path / "global.safetensors"
    state.write_bytes(encode_state({"w": torch.arange(8.0)}))
    await ps_worker.exchange.publish(JOB, "global", 1, state)
    ps_id, address = ps_worker.server.tls.identity.peer_id, [ps_worker.server.address]

    try:
        # Execute
        pulled = await member.fetch(JOB, ps_id, address, "global", 1, timeout_s=10)
        with pytest.raises(UnavailableError, match="PERMISSION_DENIED") as pull_refused:
            await stranger.fetch(JOB, ps_id, address, "global", 1, timeout_s=10)
        pushed = await member.send(JOB, ps_id, address, "delta", 1, 8, state)
        stranger_pushed = await stranger.send(JOB, ps_id, address, "delta", 1, 8, state)
        queued = await ps_worker.exchange.next_received(JOB, "delta", timeout_s=5)
        nothing_more = await ps_worker.exchange.next_received(JOB, "delta", timeout_s=0.2)
    finally:
        for exchange in (member, stranger):
            await exchange.connector.close()  # type: ignore[union-attr]

    # Assert
    assert pulled is not None and pulled.read() == state.read_bytes()
    assert "not a member" in pull_refused.value.message
    assert pushed[0] is True
    assert stranger_pushed[0] is False and "PERMISSION_DENIED" in stranger_pushed[1]
    assert queued is not None and queued.from_peer == member_id and nothing_more is None
