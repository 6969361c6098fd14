"""The reference bridge routes one call at a time: answers and errors as the reference worker gives them.

Each test serves a real ``JobBridge`` (``start_real_bridge``: the scheduler and
the parameter server are a ``FakeNetwork``) and calls it with plain HTTP over
its socket, as an executor written for the reference system does.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hypha.testing.executors import FakeNetwork, diloco_spec, sync_every
from hypha.testing.real_bridge import start_real_bridge
from hypha.worker.reference_job import artifact_reference, job_document

pytestmark = pytest.mark.timeout(60)

PEERS = {"type": "peers", "peers": ["ps"], "strategy": {"type": "All"}}


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("hypha", timeout=30)
        self.path_ = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path_)


def _post(sock: Path, path: str, body: Any, content_type: str = "application/json") -> Reply:
    conn = _Unix(sock)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, raw, {"Content-Type": content_type})
        resp = conn.getresponse()
        return Reply(resp.status, resp.getheader("Content-Type", ""), resp.read())
    finally:
        conn.close()


async def post(sock: Path, path: str, body: Any, content_type: str = "application/json") -> Reply:
    return await asyncio.to_thread(_post, sock, path, body, content_type)


@dataclass
class Served:
    network: FakeNetwork
    bridge: Any
    work_dir: Path

    @property
    def sock(self) -> Path:
        return Path(self.bridge.socket_path)


@pytest.fixture
async def served(tmp_path: Path, gpt2_dir: Path, slice_files: list[Path]) -> AsyncIterator[Served]:
    network = FakeNetwork(
        spec=diloco_spec(rounds=2),
        root=tmp_path / "jobs",
        model_dir=gpt2_dir,
        trainer_ids=("t0",),
        slices={"t0": slice_files[:3]},
    )
    bridge, _record, work_dir = await start_real_bridge(network, "t0")
    try:
        yield Served(network, bridge, work_dir)
    finally:
        await bridge.stop()


def _error(reply: Reply, status: int, kind: str) -> str:
    assert reply.status == status, reply
    body = reply.json()
    assert body["error"] == kind, body
    return str(body["detail"])


# ---- bodies the reference's JSON extractor refuses ------------------------------------------


async def test_bodies_are_refused_as_the_reference_refuses_them(served: Served) -> None:
    for route in ("/resources/fetch", "/resources/send", "/resources/receive", "/status/send"):
        wrong_type = await post(served.sock, route, b"{}", content_type="text/plain")
        not_json = await post(served.sock, route, b"{not json")
        wrong_shape = await post(served.sock, route, {"type": "nothing-known"})

        assert wrong_type.status == 415, (route, wrong_type)
        assert not_json.status == 400 and not_json.content_type.startswith("text/plain"), (route, not_json)
        assert wrong_shape.status == 422 and wrong_shape.content_type.startswith("text/plain"), (
            route,
            wrong_shape,
        )


# ---- fetch ----------------------------------------------------------------------------------


async def test_fetch_refuses_what_the_reference_refuses(served: Served) -> None:
    hf = {"type": "huggingface", "repository": "owner/repo", "revision": None, "token": None}

    assert "invalid URI" in _error(
        await post(served.sock, "/resources/fetch", {"type": "uri", "value": "ftp://x"}),
        400,
        "invalid_request",
    )
    assert "repository" in _error(
        await post(served.sock, "/resources/fetch", {**hf, "repository": " ", "filenames": ["a"]}),
        400,
        "invalid_request",
    )
    assert "filenames" in _error(
        await post(served.sock, "/resources/fetch", {**hf, "filenames": []}), 400, "invalid_request"
    )
    assert "strategy" in _error(await post(served.sock, "/resources/fetch", PEERS), 400, "invalid_request")
    missing = await post(served.sock, "/resources/fetch", {"type": "huggingface", "repository": "x"})
    assert missing.status == 422 and b"filenames" in missing.body


async def test_fetch_takes_only_the_jobs_own_sources(served: Served) -> None:
    other = {"type": "huggingface", "repository": "owner/other", "filenames": ["config.json"]}
    uri = {"type": "uri", "value": "https://example.invalid/model.bin"}

    assert "not a resource of this job" in _error(
        await post(served.sock, "/resources/fetch", other), 400, "invalid_request"
    )
    _error(await post(served.sock, "/resources/fetch", uri), 500, "connector_error")


async def test_the_model_lands_in_artifacts_as_private_files(served: Served) -> None:
    model = artifact_reference(served.bridge.ctx.dispatch.spec.diloco.model)

    reply = await post(served.sock, "/resources/fetch", model)

    assert reply.status == 200, reply
    files = {item["path"]: item["size"] for item in reply.json()}
    assert "artifacts/config.json" in files and "artifacts/model.safetensors" in files
    for rel, size in files.items():
        path = served.work_dir / rel
        assert path.stat().st_size == size
        assert path.stat().st_mode & 0o777 == 0o600


async def test_scheduler_fetches_hand_out_the_next_slices_in_order(
    served: Served, slice_files: list[Path]
) -> None:
    ref = {"type": "scheduler", "peer": "scheduler", "dataset": "arith"}

    first = (await post(served.sock, "/resources/fetch", ref)).json()
    second = (await post(served.sock, "/resources/fetch", ref)).json()

    assert first == [{"path": "artifacts/0", "size": slice_files[0].stat().st_size}]
    assert second[0]["path"] == "artifacts/1"
    assert (served.work_dir / "artifacts" / "1").read_bytes() == slice_files[1].read_bytes()
    assert not (served.work_dir / "artifacts" / "0").exists()  # asking again released the first


# ---- send and receive -----------------------------------------------------------------------


async def test_paths_must_stay_relative_and_inside_the_work_dir(served: Served, tmp_path: Path) -> None:
    os.symlink(tmp_path, served.work_dir / "escape")
    cases = {
        "/etc/passwd": "absolute",
        "../t1/x": "traversal",
        "a/../../x": "traversal",
        "escape/x": "link",
    }
    for path, why in cases.items():
        send = await post(served.sock, "/resources/send", {"resource": PEERS, "path": path})
        receive = await post(served.sock, "/resources/receive", {"resource": PEERS, "path": path})

        assert why in _error(send, 400, "invalid_request"), path
        assert why in _error(receive, 400, "invalid_request"), path


async def test_send_and_receive_take_peers_references_only(served: Served) -> None:
    scheduler = {"type": "scheduler", "peer": "s", "dataset": "d"}
    one = {**PEERS, "strategy": {"type": "One"}}

    assert (await post(served.sock, "/resources/send", {"resource": scheduler, "path": "x"})).status == 422
    assert (await post(served.sock, "/resources/send", {"resource": PEERS})).status == 422
    assert (await post(served.sock, "/resources/receive", {"resource": one, "path": "in"})).status == 422


# ---- status ---------------------------------------------------------------------------------


async def test_status_carries_the_schedulers_directive_in_the_references_words(served: Served) -> None:
    served.network.policy = sync_every({"t0": 2}, rounds=1)
    status = {"status": {"batch_size": 8, "round_time": 12}}

    answers = [(await post(served.sock, "/status/send", status)).json() for _ in range(2)]
    assert (await post(served.sock, "/status/send", "update")).json() == {"type": "Ok"}
    await post(served.sock, "/resources/send", {"resource": PEERS, "path": "nothing-yet"})
    metrics = await post(served.sock, "/status/send", {"metrics": {"round": 1, "metrics": {"loss": 0.5}}})
    after = (await post(served.sock, "/status/send", status)).json()
    received = (await post(served.sock, "/status/send", "update-received")).json()

    assert answers == [{"type": "ScheduleUpdate", "counter": 1}, {"type": "ScheduleUpdate", "counter": 0}]
    assert metrics.json() == {"type": "Ok"}
    assert after == {"type": "Done"}
    assert received == {"type": "Done"}
    assert [p[:4] for p in served.network.progress] == [("t0", 0, 1, 8), ("t0", 0, 2, 16), ("t0", 1, 1, 8)]
    assert served.network.metrics[0][:2] == ("t0", 0)
    assert served.network.metrics[0][2]["loss"] == pytest.approx(0.5)


async def test_update_received_answers_continue_until_the_last_round(served: Served) -> None:
    assert (await post(served.sock, "/status/send", "update-received")).json() == {"type": "Continue"}
    assert (await post(served.sock, "/status/send", "updated")).json() == {"type": "Ok"}
    bad = await post(served.sock, "/status/send", {"status": {"batch_size": -1}})
    assert bad.status == 422


async def test_the_job_document_names_what_the_routes_serve(served: Served) -> None:
    job = job_document(served.bridge.ctx.dispatch, "diloco-transformer")

    config = job["executor"]["config"]
    assert job["executor"]["class"] == "train"
    assert job["executor"]["descriptor"] == {"name": "diloco-transformer"}
    assert config["updates"]["peers"] == ["ps"] and config["results"]["strategy"] == {"type": "All"}
    assert config["data"] == {"type": "scheduler", "peer": "scheduler", "dataset": "arith"}
    assert config["optimizer"]["learning-rate"] > 0 and config["batch_size"] == 8
    reply = await post(served.sock, "/resources/fetch", config["model"]["artifact"])
    assert reply.status == 200
