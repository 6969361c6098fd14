"""A result is sent as regular files and directories only: a link or special file a job left fails it.

A job writes its result directory; the worker (outside the sandbox) and then
the scheduler read it and stream it on. A symlink there to a file the job
cannot read (the worker's key, faked here with known bytes) would otherwise
have the worker read it for the job. Every send goes through
``hypha.filesend.send_dir``: refused with FAILED_PRECONDITION, naming the
path, before anything is sent, and the scheduler does not retry the pull.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from hypha.errors import FailedPreconditionError
from hypha.filesend import FileSendRefused, send_dir
from hypha.filestream import receive_files
from hypha.market.resources import Resources
from hypha.net.channel import secure_channel
from hypha.net.connector import PeerConnector
from hypha.net.server import NodeServer
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.results import ResultPullError, pull_result, result_dir
from hypha.testing.pki import Pki
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from hypha.worker.config import WorkerSection
from hypha.worker.market import WorkerMarket
from hypha.worker.servicer import WorkerServicer
from tests.scheduler.test_servicer import _submit, client, serve_api
from tests.test_filestream import files_under

JOB = "job-links"
KEY = b"-----BEGIN PRIVATE KEY-----\nfake worker key 5f3a9c\n-----END PRIVATE KEY-----\n"
RESULT = {
    "config.json": b'{"model_type": "gpt2"}',
    "model.safetensors": os.urandom(3 * 1024 * 1024 + 77),  # several chunks
    "sub/empty.txt": b"",
}


def _write_result(root: Path) -> Path:
    for name, data in RESULT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _key(tmp_path: Path) -> Path:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "worker.key").write_bytes(KEY)
    return private / "worker.key"


def _link_to_file(result: Path, key: Path) -> str:
    os.symlink(key, result / "model.key")
    return "model.key"


def _link_to_dir(result: Path, key: Path) -> str:
    os.symlink(key.parent, result / "keys")
    return "keys"


def _nested_link(result: Path, key: Path) -> str:
    os.symlink(key, result / "sub" / "leak.bin")
    return "sub/leak.bin"


def _fifo(result: Path, key: Path) -> str:
    os.mkfifo(result / "pipe")
    return "pipe"


PLANTS: dict[str, Callable[[Path, Path], str]] = {
    "symlink to a file": _link_to_file,
    "symlink to a directory": _link_to_dir,
    "symlink in a subdirectory": _nested_link,
    "fifo": _fifo,
}


@contextlib.asynccontextmanager
async def worker_serving(pki: Pki, result: Path) -> AsyncIterator[NodeServer]:
    """A worker's gRPC service on 127.0.0.1:0 whose job ``JOB`` left ``result``, dispatched by the
    ``scheduler`` certificate."""
    scheduler_id = pki.tls("scheduler").identity.peer_id
    connector = PeerConnector(pki.tls("worker"), None)
    market = WorkerMarket("worker-1", None, connector, WorkerSection(), Resources(cpu=2, memory_gb=4))
    servicer = WorkerServicer(
        market, results=lambda job_id: (result, scheduler_id) if job_id == JOB else None
    )
    server = NodeServer(
        pki.tls("worker"),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "hypha.v1.Worker")],
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)
        await market.stop()
        await connector.close()


class DirectCalls:
    """The scheduler's ``WorkerCalls.result_stream`` straight to one worker's address, counting pulls."""

    def __init__(self, pki: Pki, address: str) -> None:
        self.tls, self.address = pki.tls("scheduler"), address
        self.pulls = 0

    async def result_stream(
        self, worker_id: str, job_id: str, timeout_s: float
    ) -> AsyncIterator[worker_pb2.TensorChunk]:
        self.pulls += 1
        async with secure_channel(self.tls, self.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = worker_pb2.PullTensorsRequest(job_id=job_id, kind="result")
            async for piece in stub.PullTensors(request, timeout=timeout_s):
                yield piece


async def _pull(pki: Pki, address: str) -> tuple[list[common_pb2.Chunk], grpc.aio.AioRpcError | None]:
    """What a scheduler receives pulling ``JOB``'s result, and the error the stream ended with."""
    received: list[common_pb2.Chunk] = []
    try:
        async for piece in DirectCalls(pki, address).result_stream("worker-1", JOB, timeout_s=10):
            received.append(piece.chunk)
    except grpc.aio.AioRpcError as err:
        return received, err
    return received, None


def _leaked(chunks: list[common_pb2.Chunk]) -> bool:
    return KEY in b"".join(chunk.data for chunk in chunks)


@pytest.mark.parametrize("plant", PLANTS.values(), ids=PLANTS.keys())
async def test_the_worker_refuses_a_result_holding_a_link_or_special_file(
    pki: Pki, tmp_path: Path, plant: Callable[[Path, Path], str]
) -> None:
    result = _write_result(tmp_path / "result")
    name = plant(result, _key(tmp_path))

    async with worker_serving(pki, result) as server:
        received, err = await _pull(pki, server.address)

    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert repr(name) in (err.details() or "")
    assert received == []  # refused before the first byte
    assert not _leaked(received)


