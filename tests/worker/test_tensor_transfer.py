"""Worker <-> worker tensor payloads over real mTLS servers (and the relay): whole, verified, or nothing."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hypha.bridge_client import BridgeClient
from hypha.errors import NotFoundError, UnavailableError
from hypha.filestamp import FileStamp
from hypha.market.resources import ExecutorKind
from hypha.net.connector import PeerConnector
from hypha.net.relay import Relay
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import Role
from hypha.tensors.chunks import split_payload
from hypha.tensors.payload import CONTENT_TYPE, decode_state, encode_state
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hypha.worker import tensor_files
from hypha.worker.bridge import BridgeContext, JobBridge
from hypha.worker.execution_state import ExecutionRecord, JobDispatch
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.jobs_servicer import WorkerJobs, WorkerJobsMixin
from hypha.worker.scheduler_link import LogForwarder
from hypha.worker.tensor_frames import add_worker_servicer
from hypha.worker.transfer import TensorExchange, TransferSettings
from tests.conftest import Pki
from tests.helpers import eventually
from tests.net.fakelink import FakeNetwork
from tests.worker.fakes import FakeSchedulerLink

JOB = "job-t"
FAST_RETRY = TransferSettings(backoff_base_s=0.01, backoff_cap_s=0.05)


class JobsWorker(WorkerJobsMixin, worker_pb2_grpc.WorkerServicer):
    """The job half of the worker's servicer, wired the way the worker composes it."""

    def __init__(self, jobs: WorkerJobs) -> None:
        self.jobs = jobs


