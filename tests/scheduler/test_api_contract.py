"""Contract suite: the client API over the fake orchestrator and over the real one, same tests.

``tests/scheduler/test_servicer.py`` drives the Scheduler gRPC API over
``FakeOrchestrator``; these tests run over both it and the real
``Orchestrator``, wired as ``hypha.scheduler.app`` wires it: a market linked
to a real gateway that no worker joins (so jobs stay pending or allocating),
the round planners, the metrics. Each runs behind a real server with real mTLS.
What the API answers must not depend on which one is behind it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from hypha.market.policies import OfferView
from hypha.market.resources import Resources
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.diloco.round_planner import round_planners
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.market import SchedulerMarket
from hypha.scheduler.metrics import SchedulerMetrics
from hypha.scheduler.orchestrator import Orchestrator
from hypha.scheduler.servicer import SchedulerServicer
from hypha.scheduler.store import JobStore
from hypha.testing.mesh import Mesh
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import Pki
from tests.scheduler.test_servicer import DILOCO_TOML, TASK_TOML, FakeOrchestrator, client

pytestmark = pytest.mark.timeout(60)

SIDES = ("fake", "real")
ACTIVE = (common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_ALLOCATING)


@dataclass
class Api:
    """The API served over one orchestrator; ``know_worker`` makes a worker known to it."""

    side: str
    address: str
    store: JobStore
    know_worker: Callable[[str, Resources], None]


@contextlib.asynccontextmanager
async def _real(pki: Pki, tmp_path: Path, store: JobStore) -> AsyncIterator[tuple[Any, Callable[..., None]]]:
    """The real orchestrator as ``app.build`` wires it, linked to a real gateway no worker joins."""
    section = SchedulerSection(allocate_timeout_s=120.0)  # a job stays allocating for the whole test
    tls = pki.tls("scheduler")
    mesh = Mesh(pki)
    gateway = await mesh.add_gateway("contract-gw")
    link = NodeLink(tls, [gateway.address], name="scheduler", backoff_base_s=0.05, backoff_cap_s=0.5)
    await link.start()
    market = SchedulerMarket(tls.identity.peer_id, link, PeerConnector(tls, None), section)
    orchestrator = Orchestrator(
        market,
        store,
        section,
        tmp_path / "state",
        planners=round_planners(section.jobs.sync_lookahead),
        metrics=SchedulerMetrics(),
    )

    def know(worker_id: str, capacity: Resources) -> None:
        market.submit_offer(OfferView(f"offer-{worker_id}", worker_id, 1.0, capacity, capacity=capacity))

    try:
        await link.wait_connected(10)
        await market.start()
        await orchestrator.start()
        yield orchestrator, know
    finally:
        await orchestrator.stop()
        await market.stop()
        await link.stop()
        await mesh.close()


@contextlib.asynccontextmanager
async def _fake(tmp_path: Path, store: JobStore) -> AsyncIterator[tuple[Any, Callable[..., None]]]:
    fake = FakeOrchestrator(tmp_path / "result", store=store, views=[])

    def know(worker_id: str, capacity: Resources) -> None:
        fake.views.append(
            scheduler_pb2.WorkerView(
                peer=common_pb2.PeerInfo(peer_id=worker_id, role=common_pb2.ROLE_WORKER),
                capacity=capacity.to_proto(),
                healthy=True,
            )
        )

    yield fake, know


@pytest.fixture(params=SIDES)
async def api(request: pytest.FixtureRequest, pki: Pki, tmp_path: Path) -> AsyncIterator[Api]:
    store = await JobStore.open(tmp_path / "scheduler.db")
    orchestration = _fake(tmp_path, store) if request.param == "fake" else _real(pki, tmp_path, store)
    try:
        async with orchestration as (orchestrator, know):
            servicer = SchedulerServicer(store, orchestrator, metrics=SchedulerMetrics())
            server = NodeServer(
                pki.tls("scheduler"),
                "127.0.0.1:0",
                [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, "hypha.v1.Scheduler")],
            )
            await server.start()
            try:
                yield Api(request.param, server.address, store, know)
            finally:
                await server.stop(0)
    finally:
        await store.close()


@pytest.fixture(scope="module")
def other_client(pki: Pki) -> TlsMaterial:
    return pki.issue("client", "contract-other-client")


async def _submit(stub: scheduler_pb2_grpc.SchedulerStub, toml: str = TASK_TOML) -> scheduler_pb2.Job:
    return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(toml=toml), timeout=5)


async def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


async def test_a_submitted_job_is_active_owned_and_listed(api: Api, pki: Pki) -> None:
    tls = pki.tls("client")
    async with client(tls, api.address) as stub:
        job = await _submit(stub)
        listed = await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5)
        got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.job_id), timeout=5)

    assert job.state in ACTIVE and job.submitted_by == tls.identity.peer_id
    assert job.spec.task.command == "echo"
    assert [j.job_id for j in listed.jobs] == [job.job_id]
    assert got.job_id == job.job_id and got.submitted_by == job.submitted_by
    assert got.state in ACTIVE  # no worker is ever leased here


async def test_the_owner_cancels_and_the_job_stays_cancelled(api: Api, pki: Pki) -> None:
    async with client(pki.tls("client"), api.address) as stub:
        job = await _submit(stub)
        done = await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)
        got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
        again = stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)
        assert await _code(again) == grpc.StatusCode.FAILED_PRECONDITION

    assert list(done.cancelled) == [job.job_id]
    assert got.state == common_pb2.JOB_STATE_CANCELLED and got.reason == "cancelled by client"
    assert (await api.store.get(job.job_id)).state is JobState.CANCELLED


async def test_a_foreign_client_can_neither_cancel_nor_scale_and_the_job_is_untouched(
    api: Api, pki: Pki, other_client: TlsMaterial
) -> None:
    async with client(pki.tls("client"), api.address) as mine, client(other_client, api.address) as theirs:
        job = await _submit(mine)
        cancel = theirs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)
        scale = theirs.ScaleJob(scheduler_pb2.ScaleJobRequest(job_id=job.job_id, workers=2), timeout=5)
        assert await _code(cancel) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(scale) == grpc.StatusCode.PERMISSION_DENIED
        everything = await theirs.CancelJob(scheduler_pb2.CancelJobRequest(all=True), timeout=5)

    assert list(everything.cancelled) == []
    assert (await api.store.get(job.job_id)).state in (JobState.PENDING, JobState.ALLOCATING)


async def test_only_a_running_diloco_job_scales(api: Api, pki: Pki) -> None:
    async with client(pki.tls("client"), api.address) as stub:
        task = await _submit(stub)
        # Without a DHT a real scheduler fails a DiLoCo job at once; either way it is not running.
        diloco = await _submit(stub, DILOCO_TOML)
        scale_task = stub.ScaleJob(scheduler_pb2.ScaleJobRequest(job_id=task.job_id, workers=2), timeout=5)
        scale_diloco = stub.ScaleJob(
            scheduler_pb2.ScaleJobRequest(job_id=diloco.job_id, workers=2), timeout=5
        )

        assert await _code(scale_task) == grpc.StatusCode.FAILED_PRECONDITION
        assert await _code(scale_diloco) == grpc.StatusCode.FAILED_PRECONDITION
        assert (await api.store.get(diloco.job_id)).state not in (JobState.RUNNING, JobState.SUCCEEDED)


async def test_list_workers_shows_each_known_worker_with_its_capacity(api: Api, pki: Pki) -> None:
    async with client(pki.tls("admin"), api.address) as stub:
        empty = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        api.know_worker("worker-1", Resources(cpu=4, memory_gb=8))
        response = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)

    assert list(empty.workers) == []
    (view,) = response.workers
    assert (view.peer.peer_id, view.peer.role) == ("worker-1", common_pb2.ROLE_WORKER)
    assert (view.capacity.cpu, view.capacity.memory_gb) == (4, 8)
    assert view.healthy and not view.job_id and not view.leases
