"""The REST mirror: same jobs, same answers as gRPC, behind the same mutual TLS and roles."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from hypha.net.https import client_ssl_context
from hypha.net.metrics_server import exposition
from hypha.net.tls import TlsMaterial
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.metrics import SchedulerMetrics, StatusBridge
from hypha.scheduler.rest import RestServer, Route
from hypha.scheduler.servicer import OPERATORS
from hypha.v1 import common_pb2, scheduler_pb2
from tests.conftest import Pki
from tests.helpers import eventually
from tests.scheduler.test_servicer import DILOCO_TOML, Served, client, serve_api


@pytest.fixture
async def rest(pki: Pki, tmp_path: Path) -> AsyncIterator[tuple[Served, RestServer]]:
    async with serve_api(pki, tmp_path) as served:
        server = RestServer(served.api, pki.tls("scheduler"), "127.0.0.1:0", metrics=served.metrics)
        await server.start()
        try:
            yield served, server
        finally:
            await server.stop()


@pytest.fixture(scope="module")
def other_client(pki: Pki) -> TlsMaterial:
    return pki.issue("client", "rest-other-client")


@contextlib.asynccontextmanager
async def http(tls: TlsMaterial | None, trust: TlsMaterial) -> AsyncIterator[aiohttp.ClientSession]:
    if tls is None:
        ctx = ssl.create_default_context(cadata=trust.trust_pem.decode())
    else:
        ctx = client_ssl_context(tls)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        yield session


async def _json(response: aiohttp.ClientResponse, status: int) -> Any:
    body = await response.json()
    assert response.status == status, body
    return body


def _grpc_view(job: scheduler_pb2.Job) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "state": JobState.from_proto(job.state).value,
        "reason": job.reason,
        "round": job.round,
        "rounds": job.rounds,
        "attempt": job.attempt,
        "exit_code": job.exit_code,
        "workers": list(job.workers),
        "submitted_by": job.submitted_by,
        "name": job.spec.name,
    }


async def test_rest_and_grpc_agree_on_a_task_through_its_life(
    rest: tuple[Served, RestServer], pki: Pki
) -> None:
    served, server = rest
    api = f"{server.url}/api/v1"
    async with (
        http(pki.tls("client"), pki.tls("client")) as session,
        client(pki.tls("client"), served.address) as stub,
    ):
        # Submit through REST (the task route), read through both.
        body = {"name": "hello", "command": "echo", "args": ["hi"], "retry": {"max_attempts": 2}}
        async with session.post(f"{api}/tasks", json=body) as response:
            created = await _json(response, 201)
        job_id = created["job_id"]
        assert created["state"] == "pending" and created["kind"] == "task"
        assert created["spec"]["task"]["retry"]["max_attempts"] == 2

        async def agree() -> None:
            async with session.get(f"{api}/tasks/{job_id}") as response:
                via_rest = await _json(response, 200)
            via_grpc = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=5)
            assert {k: via_rest[k] for k in _grpc_view(via_grpc)} == _grpc_view(via_grpc)

        await agree()
        await served.store.transition(job_id, JobState.ALLOCATING)
        await served.store.transition(
            job_id, JobState.RUNNING, attempt=1, workers=["w1"], reason="dispatched"
        )
        await agree()

        # Cancel through REST (an action: the job stays readable); gRPC sees it.
        async with session.post(f"{api}/tasks/{job_id}/cancel") as response:
            assert (await _json(response, 200)) == {"cancelled": [job_id]}
        await agree()
        via_grpc = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=5)
        assert via_grpc.state == common_pb2.JOB_STATE_CANCELLED
        async with session.post(f"{api}/tasks/{job_id}/cancel") as response:
            error = await _json(response, 409)
        assert error["error"]["code"] == "FAILED_PRECONDITION"

        # Lists agree too.
        listed = await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5)
        async with session.get(f"{api}/jobs") as response:
            assert [j["job_id"] for j in (await _json(response, 200))["jobs"]] == [
                j.job_id for j in listed.jobs
            ]


async def test_jobs_submit_as_toml_and_errors_name_the_key(rest: tuple[Served, RestServer], pki: Pki) -> None:
    served, server = rest
    api = f"{server.url}/api/v1"
    async with http(pki.tls("client"), pki.tls("client")) as session:
        headers = {"Content-Type": "application/toml"}
        async with session.post(f"{api}/jobs", data=DILOCO_TOML, headers=headers) as response:
            job = await _json(response, 201)
        assert (
            job["kind"] == "diloco"
            and job["rounds"] == 4
            and job["spec"]["diloco"]["model"]["token"] == "***"
        )
        await served.store.transition(job["job_id"], JobState.ALLOCATING)  # only an active job scales
        async with session.post(f"{api}/jobs/{job['job_id']}/scale", json={"workers": 3}) as response:
            assert (await _json(response, 200))["job_id"] == job["job_id"]
        async with session.post(f"{api}/jobs/{job['job_id']}/scale", json={"workers": "3"}) as response:
            assert (await _json(response, 400))["error"]["code"] == "INVALID_ARGUMENT"
        assert served.orchestrator.scaled == [(job["job_id"], 3)]
        bad = DILOCO_TOML.replace('dataset = "d"', "dataset = 3")
        async with session.post(f"{api}/jobs", json={"toml": bad}) as response:
            error = await _json(response, 400)
        assert error["error"]["message"].startswith("job.dataset: must be a string")
        async with session.post(
            f"{api}/tasks", json={"command": "x", "retry": {"max_attempt": 2}}
        ) as response:
            error = await _json(response, 400)
        assert error["error"]["message"].startswith("task.retry.max_attempt: unknown key")
        async with session.post(
            f"{api}/jobs", data=b"{not json", headers={"Content-Type": "application/json"}
        ) as r:
            assert (await _json(r, 400))["error"]["code"] == "INVALID_ARGUMENT"
        async with session.get(f"{api}/tasks/{job['job_id']}") as response:
            assert (await _json(response, 404))["error"]["code"] == "NOT_FOUND"
        async with session.get(f"{api}/jobs", params={"state": "running"}) as response:
            assert (await _json(response, 200))["jobs"] == []
        async with session.get(f"{api}/jobs", params={"state": "sleeping"}) as response:
            await _json(response, 400)
        async with session.post(f"{api}/jobs:cancel", json={"all": False}) as response:
            await _json(response, 400)  # cancelling everything needs {"all": true}
        async with session.post(f"{api}/jobs:cancel", json={"all": True}) as response:
            assert (await _json(response, 200))["cancelled"] == [job["job_id"]]
        async with session.get(f"{api}/workers") as response:
            workers = (await _json(response, 200))["workers"]
        assert workers[0]["peer"]["peer_id"] == "worker-1" and workers[0]["samples_per_second"] == 12.5
        async with session.get(f"{api}/openapi.json") as response:
            doc = await _json(response, 200)
        assert doc["openapi"].startswith("3.1") and "/api/v1/tasks/{job_id}" in doc["paths"]
        assert doc["components"]["securitySchemes"]["mtls"]["type"] == "mutualTLS"
    assert len(await served.store.list_jobs()) == 1


async def test_metrics_are_served_to_any_role_and_the_api_only_to_operators(
    rest: tuple[Served, RestServer], pki: Pki
) -> None:
    _, server = rest
    async with http(pki.tls("client"), pki.tls("client")) as session:
        async with session.post(f"{server.url}/api/v1/tasks", json={"command": "true"}) as response:
            await _json(response, 201)
    async with http(pki.tls("worker"), pki.tls("worker")) as session:
        async with session.get(f"{server.url}/metrics") as response:
            assert response.status == 200 and response.content_type == "text/plain"
            text = await response.text()
        async with session.get(f"{server.url}/api/v1/jobs") as response:
            assert (await _json(response, 403))["error"]["code"] == "PERMISSION_DENIED"
    assert 'hypha_scheduler_jobs{kind="task",state="pending"} 1' in text
    assert "hypha_scheduler_tasks_queued 1" in text
    assert "# TYPE hypha_scheduler_allocation_duration_seconds histogram" in text


async def test_task_env_values_reach_only_the_submitter_and_admins_over_rest(
    rest: tuple[Served, RestServer], pki: Pki, other_client: TlsMaterial
) -> None:
    _, server = rest
    api = f"{server.url}/api/v1"
    secret = {"API_KEY": "sk-live-123"}
    async with http(pki.tls("client"), pki.tls("client")) as session:
        async with session.post(f"{api}/tasks", json={"command": "true", "env": secret}) as response:
            created = await _json(response, 201)
    assert created["spec"]["task"]["env"] == secret
    for who, tls, expected in (
        ("submitter", pki.tls("client"), secret),
        ("admin", pki.tls("admin"), secret),
        ("other client", other_client, {"API_KEY": "***"}),
    ):
        async with http(tls, pki.tls("client")) as session:
            async with session.get(f"{api}/tasks/{created['job_id']}") as response:
                got = await _json(response, 200)
            async with session.get(f"{api}/jobs") as response:
                (listed,) = (await _json(response, 200))["jobs"]
        assert got["spec"]["task"]["env"] == listed["spec"]["task"]["env"] == expected, who


async def test_a_route_gets_its_roles_from_the_route_table_not_its_path(
    rest: tuple[Served, RestServer], pki: Pki
) -> None:
    # The old guard checked roles only for paths under /api/: any other route was open to every
    # role of the network. Here an operators-only route outside /api/ refuses a worker.
    served, _ = rest

    class Extended(RestServer):
        async def hello(self, request: web.Request) -> web.Response:
            return web.json_response({"hello": "operator"})

        def routes(self) -> tuple[Route, ...]:
            return (*super().routes(), Route("GET", "/v2/hello", self.hello, OPERATORS))

    server = Extended(served.api, pki.tls("scheduler"), "127.0.0.1:0", metrics=served.metrics)
    await server.start()
    try:
        async with http(pki.tls("admin"), pki.tls("admin")) as session:
            async with session.get(f"{server.url}/v2/hello") as response:
                assert await _json(response, 200) == {"hello": "operator"}
        async with http(pki.tls("worker"), pki.tls("worker")) as session:
            async with session.get(f"{server.url}/v2/hello") as response:
                assert (await _json(response, 403))["error"]["code"] == "PERMISSION_DENIED"
            # A path no route matches is 404 whatever the role (the old guard said 403 under /api/),
            # and a method the route lacks 405.
            async with session.get(f"{server.url}/api/v1/no-such-route") as response:
                assert response.status == 404
            async with session.post(f"{server.url}/metrics") as response:
                assert response.status == 405
            async with session.get(f"{server.url}/metrics") as response:
                assert response.status == 200
    finally:
        await server.stop()


async def test_clients_without_a_trusted_certificate_cannot_connect(
    rest: tuple[Served, RestServer], pki: Pki, foreign_pki: Pki
) -> None:
    _, server = rest
    for tls in (None, foreign_pki.tls("admin")):
        async with http(tls, pki.tls("client")) as session:
            with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                async with session.get(f"{server.url}/api/v1/jobs") as response:
                    await response.read()


async def test_grpc_agrees_a_cancelled_job_cannot_be_fetched(
    rest: tuple[Served, RestServer], pki: Pki
) -> None:
    served, server = rest
    async with (
        http(pki.tls("client"), pki.tls("client")) as session,
        client(pki.tls("client"), served.address) as stub,
    ):
        async with session.post(f"{server.url}/api/v1/tasks", json={"command": "true"}) as response:
            job_id = (await _json(response, 201))["job_id"]
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=job_id), timeout=5)]
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        async with session.get(f"{server.url}/api/v1/jobs/{job_id}") as response:
            assert (await _json(response, 200))["state"] == "cancelled"


async def test_status_bridge_posts_aim_metrics_and_drops_when_its_queue_is_full() -> None:
    # Prepare: an AIM-bridge stand-in on 127.0.0.1:0 that records what it is sent.
    received: list[dict[str, Any]] = []

    async def status(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response()

    app = web.Application()
    app.router.add_post("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        # A full queue drops instead of blocking.
        full = StatusBridge(f"127.0.0.1:{port}", max_queue=2)
        assert full.push_metrics("j1", "w1", 0, {"loss": 1.0, "lr": 0.1, "samples": 3}) == 2
        assert full.dropped == 1

        # Execute
        bridge = StatusBridge(f"127.0.0.1:{port}")
        await bridge.start()
        bridge.push_metrics("j1", "w1", 3, {"loss": 2.5, "samples_per_second": 40.0})
        await eventually(lambda: len(received) == 2, timeout=10)
        await bridge.stop()
        await bridge.stop()
    finally:
        await runner.cleanup()

    # Assert: the reference system's AIM schema, one metric per POST.
    assert sorted(received, key=lambda m: m["metric_name"]) == [
        {"job_id": "j1", "worker_id": "w1", "metric_name": "loss", "round": 3, "value": 2.5},
        {"job_id": "j1", "worker_id": "w1", "metric_name": "samples_per_second", "round": 3, "value": 40.0},
    ]
    assert bridge.sent == 2 and bridge.failed == 0


async def test_prometheus_text_has_types_labels_buckets_and_scrape_time_figures() -> None:
    metrics = SchedulerMetrics()
    metrics.allocation_seconds.observe(0.02)
    metrics.allocation_seconds.observe(3.0)
    metrics.bytes_moved.labels(kind="result").inc(1024)

    async def flags() -> list[bool]:
        return [True, False, False]

    async def counts() -> dict[tuple[str, JobState], int]:
        return {
            ("task", JobState.PENDING): 2,
            ("task", JobState.ALLOCATING): 1,
            ("task", JobState.SUCCEEDED): 5,
        }

    async def broken() -> list[bool]:
        raise RuntimeError("a source that fails must not hide the others")

    metrics.watch_store(counts)
    metrics.watch_workers(flags)
    await metrics.refresh()
    text = exposition(metrics.registry).text or ""
    parsed = {family.name: family for family in text_string_to_metric_families(text)}
    assert parsed["hypha_scheduler_bytes_moved"].type == "counter"
    assert 'hypha_scheduler_bytes_moved_total{kind="result"} 1024.0' in text
    assert 'hypha_scheduler_jobs{kind="task",state="pending"} 2.0' in text
    assert "hypha_scheduler_tasks_queued 3.0" in text
    assert "hypha_scheduler_tasks_completed_total 5.0" in text
    assert 'hypha_scheduler_allocation_duration_seconds_bucket{le="0.025"} 1.0' in text
    assert 'hypha_scheduler_allocation_duration_seconds_bucket{le="+Inf"} 2.0' in text
    assert "hypha_scheduler_allocation_duration_seconds_count 2.0" in text
    assert "hypha_scheduler_workers_busy 1.0" in text and "hypha_scheduler_workers_available 2.0" in text

    metrics.watch_workers(broken)
    await metrics.refresh()
    assert metrics.value("hypha_scheduler_tasks_queued") == 3
