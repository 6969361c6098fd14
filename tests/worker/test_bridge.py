"""The job bridge over its real Unix socket: the contract, its refusals, and a user's script."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from hypha.bridge_client import (
    BridgeClient,
    BridgeForbiddenError,
    BridgeNotFoundError,
    BridgeUnavailableError,
)
from hypha.market.resources import ExecutorKind
from hypha.testing.polling import eventually
from hypha.v1 import common_pb2, scheduler_pb2
from hypha.worker.bridge import BridgeContext, BridgeLimits, JobBridge
from hypha.worker.bridge_openapi import OPENAPI
from hypha.worker.execution_state import ExecutionRecord, ExecutionState, JobDispatch
from hypha.worker.fetcher import ProviderInfo
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.model_fetch import HubSettings, ResourceFetcher
from hypha.worker.scheduler_link import LogForwarder
from hypha.worker.transfer import TensorExchange
from tests.worker.fakes import FakeSchedulerLink, task_dispatch

LIMIT = 64 * 1024


def diloco_dispatch(job_id: str = "job-1", **model: object) -> JobDispatch:
    spec = common_pb2.JobSpec(
        name=job_id,
        diloco=common_pb2.DilocoJobSpec(model=common_pb2.ModelSpec(**model), dataset="tiny"),  # type: ignore[arg-type]
    )
    return JobDispatch(job_id, "lease-1", ExecutorKind.DILOCO_TRAINER, spec, "scheduler-1", batch_size=8)


class FakeSlices:
    """A slice source whose verified files live in a cache outside any work dir."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.prefetched: list[int] = []

    async def fetch(self, dataset: str, index: int, providers: Sequence[ProviderInfo]) -> Path:
        path = self.cache / f"{dataset}-{index}.safetensors"
        path.write_bytes(f"slice {index}".encode())
        return path

    def prefetch(self, dataset: str, index: int, providers: Sequence[ProviderInfo]) -> bool:
        self.prefetched.append(index)
        return True


@dataclass
class Harness:
    bridge: JobBridge
    client: BridgeClient
    raw: aiohttp.ClientSession
    link: FakeSchedulerLink
    record: ExecutionRecord
    work_dir: Path
    logs: LogForwarder


async def open_bridge(
    tmp_path: Path,
    dispatch: JobDispatch,
    *,
    resources: ResourceFetcher | None = None,
    slices: FakeSlices | None = None,
    link: FakeSchedulerLink | None = None,
) -> Harness:
    work_dir = tmp_path / "job"
    work_dir.mkdir(mode=0o700)
    link = link or FakeSchedulerLink()
    exchange = TensorExchange(None)
    exchange.open_job(dispatch.job_id)
    record = ExecutionRecord(dispatch.job_id, "exec-1")
    logs = LogForwarder(link, dispatch.job_id)
    logs.start()  # a forwarder that never runs would make every "no such line" assertion vacuous
    bridge = JobBridge(
        BridgeContext(
            dispatch=dispatch,
            work_dir=work_dir,
            record=record,
            link=link,
            exchange=exchange,
            logs=logs,
            resources=resources,
            slices=slices,
            limits=BridgeLimits(max_body_bytes=LIMIT),
        )
    )
    socket_path = await bridge.start()
    raw = aiohttp.ClientSession(
        base_url="http://bridge", connector=aiohttp.UnixConnector(path=str(socket_path))
    )
    return Harness(bridge, BridgeClient(socket_path), raw, link, record, work_dir, logs)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = await open_bridge(tmp_path, diloco_dispatch())
    yield h
    await h.client.close()
    await h.raw.close()
    await h.bridge.stop()
    await h.logs.close()


# ---- the contract's refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../outside", "/etc", "sub/../../outside", "escape-link"])
async def test_paths_outside_the_work_dir_are_refused(harness: Harness, tmp_path: Path, path: str) -> None:
    # Prepare: a symlink inside the work dir that points out of it
    (tmp_path / "outside").mkdir()
    (harness.work_dir / "sub").mkdir()
    (harness.work_dir / "escape-link").symlink_to(tmp_path / "outside")

    # Execute / Assert: every endpoint that takes a path refuses with 403
    for method, url, body in [
        ("POST", "/v1/result", {"path": path}),
        ("POST", "/v1/tensors/publish", {"kind": "update", "round": 1, "path": path}),
        ("POST", "/v1/tensors/send", {"peer": "p", "kind": "delta", "path": path}),
    ]:
        async with harness.raw.request(method, url, json=body) as response:
            assert response.status == 403, (url, await response.text())
            assert "outside the job's work dir" in (await response.json())["error"]
    with pytest.raises(BridgeForbiddenError):
        await harness.client.result(path)
    assert harness.record.result_dir == ""