async def test_the_worker_streams_a_plain_result_intact(pki: Pki, tmp_path: Path) -> None:
    result = _write_result(tmp_path / "result")
    os.link(result / "config.json", result / "sub" / "config-again.json")  # a hard link is a plain file
    out = tmp_path / "out"

    async with worker_serving(pki, result) as server:
        calls = DirectCalls(pki, server.address)
        size = await pull_result(calls, "worker-1", JOB, out, timeout_s=10)  # type: ignore[arg-type]

    expected = {**RESULT, "sub/config-again.json": RESULT["config.json"]}
    assert size == sum(map(len, expected.values()))
    assert {name: hashlib.sha256(data).hexdigest() for name, data in files_under(out).items()} == {
        name: hashlib.sha256(data).hexdigest() for name, data in expected.items()
    }


@pytest.mark.parametrize("plant", [_link_to_file, _fifo], ids=["symlink", "fifo"])
async def test_the_scheduler_takes_the_refusal_as_final_and_keeps_nothing(
    pki: Pki, tmp_path: Path, plant: Callable[[Path, Path], str]
) -> None:
    result = _write_result(tmp_path / "result")
    name = plant(result, _key(tmp_path))
    target = result_dir(tmp_path / "state", JOB)

    async with worker_serving(pki, result) as server:
        calls = DirectCalls(pki, server.address)
        with pytest.raises(ResultPullError) as err:
            await pull_result(calls, "worker-1", JOB, target, timeout_s=30)  # type: ignore[arg-type]

    assert "FAILED_PRECONDITION" in err.value.message and repr(name) in err.value.message
    assert calls.pulls == 1  # not asked again: the worker would refuse the same result
    assert not target.exists() and not target.with_name(f"{JOB}.partial").exists()


@pytest.mark.parametrize("plant", PLANTS.values(), ids=PLANTS.keys())
async def test_the_scheduler_refuses_to_serve_a_result_holding_a_link(
    pki: Pki, tmp_path: Path, plant: Callable[[Path, Path], str]
) -> None:
    key = _key(tmp_path)
    async with serve_api(pki, tmp_path) as served, client(pki.tls("client"), served.address) as stub:
        name = plant(_write_result(served.orchestrator.result_dir), key)
        job = await _submit(stub)
        for state in (JobState.ALLOCATING, JobState.RUNNING, JobState.SUCCEEDED):
            await served.store.transition(job.job_id, state)
        received: list[common_pb2.Chunk] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in stub.FetchResult(
                scheduler_pb2.FetchResultRequest(job_id=job.job_id), timeout=10
            ):
                received.append(item.chunk)

    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert repr(name) in (err.value.details() or "")
    assert received == [] and not _leaked(received)


async def test_a_link_swapped_in_after_the_walk_is_refused_at_its_open(tmp_path: Path) -> None:
    # Prepare: the walk has listed a.bin, b.bin and sub/c.bin, then b.bin becomes a link to the key.
    key = _key(tmp_path)
    result = tmp_path / "result"
    (result / "sub").mkdir(parents=True)
    for name in ("a.bin", "b.bin", "sub/c.bin"):
        (result / name).write_bytes(b"x" * 10)
    sent = send_dir(result, label=f"job {JOB}", chunk_size=4)
    received = [await anext(sent)]
    os.replace(result / "b.bin", tmp_path / "b.bin")
    os.symlink(key, result / "b.bin")

    # Execute
    with pytest.raises(FileSendRefused, match=r"'b\.bin' is a symbolic link") as err:
        received += [item async for item in sent]

    # Assert
    assert isinstance(err.value, FailedPreconditionError)
    assert all(name in ("a.bin", "") for name, _ in received)
    assert not _leaked([chunk for _, chunk in received])


async def test_a_directory_swapped_for_a_link_after_the_walk_is_refused(tmp_path: Path) -> None:
    # Prepare: sub/ becomes a link to the key's directory, which holds a file of the listed name.
    key = _key(tmp_path)
    os.link(key, key.parent / "c.bin")
    result = tmp_path / "result"
    (result / "sub").mkdir(parents=True)
    (result / "a.bin").write_bytes(b"x")
    (result / "sub" / "c.bin").write_bytes(b"y")
    sent = send_dir(result, chunk_size=4)
    received = [await anext(sent)]
    os.replace(result / "sub", tmp_path / "old-sub")
    os.symlink(key.parent, result / "sub")

    with pytest.raises(FileSendRefused, match="'sub' is a symbolic link"):
        received += [item async for item in sent]

    assert not _leaked([chunk for _, chunk in received])


async def test_a_plain_directory_round_trips_through_the_shared_sender(tmp_path: Path) -> None:
    source, out = _write_result(tmp_path / "result"), tmp_path / "out"

    received = await receive_files(send_dir(source, chunk_size=64 * 1024), out)

    assert files_under(out) == RESULT
    assert [(f.path, f.sha256) for f in received] == sorted(
        (name, hashlib.sha256(data).hexdigest()) for name, data in RESULT.items()
    )