class BrokenFirstAttempt(TensorExchange):
    """Named fault: the first push stream stops after two chunks, as if the connection died."""

    def _outgoing(self, attempt: int, messages: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        if attempt > 0:
            return messages

        async def cut() -> AsyncIterator[bytes]:
            sent = 0
            async for message in messages:
                yield message
                sent += 1
                if sent == 2:
                    return

        return cut()


@dataclass
class Node:
    tls: TlsMaterial
    exchange: TensorExchange
    server: NodeServer
    connector: PeerConnector

    @property
    def peer_id(self) -> str:
        return self.tls.identity.peer_id


async def start_node(tls: TlsMaterial, tmp_path: Path, exchange: TensorExchange) -> Node:
    manager = JobManager(
        JobsSection(), tmp_path, exchange=exchange, link_factory=lambda d: FakeSchedulerLink()
    )
    jobs = WorkerJobs(manager, exchange, lease_ok=lambda lease, scheduler: True)
    server = NodeServer(
        tls,
        "127.0.0.1:0",
        [(add_worker_servicer, JobsWorker(jobs), "hypha.v1.Worker")],
    )
    await server.start()
    connector = PeerConnector(tls, None)
    exchange.connector = connector
    return Node(tls, exchange, server, connector)


@pytest.fixture
async def pair(pki: Pki, tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    """Worker A (a trainer's side) and worker B (the parameter server's side), both serving."""
    a = await start_node(pki.tls("worker"), tmp_path / "a", BrokenFirstAttempt(None, FAST_RETRY))
    b = await start_node(pki.issue("worker", "worker-b"), tmp_path / "b", TensorExchange(None, FAST_RETRY))
    b.exchange.open_job(JOB)
    a.exchange.open_job(JOB)
    yield a, b
    for node in (a, b):
        await node.connector.close()
        await node.server.stop(0)


def write_state(path: Path, megabytes: int, seed: int = 0) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    state = {
        "w": torch.randn(megabytes * 1024 * 1024 // 4, generator=generator),
        "step": torch.tensor([seed]),
    }
    payload = encode_state(state)
    path.write_bytes(payload)
    return payload


async def test_a_broken_push_is_never_queued_and_the_retry_arrives_bit_identical(
    pair: tuple[Node, Node], tmp_path: Path
) -> None:
    # Prepare: a multi-MiB delta; A's first stream dies after two chunks
    a, b = pair
    payload = write_state(tmp_path / "delta.safetensors", megabytes=5)

    # Execute
    accepted, message = await a.exchange.send(
        JOB, b.peer_id, [b.server.address], "delta", 3, 128, tmp_path / "delta.safetensors"
    )
    received = await b.exchange.next_received(JOB, "delta", timeout_s=5)
    nothing_more = await b.exchange.next_received(JOB, "delta", timeout_s=0.2)

    # Assert: one refusal, one retry, exactly one complete payload
    assert (accepted, message) == (True, "queued")
    assert a.exchange.stats["send_retries"] == 1
    assert b.exchange.stats["refused"] == 1 and b.exchange.stats["received"] == 1
    assert received is not None and nothing_more is None
    assert received.data == payload
    assert (received.from_peer, received.kind, received.round, received.samples) == (
        a.peer_id,
        "delta",
        3,
        128,
    )
    assert torch.equal(decode_state(received.data)["w"], decode_state(payload)["w"])


async def test_a_stream_with_a_wrong_checksum_is_refused(pair: tuple[Node, Node]) -> None:
    a, b = pair
    payload = encode_state({"w": torch.ones(300_000)})
    chunks = list(split_payload(payload, chunk_size=256 * 1024, content_type=CONTENT_TYPE))
    chunks[-1].sha256 = "0" * 64

    async def stream() -> AsyncIterator[worker_pb2.TensorChunk]:
        for i, chunk in enumerate(chunks):
            yield (
                worker_pb2.TensorChunk(job_id=JOB, kind="delta", round=1, chunk=chunk)
                if i == 0
                else (worker_pb2.TensorChunk(chunk=chunk))
            )

    stub = worker_pb2_grpc.WorkerStub(await a.connector.channel(b.peer_id, [b.server.address]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PushTensors(stream(), timeout=10)

    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert await b.exchange.next_received(JOB, "delta", timeout_s=0.2) is None


async def test_a_push_for_a_job_not_here_is_answered_not_queued(
    pair: tuple[Node, Node], tmp_path: Path
) -> None:
    a, b = pair
    write_state(tmp_path / "d.safetensors", megabytes=1)

    accepted, message = await a.exchange.send(
        "no-such-job", b.peer_id, [b.server.address], "delta", 0, 1, tmp_path / "d.safetensors"
    )

    assert not accepted and message.startswith("NOT_FOUND")


async def test_pull_waits_until_the_round_is_published(pair: tuple[Node, Node], tmp_path: Path) -> None:
    # Prepare: A asks B for round 2's update before B has it
    a, b = pair
    payload = write_state(tmp_path / "update-2.safetensors", megabytes=3, seed=2)
    pull = asyncio.create_task(
        a.exchange.fetch(JOB, b.peer_id, [b.server.address], "update", 2, timeout_s=20)
    )
    await eventually(lambda: b.exchange.pulls_waiting == 1, timeout=10, message="pull waiting at B")
    assert not pull.done()

    # Execute: B publishes round 2
    await b.exchange.publish(JOB, "update", 2, tmp_path / "update-2.safetensors")
    received = await asyncio.wait_for(pull, 10)

    # Assert
    assert received is not None and received.data == payload
    assert (received.round, received.kind, received.from_peer) == (2, "update", b.peer_id)


async def test_pull_of_global_serves_the_newest_and_times_out_politely(
    pair: tuple[Node, Node], tmp_path: Path
) -> None:
    a, b = pair
    for round in (4, 5):
        write_state(tmp_path / f"global-{round}.safetensors", megabytes=1, seed=round)
        await b.exchange.publish(JOB, "global", round, tmp_path / f"global-{round}.safetensors")

    latest = await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "global", 0, timeout_s=10)
    missing = await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "update", 9, timeout_s=0.5)

    assert latest is not None and latest.round == 5
    assert latest.data == (tmp_path / "global-5.safetensors").read_bytes()
    assert missing is None


class CountingSha256:
    """``hashlib`` as ``tensor_files`` sees it, counting the bytes its sha256 objects take."""

    def __init__(self) -> None:
        self.hashed = 0

    def sha256(self) -> Any:
        counter, digest = self, hashlib.sha256()

        class Counted:
            def update(self, data: bytes) -> None:
                counter.hashed += len(data)
                digest.update(data)

            def hexdigest(self) -> str:
                return digest.hexdigest()

        return Counted()

    def file_digest(self, handle: Any, name: str) -> Any:
        counted = self.sha256()
        while block := handle.read(1 << 20):
            counted.update(block)
        return counted


async def test_a_published_file_is_hashed_once_for_all_its_pullers(
    pair: tuple[Node, Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: B publishes a 3 MiB global state; its file reads and hashes are counted
    a, b = pair
    counting = CountingSha256()
    monkeypatch.setattr(tensor_files, "hashlib", counting)
    path = tmp_path / "global-3.safetensors"
    payload = write_state(path, megabytes=3, seed=3)
    await b.exchange.publish(JOB, "global", 3, path)

    # Execute: three trainers pull it at once, then one more after them
    pulls = [
        a.exchange.fetch(JOB, b.peer_id, [b.server.address], "global", 3, timeout_s=20) for _ in range(3)
    ]
    received = [*await asyncio.gather(*pulls)]
    received.append(await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "global", 3, timeout_s=20))

    # Assert: every pull verified the same bytes; B hashed the file once, not once per pull
    assert all(got is not None and got.data == payload for got in received)
    assert counting.hashed == len(payload)


async def test_a_published_file_the_page_cache_lost_is_read_in_a_thread_and_arrives_whole(
    pair: tuple[Node, Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: B publishes a 2 MiB state; nothing of it is in the page cache any more
    a, b = pair
    path = tmp_path / "global-8.safetensors"
    payload = write_state(path, megabytes=2, seed=8)
    await b.exchange.publish(JOB, "global", 8, path)
    asked: list[int] = []

    def uncached(fd: int, size: int, offset: int) -> None:
        asked.append(offset)
        return None

    monkeypatch.setattr(tensor_files, "read_cached", uncached)

    # Execute
    got = await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "global", 8, timeout_s=20)

    # Assert: every block was first looked for in the cache, then read from the file, in order
    assert got is not None and got.data == payload
    assert asked == list(range(0, len(payload), 1 << 20))


async def test_a_published_file_rewritten_in_place_is_served_as_it_is_now(
    pair: tuple[Node, Node], tmp_path: Path
) -> None:
    # Prepare: B publishes an update and serves it once (its digest is taken)
    a, b = pair
    path = tmp_path / "update-6.safetensors"
    write_state(path, megabytes=1, seed=6)
    await b.exchange.publish(JOB, "update", 6, path)
    first = await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "update", 6, timeout_s=20)
    assert first is not None

    # Execute: the job rewrites the same file with other bytes of the same size (mtime moves on)
    before = path.stat()
    rewritten = write_state(path, megabytes=1, seed=7)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    again = await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "update", 6, timeout_s=5)

    # Assert: the stale digest was not sent with the new bytes (the pull would fail DATA_LOSS
    # until it timed out); the file was hashed as it streamed
    assert again is not None and again.data == rewritten != first.data


async def test_a_digest_of_a_file_that_changed_while_it_was_hashed_is_never_given(tmp_path: Path) -> None:
    path = tmp_path / "theta.safetensors"
    path.write_bytes(b"x" * 1000)
    stamp = FileStamp.of(path.stat())
    other = stamp._replace(mtime_ns=stamp.mtime_ns + 1)

    with pytest.raises(UnavailableError, match="changed while it was hashed"):
        await tensor_files.SharedDigest(path, other).hexdigest()
    good = await tensor_files.SharedDigest.of(path)
    assert await good.hexdigest() == hashlib.sha256(b"x" * 1000).hexdigest()
    with pytest.raises(NotFoundError):
        await tensor_files.SharedDigest.of(tmp_path / "gone.safetensors")


@pytest.mark.parametrize("spooled", [False, True], ids=["in-memory", "spooled"])
async def test_executors_exchange_tensors_through_their_bridges(
    pair: tuple[Node, Node], tmp_path: Path, spooled: bool
) -> None:
    # Prepare: a trainer's bridge on A (knowing the PS's address) and the PS's bridge on B;
    # "spooled": both keep at most 1 MiB in memory, so the 2 MiB payloads go through spool files
    a, b = pair
    if spooled:
        for node in (a, b):
            node.exchange.settings = replace(
                node.exchange.settings, memory_payload_bytes=1 << 20, spool_dir=tmp_path / "spool"
            )
    spec = common_pb2.JobSpec(diloco=common_pb2.DilocoJobSpec(dataset="tiny"))
    trainer = JobDispatch(
        JOB,
        "l",
        ExecutorKind.DILOCO_TRAINER,
        spec,
        "s",
        parameter_server_id=b.peer_id,
        parameter_server_addresses=(b.server.address,),
    )
    ps = JobDispatch(JOB, "l", ExecutorKind.PARAMETER_SERVER, spec, "s", trainer_ids=(a.peer_id,))
    bridges, clients, links = [], [], []
    for node, dispatch, name in ((a, trainer, "trainer"), (b, ps, "ps")):
        work_dir = tmp_path / name
        work_dir.mkdir(mode=0o700)
        link = FakeSchedulerLink()
        links.append(link)
        bridge = JobBridge(
            BridgeContext(
                dispatch, work_dir, ExecutionRecord(JOB, name), link, node.exchange, LogForwarder(link, JOB)
            )
        )
        clients.append(BridgeClient(await bridge.start()))
        bridges.append(bridge)
    trainer_client, ps_client = clients
    try:
        delta = write_state(tmp_path / "trainer" / "delta.safetensors", megabytes=2, seed=7)
        update = write_state(tmp_path / "ps" / "update.safetensors", megabytes=2, seed=8)

        # Execute: trainer sends its delta; the PS takes it from its inbox and publishes the update
        accepted, _ = await trainer_client.send_tensors(b.peer_id, "delta", 1, 64, "delta.safetensors")
        got = await ps_client.inbox("delta", timeout_s=10)
        await ps_client.publish_tensors("update", 1, "update.safetensors")
        pulled = await trainer_client.fetch_tensors(b.peer_id, "update", 1, timeout_s=10)
        empty = await ps_client.inbox("delta", timeout_s=0.1)
        await trainer_client.metrics(1, {"loss": 1.0})
        await ps_client.metrics(1, {"samples": 64.0})
    finally:
        for client in clients:
            await client.close()
        for bridge in bridges:
            await bridge.stop()

    # Assert
    assert accepted
    assert got is not None and got.data == delta
    assert (got.from_peer, got.round, got.samples) == (a.peer_id, 1, 64)
    assert pulled == update
    assert empty is None
    # The worker measured the job's bytes on the wire and added them to the trainer's metrics:
    # payloads plus chunk headers and gRPC framing (a few hundred bytes), and the push counts
    # what really went out: A's first attempt broke after two 1 MiB chunks, then all of it.
    figures = dict(links[0].metrics_reports[0].values)
    sent = len(delta) + 2 * 1024 * 1024
    assert sent < figures["tensor_bytes_pushed"] < sent + 1024
    assert len(update) < figures["tensor_bytes_pulled"] < len(update) + 1024
    assert figures["loss"] == 1.0
    # The PS opened no stream: nothing of its own to add (each byte is counted once, by its opener).
    assert dict(links[1].metrics_reports[0].values) == {"samples": 64.0}
    # Every spool file was handed to its consumer and deleted once used.
    if spooled:
        assert (tmp_path / "spool").is_dir() and not list((tmp_path / "spool").iterdir())


async def test_push_through_the_relay_when_no_address_answers(pki: Pki, tmp_path: Path) -> None:
    # Prepare: B serves only over the relay; A knows no address for it
    network = FakeNetwork(queue_size=64)
    a_tls, b_tls = pki.tls("worker"), pki.issue("worker", "worker-b")
    b_exchange = TensorExchange(None)
    b_exchange.open_job(JOB)
    manager = JobManager(
        JobsSection(), tmp_path / "b", exchange=b_exchange, link_factory=lambda d: FakeSchedulerLink()
    )
    b_relay = Relay(network.link(b_tls.identity.peer_id, Role.WORKER))
    b_relay.serve(
        [
            (
                add_worker_servicer,
                JobsWorker(WorkerJobs(manager, b_exchange, lease_ok=lambda lease, s: True)),
                "hypha.v1.Worker",
            )
        ]
    )
    a_relay = Relay(network.link(a_tls.identity.peer_id, Role.WORKER))
    for relay in (a_relay, b_relay):
        await relay.start()
    a_exchange = TensorExchange(PeerConnector(a_tls, a_relay), FAST_RETRY)
    payload = write_state(tmp_path / "delta.safetensors", megabytes=3, seed=3)
    try:
        # Execute
        accepted, _ = await a_exchange.send(
            JOB, b_tls.identity.peer_id, [], "delta", 2, 10, tmp_path / "delta.safetensors"
        )
        received = await b_exchange.next_received(JOB, "delta", timeout_s=10)
    finally:
        for relay in (a_relay, b_relay):
            await relay.stop()

    # Assert
    assert accepted
    assert received is not None and received.data == payload
    assert received.from_peer == a_tls.identity.peer_id


async def test_only_the_dispatching_scheduler_moves_a_parameter_server_state(
    pki: Pki, pair: tuple[Node, Node], tmp_path: Path
) -> None:
    # Prepare: B holds the job's inbox but runs no parameter server a scheduler dispatched.
    a, b = pair
    write_state(tmp_path / "state.safetensors", megabytes=1)
    scheduler = PeerConnector(pki.tls("scheduler"), None)
    stub = worker_pb2_grpc.WorkerStub(await scheduler.channel(b.peer_id, [b.server.address]))
    payload = encode_state({"w": torch.ones(8)})

    async def push(kind: str) -> AsyncIterator[worker_pb2.TensorChunk]:
        for chunk in split_payload(payload, content_type=CONTENT_TYPE):
            yield worker_pb2.TensorChunk(job_id=JOB, kind=kind, round=1, chunk=chunk)

    try:
        # Execute / Assert: a worker may not send a state (or a model); a scheduler moves nothing
        # else, and those only to a parameter server (inference execution) it dispatched there.
        for kind in ("ps-state", "model"):  # a state, or an inference job's model
            accepted, message = await a.exchange.send(
                JOB, b.peer_id, [b.server.address], kind, 1, 0, tmp_path / "state.safetensors"
            )
            assert not accepted and message.startswith("PERMISSION_DENIED"), message
        for kind in ("delta", "ps-state", "model"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PushTensors(push(kind), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, kind
        pull = stub.PullTensors(
            worker_pb2.PullTensorsRequest(job_id=JOB, kind="ps-state", round=1), timeout=10
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pull.read()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert await b.exchange.next_received(JOB, "ps-state", timeout_s=0.2) is None
    finally:
        await scheduler.close()
