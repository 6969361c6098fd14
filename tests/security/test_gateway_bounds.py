"""A node attached to a gateway cannot grow the gateway's memory without bound through Hello or Subscribe."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from hypha.net.channel import secure_channel
from hypha.testing.mesh import Mesh
from hypha.testing.pki import Pki
from hypha.v1 import gateway_pb2, gateway_pb2_grpc


@pytest.fixture
async def mesh(pki: Pki) -> AsyncIterator[Mesh]:
    m = Mesh(pki)
    yield m
    await m.close()


async def errors_after(
    pki: Pki, address: str, frames: list[gateway_pb2.ClientFrame], expected: int
) -> list[gateway_pb2.GatewayError]:
    """Send ``frames`` on a Connect stream; the first ``expected`` error frames the gateway answers."""
    async with secure_channel(pki.tls("worker"), address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Connect(timeout=10)
        for frame in frames:
            await call.write(frame)
        errors: list[gateway_pb2.GatewayError] = []
        async with asyncio.timeout(5):
            while len(errors) < expected:
                reply = await call.read()
                assert reply is not grpc.aio.EOF
                if reply.WhichOneof("kind") == "error":
                    errors.append(reply.error)
        call.cancel()
        return errors


async def test_a_hello_with_too_many_or_too_long_addresses_is_refused(mesh: Mesh, pki: Pki) -> None:
    gateway = await mesh.add_gateway("gw-bounds", max_hello_addresses=2, max_hello_chars=64)
    frames = [
        gateway_pb2.ClientFrame(hello=gateway_pb2.Hello(addresses=["10.0.0.1:1"] * 3)),
        gateway_pb2.ClientFrame(hello=gateway_pb2.Hello(addresses=["a" * 65 + ":1"])),
        gateway_pb2.ClientFrame(hello=gateway_pb2.Hello(name="n" * 65)),
        gateway_pb2.ClientFrame(hello=gateway_pb2.Hello(addresses=["10.0.0.1:1", "10.0.0.2:2"], name="ok")),
    ]

    errors = await errors_after(pki, gateway.address, frames, 3)

    assert [e.code for e in errors] == [gateway_pb2.ERROR_CODE_BAD_FRAME] * 3
    assert "max_hello_addresses" in errors[0].message and "max_hello_chars" in errors[1].message
    session = gateway.hub.sessions.get(pki.tls("worker").identity.peer_id)
    # The good Hello after the refusals was taken (or the stream has ended already: never the bad ones).
    assert session is None or session.addresses in ([], ["10.0.0.1:1", "10.0.0.2:2"])


async def test_subscriptions_beyond_the_cap_are_refused_and_not_kept(mesh: Mesh, pki: Pki) -> None:
    gateway = await mesh.add_gateway("gw-subs", max_subscriptions=2)
    frames = [gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic=f"t{i}")) for i in range(4)]
    frames.append(gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic="t0")))  # held: no error

    errors = await errors_after(pki, gateway.address, frames, 2)

    assert all("max_subscriptions" in e.message for e in errors)
    assert set(gateway.hub.topics) <= {"t0", "t1"}