async def test_a_symlink_that_stays_inside_is_fine(harness: Harness) -> None:
    (harness.work_dir / "out").mkdir()
    (harness.work_dir / "latest").symlink_to(harness.work_dir / "out")

    await harness.client.result("latest")

    assert harness.record.result_dir == str((harness.work_dir / "out").resolve())


async def test_oversize_bodies_are_refused_with_413(harness: Harness) -> None:
    big = {"stream": "stdout", "line": "x" * (LIMIT * 2)}
    async with harness.raw.post("/v1/log", json=big) as response:
        assert response.status == 413
        assert "error" in await response.json()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"stream": "stdout", "line": "'
        for _ in range(4):
            yield b"y" * LIMIT
        yield b'"}'

    async with harness.raw.post("/v1/log", data=chunked()) as response:
        assert response.status == 413
    # A line sent after the refused ones arrives; the refused bodies never do.
    async with harness.raw.post("/v1/log", json={"stream": "stdout", "line": "after"}) as response:
        assert response.status < 300
    await eventually(
        lambda: "after" in harness.link.lines(), timeout=10, message="the accepted line forwarded"
    )
    assert not any("yyyy" in line or "xxxx" in line for line in harness.link.lines())


async def test_unknown_resources_and_routes_are_404(harness: Harness) -> None:
    with pytest.raises(BridgeNotFoundError):
        await harness.client.fetch_resource("weights")
    async with harness.raw.get("/v1/nothing-here") as response:
        assert response.status == 404
        assert "error" in await response.json()


async def test_malformed_requests_are_400(harness: Harness) -> None:
    async with harness.raw.post("/v1/progress", data=b"{not json") as response:
        assert response.status == 400
    async with harness.raw.post("/v1/progress", json={"round": -1, "batches": 1, "samples": 1}) as response:
        assert response.status == 400
        assert "round" in (await response.json())["error"]
    async with harness.raw.post("/v1/log", json={"stream": "secret", "line": "x"}) as response:
        assert response.status == 400
    assert harness.link.progress_reports == []


async def test_integers_beyond_their_protobuf_fields_are_400_and_nothing_is_kept(harness: Harness) -> None:
    # A round is a uint32 and samples a uint64 in the report forwarded: a larger number is the
    # caller's mistake (400), not a failure of the bridge (it was a 500, found by the REST fuzzer).
    body = {"round": 2**32, "batches": 1, "samples": 1}
    async with harness.raw.post("/v1/progress", json=body) as response:
        assert response.status == 400
        assert "'round' must be an integer from 0 to 4294967295" in (await response.json())["error"]
    async with harness.raw.post("/v1/progress", json={**body, "round": 1, "samples": 2**64}) as response:
        assert response.status == 400
    async with harness.raw.post("/v1/slices/used", json={"indices": [1, 2**32]}) as response:
        assert response.status == 400
    assert harness.link.progress_reports == []
    # The largest values that fit are taken.
    async with harness.raw.post("/v1/progress", json={**body, "round": 2**32 - 1, "samples": 2**64 - 1}):
        pass
    assert [(r.round, r.samples) for r in harness.link.progress_reports] == [(2**32 - 1, 2**64 - 1)]
    assert harness.bridge.slices.used == []


async def test_openapi_document_covers_every_route(harness: Harness) -> None:
    async with harness.raw.get("/v1/openapi.json") as response:
        served = await response.json()
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in harness.bridge.app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    documented = {(method, path) for path, item in served["paths"].items() for method in item}
    assert served == json.loads(json.dumps(OPENAPI))
    assert routes == documented


# ---- what an executor gets ------------------------------------------------------------------------


async def test_job_info_hides_credentials(tmp_path: Path) -> None:
    h = await open_bridge(tmp_path, diloco_dispatch(repository="owner/tiny", token="hf_secret"))
    try:
        job = await h.client.job()
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()

    assert job.job_id == "job-1" and job.executor == "diloco-trainer" and job.batch_size == 8
    assert job.spec_proto().diloco.model.repository == "owner/tiny"
    assert "hf_secret" not in json.dumps(job.spec)


