"""Calls a server runs at once are bounded, in all and per peer (issue 16, item 6).

``net.max_concurrent_rpcs`` is grpcio's ``maximum_concurrent_rpcs``;
``net.max_rpcs_per_peer`` is the server guard's count of one peer id's open
calls. Long-lived streams (Health.Watch here) hold their slot while open.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.testing.pki import Pki
from hypha.testing.polling import eventually
from hypha.v1 import worker_pb2_grpc
from tests.net.test_mtls import EchoWorker, call_status


@contextlib.asynccontextmanager
async def serving(pki: Pki, **limits: int) -> AsyncIterator[NodeServer]:
    server = NodeServer(
        pki.tls("worker"),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, EchoWorker(), "hypha.v1.Worker")],
        **limits,  # type: ignore[arg-type]
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def watches(pki: Pki, name: str, address: str, count: int) -> AsyncIterator[list[object]]:
    """``count`` Health.Watch streams of ``name``, each past its first answer (so open on the server)."""
    async with secure_channel(pki.tls(name), address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(count)]
        for stream in streams:
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING
        try:
            yield streams  # type: ignore[misc]
        finally:
            for stream in streams:
                stream.cancel()


async def served(pki: Pki, address: str) -> bool:
    """Whether a scheduler's call is served now (False while the server is still full)."""
    try:
        return bool((await call_status(pki.tls("scheduler"), address)).peer_id)
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False


async def test_one_peer_holds_at_most_its_share_of_calls(pki: Pki) -> None:
    async with serving(pki, max_rpcs_per_peer=2) as server:
        async with watches(pki, "client", server.address, 2):
            # Execute: a third call of the same peer, and a call of another peer.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call_status(pki.tls("client"), server.address)
            other = await call_status(pki.tls("scheduler"), server.address)
        # Once its streams end, the peer is served again.
        await eventually(lambda: not server.guard.in_flight, timeout=5, message="streams ended")
        again = await call_status(pki.tls("client"), server.address)

    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "net.max_rpcs_per_peer" in (err.value.details() or "")
    assert other.peer_id and again.peer_id
    assert server.guard.refused == {"peer_limit": 1}
    assert server.guard.in_flight == {}


async def test_the_server_runs_at_most_its_bound_of_calls_at_once(pki: Pki) -> None:
    async with serving(pki, max_concurrent_rpcs=2) as server:
        async with watches(pki, "client", server.address, 2):
            # Execute: any further call, whoever makes it.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call_status(pki.tls("scheduler"), server.address)
        again = await eventually(lambda: served(pki, server.address), timeout=5, message="served again")

    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert again
