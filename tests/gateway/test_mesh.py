"""Pub/sub, direct messages and federation across real gateways (in-process, real TLS)."""

from __future__ import annotations

import asyncio
import collections

from hypha.net.link import Subscription
from hypha.pki.identity import Role
from hypha.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import Mesh, until


async def drain(sub: Subscription, count: int, timeout: float = 10) -> list[bytes]:
    got: list[bytes] = []
    async with asyncio.timeout(timeout):
        while len(got) < count:
            got.append((await sub.get()).payload)
    return got


async def test_every_publish_reaches_every_subscriber_exactly_once(mesh: Mesh) -> None:
    gateways = await mesh.full_mesh(3)
    links = [await mesh.add_link("worker", f"n{i}", [gateways[i % 3].address]) for i in range(20)]
    subs = [link.subscribe("t") for link in links]
    await until(lambda: sum(len(g.hub.topics.get("t", ())) for g in gateways) == 20, "all subscribed")
    publishers = links[:3]  # one on each gateway
    for p, link in enumerate(publishers):
        for k in range(5):
            await link.publish("t", f"{p}:{k}".encode())
    for i, sub in enumerate(subs):
        expected = 15 - (5 if links[i] in publishers else 0)
        got = await drain(sub, expected)
        # A fence published after everything else; once it arrives, no late duplicate may follow it.
        counts = collections.Counter(got)
        assert all(c == 1 for c in counts.values()), counts
        assert len(counts) == expected
    fence_from = links[19]
    await fence_from.publish("t", b"fence")
    for i, sub in enumerate(subs[:19]):
        assert (await sub.get(timeout=10)).payload == b"fence"
        assert sub.queue.empty(), f"subscriber {i} got an extra message"


async def test_direct_message_reaches_a_peer_on_another_gateway_with_the_stamped_sender(mesh: Mesh) -> None:
    gateways = await mesh.full_mesh(3)
    alice = await mesh.add_link("scheduler", "alice", [gateways[0].address])
    bob = await mesh.add_link("worker", "bob", [gateways[2].address])
    inbox = bob.direct("chat")
    await until(lambda: any(bob.peer_id in peers for peers in gateways[0].hub.remote.values()), "presence")
    await alice.send(bob.peer_id, b"hello bob", "chat")
    message = await inbox.get(timeout=10)
    assert message.payload == b"hello bob"
    assert message.from_peer == alice.peer_id  # stamped from alice's TLS session
    assert message.from_role == Role.SCHEDULER
    assert message.direct


async def test_direct_message_to_an_unknown_peer_returns_an_error_frame(mesh: Mesh) -> None:
    (gw,) = await mesh.full_mesh(1)
    alice = await mesh.add_link("scheduler", "alice2", [gw.address])
    await alice.send("nobody", b"x", "chat")
    await until(
        lambda: any(e.code == gateway_pb2.ERROR_CODE_PEER_UNKNOWN for e in alice.errors), "error frame"
    )


async def test_oversized_payload_is_refused_with_an_error_frame(mesh: Mesh) -> None:
    (gw,) = await mesh.full_mesh(1, max_payload_bytes=4096)
    alice = await mesh.add_link("scheduler", "alice3", [gw.address])
    sub_link = await mesh.add_link("worker", "listener", [gw.address])
    sub = sub_link.subscribe("t")
    await until(lambda: gw.hub.topics.get("t"), "subscribed")
    await alice.publish("t", b"x" * 5000)
    await alice.publish("t", b"small")
    await until(
        lambda: any(e.code == gateway_pb2.ERROR_CODE_FRAME_TOO_LARGE for e in alice.errors), "refusal"
    )
    assert (await sub.get(timeout=10)).payload == b"small"


async def test_a_slow_subscriber_does_not_stall_the_others(mesh: Mesh) -> None:
    (gw,) = await mesh.full_mesh(1, queue_size=8)
    publisher = await mesh.add_link("scheduler", "pub", [gw.address])
    fast = await mesh.add_link("worker", "fast", [gw.address])
    fast_sub = fast.subscribe("t", maxsize=10_000)
    # A raw stream that subscribes and then never reads.
    tls = mesh.pki.issue("worker", "sloth")
    from hypha.net.channel import secure_channel

    async with secure_channel(tls, gw.address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Connect()
        await call.write(gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic="t")))
        await until(lambda: len(gw.hub.topics.get("t", ())) == 2, "both subscribed")
        payload = b"p" * 32 * 1024
        for _ in range(300):
            await publisher.publish("t", payload)
        got = await drain(fast_sub, 300, timeout=20)
        assert len(got) == 300
        slow = next(s for s in gw.hub.sessions.values() if s.name == "sloth")
        assert slow.outbox.dropped > 0
        call.cancel()


async def test_node_fails_over_to_the_next_gateway_and_resubscribes(mesh: Mesh) -> None:
    gateways = await mesh.full_mesh(2)
    node = await mesh.add_link("worker", "roamer", [gateways[0].address, gateways[1].address])
    publisher = await mesh.add_link("scheduler", "caster", [gateways[1].address])
    sub = node.subscribe("t")
    await until(lambda: gateways[0].hub.topics.get("t"), "subscribed on gw0")
    await gateways[0].stop()
    await until(lambda: node.connected.is_set() and node.gateway_id == gateways[1].peer_id, "failed over")
    await until(lambda: gateways[1].hub.topics.get("t"), "resubscribed on gw1")
    for k in range(10):
        await publisher.publish("t", f"after-{k}".encode())
    assert await drain(sub, 10) == [f"after-{k}".encode() for k in range(10)]
