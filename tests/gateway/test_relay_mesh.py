"""Calls through the relay over real federated gateways: a worker with no
reachable address is fully usable by a scheduler on another gateway."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from hypha.datasets.format import Dataset
from hypha.net.auth import peer_identity
from hypha.net.connector import PeerConnector
from hypha.net.relay import Relay
from hypha.v1 import common_pb2, data_pb2, data_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.gateway.conftest import Mesh, until

BLOB = bytes(range(256)) * (5 * 1024 * 1024 // 256 + 123)  # ~5 MiB, not a multiple of the chunk size
CHUNK = 1024 * 1024


class HiddenWorker(worker_pb2_grpc.WorkerServicer):
    async def GetStatus(self, request: object, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStatus:
        return worker_pb2.WorkerStatus(peer_id=peer_identity(context).peer_id, name="hidden")

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TensorChunk]:
        for offset in range(0, len(BLOB), CHUNK):
            part = BLOB[offset : offset + CHUNK]
            last = offset + CHUNK >= len(BLOB)
            yield worker_pb2.TensorChunk(
                job_id=request.job_id,
                chunk=common_pb2.Chunk(
                    offset=offset,
                    data=part,
                    total_size=len(BLOB),
                    last=last,
                    sha256=hashlib.sha256(BLOB).hexdigest() if last else "",
                ),
            )

    async def PushTensors(
        self, request_iterator: AsyncIterator[worker_pb2.TensorChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        digest = hashlib.sha256()
        async for chunk in request_iterator:
            digest.update(chunk.chunk.data)
        return worker_pb2.PushTensorsResponse(accepted=True, message=digest.hexdigest())


async def test_scheduler_calls_a_worker_without_address_through_the_relay(mesh: Mesh) -> None:
    gateways = await mesh.full_mesh(2)
    worker_link = await mesh.add_link("worker", "hidden", [gateways[1].address])  # advertises no address
    scheduler_link = await mesh.add_link("scheduler", "planner", [gateways[0].address])
    other_worker_link = await mesh.add_link("worker", "peer-worker", [gateways[0].address])
    worker_relay = Relay(worker_link)
    worker_relay.serve([(worker_pb2_grpc.add_WorkerServicer_to_server, HiddenWorker(), "hypha.v1.Worker")])
    scheduler_relay = Relay(scheduler_link)
    peer_relay = Relay(other_worker_link)
    for relay in (worker_relay, scheduler_relay, peer_relay):
        await relay.start()
    await until(lambda: any(worker_link.peer_id in p for p in gateways[0].hub.remote.values()), "presence")
    connector = PeerConnector(mesh.pki.tls("planner"), scheduler_relay)
    try:
        channel = await connector.channel(worker_link.peer_id, [])  # no direct address: relay
        assert not connector.is_direct(worker_link.peer_id)
        stub = worker_pb2_grpc.WorkerStub(channel)
        status = await stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=10)
        assert status.peer_id == scheduler_link.peer_id  # the caller as the worker saw it

        # A streamed payload of several MiB, worker to worker (PS pull), through both gateways.
        peer_stub = worker_pb2_grpc.WorkerStub(peer_relay.channel(worker_link.peer_id))
        received = bytearray()
        async for chunk in peer_stub.PullTensors(worker_pb2.PullTensorsRequest(job_id="j"), timeout=30):
            assert chunk.chunk.offset == len(received)
            received.extend(chunk.chunk.data)
        assert bytes(received) == BLOB

        async def push() -> AsyncIterator[worker_pb2.TensorChunk]:
            for offset in range(0, len(BLOB), CHUNK):
                yield worker_pb2.TensorChunk(
                    chunk=common_pb2.Chunk(offset=offset, data=BLOB[offset : offset + CHUNK])
                )

        reply = await peer_stub.PushTensors(push(), timeout=30)
        assert reply.message == hashlib.sha256(BLOB).hexdigest()

        # The role policy holds through the relay too: a worker may not dispatch jobs.
        try:
            await peer_stub.DispatchJob(worker_pb2.DispatchJobRequest(job_id="j"), timeout=10)
            raise AssertionError("a worker dispatched a job")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await connector.close()
        for relay in (worker_relay, scheduler_relay, peer_relay):
            await relay.stop()


def _attached_data_node(mesh: Mesh, gateway_address: str, data_dir: Path) -> tuple[Any, Dataset]:
    """A real data node (``hypha.data.app.build``) serving a toy dataset, attached to a gateway."""
    from hypha.config.common import NetConfig, TlsConfig
    from hypha.data.app import build
    from hypha.data.config import DataNodeSection, DataNodeSettings
    from tests.data.test_serving import prepare

    toy = prepare(data_dir)
    mesh.pki.issue("data", "data0")
    paths = mesh.pki.paths("data0")
    settings = DataNodeSettings(
        name="data0",
        tls=TlsConfig(cert=paths.cert, key=paths.key, trust=paths.trust),
        net=NetConfig(gateways=[gateway_address]),
        data=DataNodeSection(data_dir=data_dir),
    )
    return build(settings, mesh.pki.tls("data0")), toy


async def test_a_data_node_attaches_to_its_gateways_and_serves_through_the_relay(
    mesh: Mesh, tmp_path: Path
) -> None:
    # Prepare: one gateway, a data node configured with it (net.gateways), a worker's link.
    (gateway,) = await mesh.full_mesh(1)
    node, _ = _attached_data_node(mesh, gateway.address, tmp_path / "data")
    worker_link = await mesh.add_link("worker", "reader", [gateway.address])
    worker_relay = Relay(worker_link)

    # Execute: list the data node's datasets through the gateway, never dialling it.
    async with node, worker_relay:
        await until(lambda: node.peer_id in gateway.hub.sessions, "data node attached")
        stub = data_pb2_grpc.DataNodeStub(worker_relay.channel(node.peer_id))
        reply = await stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=10)

    # Assert
    assert [d.name for d in reply.datasets] == ["toy"]


async def test_a_worker_fetches_pinned_slices_from_a_data_node_it_can_reach_only_through_the_relay(
    mesh: Mesh, tmp_path: Path
) -> None:
    """A relay-only worker (compose's ``worker-relay``, a VM behind NAT) gets its slices: the
    worker's slice fetcher takes its channels from the node's connector, direct else relayed."""
    from hypha.worker.fetcher import ProviderInfo, SliceFetcher

    # Arrange: a data node attached to a gateway, known to the worker only by an address
    # that never resolves (as the relay-only worker knows `data:7400`)
    (gateway,) = await mesh.full_mesh(1)
    node, toy = _attached_data_node(mesh, gateway.address, tmp_path / "data")
    worker_link = await mesh.add_link("worker", "reader", [gateway.address])
    worker_relay = Relay(worker_link)
    connector = PeerConnector(mesh.pki.tls("reader"), worker_relay, connect_timeout_s=2.0)
    provider = ProviderInfo(node.peer_id, ("unresolvable.invalid:7400",), toy.manifest.digest())

    # Execute
    async with node, worker_relay:
        await until(lambda: node.peer_id in gateway.hub.sessions, "data node attached")
        try:
            async with SliceFetcher(mesh.pki.tls("reader"), tmp_path / "cache", peers=connector) as fetcher:
                fetched = [await fetcher.fetch("toy", i, [provider]) for i in range(2)]
        finally:
            await connector.close()

    # Assert: the pinned manifest and both slices came through the gateway, verified
    assert [p.read_bytes() for p in fetched] == [toy.slice_path(i).read_bytes() for i in range(2)]
    assert connector.is_direct(node.peer_id) is None or not connector.is_direct(node.peer_id)
