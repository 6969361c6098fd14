"""A node link whose network fails: the connection reset, or silently cut (a
container taken off its network), then back. Real gateway, real mTLS, a TCP
proxy in between that the test cuts (``tcpproxy``)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hypha.net.auth import peer_identity
from hypha.net.link import NodeLink
from hypha.net.relay import Relay
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.gateway.conftest import Mesh, until
from tests.gateway.tcpproxy import TcpProxy


class Worker(worker_pb2_grpc.WorkerServicer):
    async def GetStatus(self, request: object, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStatus:
        return worker_pb2.WorkerStatus(peer_id=peer_identity(context).peer_id, name="cut")


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the loop's exception handler (destroyed pending tasks, failed closes)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    yield errors
    loop.set_exception_handler(previous)


def stray_stream_errors(errors: list[dict[str, Any]]) -> list[str]:
    """The loop errors a lingering stream task causes: a destroyed pending task, or a generator
    closed while running. (grpc.aio's poller may also report a transient socket error on a busy
    runner; that is not what these tests are about.)"""
    found = []
    for context in errors:
        message = str(context.get("message", ""))
        exception = context.get("exception")
        if "Task was destroyed" in message or "already running" in str(exception or ""):
            found.append(f"{message}: {exception!r}")
    return found


def stream_request_tasks() -> list[asyncio.Task[Any]]:
    """gRPC's tasks that feed a stream call's request iterator (one per live stream)."""
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").endswith("_consume_request_iterator")
    ]


async def test_a_reset_stream_leaves_no_task_or_generator_behind(
    mesh: Mesh, loop_errors: list[dict[str, Any]]
) -> None:
    # Prepare: a worker attached through a proxy.
    (gateway,) = await mesh.full_mesh(1)
    proxy = await TcpProxy(gateway.address).start()
    link = await mesh.add_link("worker", "resets", [proxy.address])
    try:
        # Execute: reset its connection three times; it re-attaches each time.
        for _ in range(3):
            session = gateway.hub.sessions[link.peer_id]
            proxy.reset()
            await until(
                lambda s=session: (
                    gateway.hub.sessions.get(link.peer_id) not in (None, s) and link.connected.is_set()
                ),
                "re-attached",
            )
        gc.collect()  # a stray task would be destroyed here, closing its running generator
        await asyncio.sleep(0)  # let the loop run what the collection scheduled

        # Assert: one live stream task, and nothing reported to the loop.
        assert len(stream_request_tasks()) == 1
        assert stray_stream_errors(loop_errors) == []
    finally:
        await proxy.close()


async def test_a_silently_cut_node_is_noticed_re_attaches_and_serves_relayed_calls_again(
    mesh: Mesh,
) -> None:
    # Prepare: a worker behind a proxy serving over the relay (1 s keepalive), a scheduler calling it.
    (gateway,) = await mesh.full_mesh(1)
    proxy = await TcpProxy(gateway.address).start()
    worker_link = await mesh.add_link("worker", "cut", [proxy.address], keepalive_s=1.0)
    scheduler_link = await mesh.add_link("scheduler", "caller", [gateway.address])
    worker_relay = Relay(worker_link)
    worker_relay.serve([(worker_pb2_grpc.add_WorkerServicer_to_server, Worker(), "hypha.v1.Worker")])
    scheduler_relay = Relay(scheduler_link)
    stub = worker_pb2_grpc.WorkerStub(scheduler_relay.channel(worker_link.peer_id))
    async with worker_relay, scheduler_relay:
        assert (await stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=10)).name == "cut"
        first_session = gateway.hub.sessions[worker_link.peer_id]

        # Execute: cut the path silently (no FIN, no RST), then bring it back.
        proxy.blackhole()
        # Noticed by the keepalive (1 s + its timeout), not by TCP's minutes-long retries.
        await until(lambda: not worker_link.connected.is_set(), "the worker noticed the cut", timeout=10)
        proxy.restore()
        await until(
            lambda: gateway.hub.sessions.get(worker_link.peer_id) not in (None, first_session),
            "the worker re-attached",
        )
        reply = await stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=10)

    # Assert: same identity, calls work again.
    assert worker_link.reconnects >= 1
    assert reply.peer_id == scheduler_link.peer_id and reply.name == "cut"
    await proxy.close()


async def test_a_relayed_call_to_a_peer_not_attached_fails_fast_with_unavailable(mesh: Mesh) -> None:
    # Prepare: two federated gateways, a scheduler on one; the target never attached anywhere.
    gateways = await mesh.full_mesh(2)
    scheduler_link = await mesh.add_link("scheduler", "hasty", [gateways[0].address])
    absent = NodeLink(mesh.pki.issue("worker", "absent"), [gateways[1].address])  # never started
    async with Relay(scheduler_link) as relay:
        stub = worker_pb2_grpc.WorkerStub(relay.channel(absent.peer_id))

        # Execute
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=60)

    # Assert: UNAVAILABLE (retryable) from the gateway's PEER_UNKNOWN, not DEADLINE_EXCEEDED
    # after 60 s (which would also overrun the test's timeout).
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "PEER_UNKNOWN" in (err.value.details() or "")


async def test_a_relayed_call_forwarded_on_stale_presence_fails_fast_with_unavailable(mesh: Mesh) -> None:
    # Prepare: gw0 still believes a worker is attached at gw1 (the worker left, presence lags).
    gateways = await mesh.full_mesh(2)
    scheduler_link = await mesh.add_link("scheduler", "stale", [gateways[0].address])
    gone = NodeLink(mesh.pki.issue("worker", "gone"), [gateways[1].address])  # never started
    gateways[0].hub.remote[gateways[1].peer_id][gone.peer_id] = common_pb2.PeerInfo(peer_id=gone.peer_id)
    async with Relay(scheduler_link) as relay:
        stub = worker_pb2_grpc.WorkerStub(relay.channel(gone.peer_id))

        # Execute: gw0 forwards the call's frames to gw1, which cannot deliver them.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=60)

    # Assert: gw1 bounced them back, and the call ended at once with UNAVAILABLE.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert gateways[1].hub.stats.direct_failed >= 1


async def test_a_reset_federation_link_leaves_no_task_or_generator_behind(
    mesh: Mesh, loop_errors: list[dict[str, Any]]
) -> None:
    # Prepare: gw1 federates with gw0 through a proxy.
    gw0 = await mesh.add_gateway("fed0")
    proxy = await TcpProxy(gw0.address).start()
    gw1 = await mesh.add_gateway("fed1", [proxy.address])
    try:
        # Execute: reset the link three times; it comes back each time. Each link takes two
        # connections: the handshake that learns the peer's identity, then gRPC's.
        for accepted in range(1, 4):
            await until(
                lambda a=accepted: proxy.accepted == 2 * a and gw0.hub.links and gw1.hub.links, "linked"
            )
            proxy.reset()
        await until(lambda: proxy.accepted == 8 and gw0.hub.links and gw1.hub.links, "linked again")
        gc.collect()
        await asyncio.sleep(0)

        # Assert: only the live link's request task, and nothing reported to the loop.
        assert len(stream_request_tasks()) == 1
        assert stray_stream_errors(loop_errors) == []
    finally:
        await proxy.close()