async def test_progress_gets_the_scheduler_s_directive(tmp_path: Path) -> None:
    link = FakeSchedulerLink(
        scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_SYNC_AFTER, batches=7, round=3)
    )
    h = await open_bridge(tmp_path, diloco_dispatch(), link=link)
    try:
        directive = await h.client.progress(3, 10, 80, 1.25, 0.05, 8)
        await h.client.metrics(3, {"loss": 1.25, "tokens": 640})
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()

    assert (directive.kind, directive.batches, directive.round) == ("sync_after", 7, 3)
    (report,) = link.progress_reports
    assert (report.job_id, report.round, report.batches, report.samples) == ("job-1", 3, 10, 80)
    assert report.loss == pytest.approx(1.25) and report.batch_size == 8
    assert dict(link.metrics_reports[0].values) == {"loss": 1.25, "tokens": 640.0}


async def test_next_slice_lands_in_the_work_dir_and_used_ones_are_reported(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    offers = [
        scheduler_pb2.NextSliceResponse(available=True, index=i, epoch=0, dataset="tiny") for i in (4, 9)
    ]
    link = FakeSchedulerLink(slices=offers)
    slices = FakeSlices(cache)
    h = await open_bridge(tmp_path, diloco_dispatch(), link=link, slices=slices)
    try:
        first = await h.client.next_slice()
        await h.client.slices_used([4])
        second = await h.client.next_slice()
        third = await h.client.next_slice()
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()

    assert first is not None and second is not None and third is None
    assert (first.index, second.index) == (4, 9)
    assert second.path.read_bytes() == b"slice 9"
    assert second.path.is_relative_to(h.work_dir) and not first.path.exists()  # used: unlinked
    assert slices.prefetched == [9]  # looked ahead while slice 4 was in use
    # first, its lookahead, the lookahead after the second (carrying the used one), the third
    assert [list(r.used) for r in link.slice_requests] == [[], [], [4], []]


# ---- resources: a local path and a (fake) Hugging Face hub ---------------------------------------------


async def test_model_from_an_allowed_local_path(tmp_path: Path) -> None:
    models = tmp_path / "models" / "tiny"
    models.mkdir(parents=True)
    (models / "config.json").write_text('{"model_type": "gpt2"}')
    (models / "model.safetensors").write_bytes(b"\x00" * 1024)
    fetcher = ResourceFetcher(HubSettings(cache_dir=tmp_path / "hub", local_roots=(tmp_path / "models",)))
    h = await open_bridge(tmp_path, diloco_dispatch(local_path=str(models)), resources=fetcher)
    try:
        path = await h.client.fetch_resource("model")
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()

    assert path.is_relative_to(h.work_dir)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert (path / "model.safetensors").read_bytes() == b"\x00" * 1024


async def test_model_outside_the_allowed_roots_is_refused(tmp_path: Path) -> None:
    fetcher = ResourceFetcher(HubSettings(cache_dir=tmp_path / "hub", local_roots=(tmp_path / "models",)))
    h = await open_bridge(tmp_path, diloco_dispatch(local_path="/etc"), resources=fetcher)
    try:
        with pytest.raises(BridgeForbiddenError):
            await h.client.fetch_resource("model")
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()


_COMMIT = "c0ffee" + "0" * 34
_HUB_FILES = {"config.json": b'{"model_type": "gpt2", "n_layer": 1}', "model.safetensors": os.urandom(4096)}


@dataclass
class FakeHub:
    url: str
    requests: list[tuple[str, str, str]]


@pytest.fixture
async def fake_hub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHub]:
    """The hub endpoints huggingface_hub's snapshot_download uses: revision, tree, resolve."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    seen: list[tuple[str, str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, request.headers.get("Authorization", "")))
        missing = web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"})
        if not request.path.startswith(("/api/models/owner/tiny/", "/owner/tiny/")):
            return missing
        if "/revision/" in request.path:
            siblings = [{"rfilename": name} for name in _HUB_FILES]
            return web.json_response({"id": "owner/tiny", "sha": _COMMIT, "siblings": siblings})
        if "/tree/" in request.path:
            return web.json_response(
                [
                    {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for n, b in _HUB_FILES.items()
                ]
            )
        match = re.match(r"^/owner/tiny/resolve/[^/]+/(.+)$", request.path)
        if match and match.group(1) in _HUB_FILES:
            body = _HUB_FILES[match.group(1)]
            headers = {
                "X-Repo-Commit": _COMMIT,
                "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                "Content-Length": str(len(body)),
            }
            return web.Response(body=None if request.method == "HEAD" else body, headers=headers)
        return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield FakeHub(f"http://127.0.0.1:{port}", seen)
    await runner.cleanup()


async def test_model_from_the_hub_via_its_endpoint_with_the_job_s_token(
    tmp_path: Path, fake_hub: FakeHub
) -> None:
    fetcher = ResourceFetcher(HubSettings(cache_dir=tmp_path / "hub-cache", endpoint=fake_hub.url))
    dispatch = diloco_dispatch(
        repository="owner/tiny",
        revision="main",
        token="hf_job_token",
        filenames=["config.json", "*.safetensors"],
    )
    h = await open_bridge(tmp_path, dispatch, resources=fetcher)
    try:
        path = await h.client.fetch_resource("model")
        again = await h.client.fetch_resource("model")
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()

    assert again == path and path.is_relative_to(h.work_dir)
    for name, body in _HUB_FILES.items():
        assert (path / name).read_bytes() == body
    downloads = [r for r in fake_hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert len(downloads) == 2  # once per file; the second fetch was served from the job's copy
    assert all(auth == "Bearer hf_job_token" for _, _, auth in fake_hub.requests)


async def test_unknown_hub_repository_is_404(tmp_path: Path, fake_hub: FakeHub) -> None:
    fetcher = ResourceFetcher(HubSettings(cache_dir=tmp_path / "hub-cache", endpoint=fake_hub.url))
    h = await open_bridge(tmp_path, diloco_dispatch(repository="owner/missing"), resources=fetcher)
    try:
        with pytest.raises(BridgeNotFoundError):
            await h.client.fetch_resource("model")
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()


# ---- a user's own script, run by the job manager ------------------------------------------------------

_USER_SCRIPT = textwrap.dedent(
    """
    import pathlib
    from hypha.bridge_client import SyncBridgeClient

    # y = 3x + 1 by plain gradient descent: the smallest model that "trains".
    data = [(x / 10, 3 * x / 10 + 1) for x in range(-10, 11)]
    w, b, lr = 0.0, 0.0, 0.1
    with SyncBridgeClient.from_env() as bridge:
        job = bridge.job()
        batches = 0
        while True:
            grad_w = sum(2 * (w * x + b - y) * x for x, y in data) / len(data)
            grad_b = sum(2 * (w * x + b - y) for x, y in data) / len(data)
            w, b = w - lr * grad_w, b - lr * grad_b
            loss = sum((w * x + b - y) ** 2 for x, y in data) / len(data)
            batches += 1
            directive = bridge.progress(0, batches, batches * len(data), loss, 0.001, len(data))
            if directive.kind == "done":
                break
        bridge.metrics(0, {"w": w, "b": b})
        out = pathlib.Path("out")
        out.mkdir()
        (out / "weights.txt").write_text(f"{w} {b}")
        bridge.result("out")
        print(f"{job.job_id} trained for {batches} batches", flush=True)
        bridge.status("succeeded", f"loss {loss:.4f}")
    """
)


async def test_a_user_script_trains_through_the_bridge(tmp_path: Path) -> None:
    # Prepare: the scheduler says "done" after 20 batches
    def reply(report: scheduler_pb2.ProgressReport) -> scheduler_pb2.Directive:
        kind = (
            scheduler_pb2.DIRECTIVE_KIND_DONE
            if report.batches >= 20
            else scheduler_pb2.DIRECTIVE_KIND_CONTINUE
        )
        return scheduler_pb2.Directive(kind=kind)

    link = FakeSchedulerLink(reply=reply)
    script = tmp_path / "train.py"
    script.write_text(_USER_SCRIPT)
    manager = JobManager(
        JobsSection(stop_grace_s=1.0, sandbox_paths=[script]),  # the sandbox shows it the script
        tmp_path / "work",
        exchange=TensorExchange(None),
        link_factory=lambda dispatch: link,
        cpu_count=2,
    )

    # Execute
    async with manager:
        await manager.dispatch(task_dispatch("user-job", [sys.executable, str(script)]))
        record = await manager.wait("user-job", 30)

    # Assert: it followed the directive, its loss fell, and its result was kept
    assert record.state is ExecutionState.SUCCEEDED, (record.message, link.lines())
    losses = [r.loss for r in link.progress_reports]
    assert len(losses) == 20 and losses[-1] < losses[0] / 10
    # The script's own status message reached the record unchanged: its last loss.
    assert record.message == f"loss {losses[-1]:.4f}"
    assert "user-job trained for 20 batches" in link.lines("stdout")
    result = manager.result_dir("user-job")
    assert result is not None
    w, b = map(float, (result / "weights.txt").read_text().split())
    assert dict(link.metrics_reports[0].values) == pytest.approx({"w": w, "b": b})


async def test_bridge_works_where_the_socket_path_exceeds_sun_path(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    h = await open_bridge(deep, diloco_dispatch())
    try:
        job = await h.client.job()
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()

    assert len(str(h.bridge.socket_path)) > 108
    assert job.work_dir == h.work_dir
    assert not h.bridge.socket_path.exists()  # removed on stop


# ---- a restored parameter server ------------------------------------------------------------------


async def test_a_rewired_trainer_abandons_its_call_to_the_old_server_and_reaches_the_new_one(
    tmp_path: Path,
) -> None:
    # Prepare: a trainer's pull of an update from its parameter server hangs (the server is gone).
    dispatch = replace(diloco_dispatch(), parameter_server_id="ps-old")
    h = await open_bridge(tmp_path, dispatch)
    asked: list[str] = []
    gone = asyncio.Event()

    async def fetch(job_id: str, peer: str, *args: object) -> None:
        asked.append(peer)
        await gone.wait()  # no answer until the test ends

    h.bridge.ctx.exchange.fetch = fetch  # type: ignore[method-assign]
    try:
        first = asyncio.ensure_future(
            h.client.fetch_tensors(peer="ps-old", kind="update", round=3, timeout_s=60)
        )
        await eventually(lambda: asked == ["ps-old"])

        # Execute: the scheduler restored the server elsewhere and re-dispatched the trainer.
        h.bridge.rewire(replace(dispatch, parameter_server_id="ps-new", former_parameter_servers=("ps-old",)))

        # Assert: the hanging call ends at once (503: ask again); the next one goes to the new server.
        with pytest.raises(BridgeUnavailableError, match="restored on ps-new"):
            await asyncio.wait_for(first, 10)
        second = asyncio.ensure_future(
            h.client.fetch_tensors(peer="ps-old", kind="update", round=3, timeout_s=60)
        )
        await eventually(lambda: asked == ["ps-old", "ps-new"])
        assert (await h.client.job()).parameter_server_id == "ps-new"
        gone.set()
        assert await asyncio.wait_for(second, 10) is None  # the new server had nothing yet
    finally:
        gone.set()
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()
        await h.logs.close()


async def test_a_delta_in_flight_to_the_old_server_goes_to_the_restored_one(tmp_path: Path) -> None:
    dispatch = replace(diloco_dispatch(), parameter_server_id="ps-old")
    h = await open_bridge(tmp_path, dispatch)
    delta = h.work_dir / "delta.safetensors"
    delta.write_bytes(b"delta")
    sent_to: list[str] = []

    async def send(job_id: str, peer: str, *args: object) -> tuple[bool, str]:
        sent_to.append(peer)
        if peer == "ps-old":
            await asyncio.Event().wait()  # the old server's machine is gone: no answer
        return True, "queued"

    h.bridge.ctx.exchange.send = send  # type: ignore[method-assign]
    try:
        sending = asyncio.ensure_future(
            h.client.send_tensors(peer="ps-old", kind="delta", round=2, samples=8, path=delta)
        )
        await eventually(lambda: sent_to == ["ps-old"])

        h.bridge.rewire(replace(dispatch, parameter_server_id="ps-new", former_parameter_servers=("ps-old",)))

        reply = await asyncio.wait_for(sending, 10)
        assert sent_to == ["ps-old", "ps-new"]
        assert reply[0] is True
    finally:
        await h.client.close()
        await h.raw.close()
        await h.bridge.stop()
        await h.logs.close()
