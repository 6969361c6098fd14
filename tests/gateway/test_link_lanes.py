"""Per-link federation back-pressure: one receiver whose queue is full holds up only its own
direct messages, never the federation link's other traffic (issue 16)."""

from __future__ import annotations

import asyncio

from hypha.gateway.lanes import DirectLanes
from hypha.net.channel import secure_channel
from hypha.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import Mesh, until


async def test_a_full_receiver_does_not_stall_the_federation_link(mesh: Mesh) -> None:
    # Prepare: gw0 - gw1; a sender on gw0; on gw1 a node that reads and a raw stream that never does.
    # Deliveries may wait 60 s for room, far longer than the test lets the fast node wait.
    gw0, gw1 = await mesh.full_mesh(2, queue_size=4, direct_timeout_s=60)
    sender = await mesh.add_link("scheduler", "lane-sender", [gw0.address])
    fast = await mesh.add_link("worker", "lane-fast", [gw1.address])
    inbox = fast.direct("c")
    sloth_tls = mesh.pki.issue("worker", "lane-sloth")
    sloth_id = sloth_tls.identity.peer_id
    async with secure_channel(sloth_tls, gw1.address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Connect()
        await call.write(gateway_pb2.ClientFrame(subscribe=gateway_pb2.Subscribe(topic="t")))
        await until(
            lambda: {sloth_id, fast.peer_id} <= set(gw0.hub.remote.get(gw1.peer_id, {})), "both known at gw0"
        )
        sloth = next(s for s in gw1.hub.sessions.values() if s.peer_id == sloth_id)

        # Execute: fill the sloth's stream and queue, then message the fast node over the same link.
        for _ in range(64):
            await sender.send(sloth_id, b"s" * 256 * 1024, "c")
        await until(lambda: sloth.outbox.full, "the sloth's queue is full", timeout=20)
        await sender.send(fast.peer_id, b"hello", "c")

        # Assert: delivered while the sloth's messages still wait.
        got = await inbox.get(timeout=5)
        assert got.payload == b"hello"
        assert sloth.outbox.full
        call.cancel()


async def test_a_full_lane_bounces_at_once_and_the_lane_ends_when_delivered() -> None:
    class BlockedHub:
        """Deliveries wait until released; bounces are recorded."""

        def __init__(self) -> None:
            self.release = asyncio.Event()
            self.delivered: list[str] = []
            self.bounced: list[gateway_pb2.Bounce] = []

        async def on_forward(self, link: object, forward: gateway_pb2.Forward) -> None:
            await self.release.wait()
            self.delivered.append(forward.delivery.message_id)

        def on_bounce(self, link: object, bounce: gateway_pb2.Bounce) -> None:
            self.bounced.append(bounce)

    hub = BlockedHub()
    link = type("Link", (), {"gateway_id": "gw"})()
    lanes = DirectLanes(hub, link, max_parked=2)  # type: ignore[arg-type]

    def forward(n: int, to: str = "slow") -> gateway_pb2.Forward:
        delivery = gateway_pb2.Delivery(from_peer="s", message_id=f"s/m{n}")
        return gateway_pb2.Forward(to_peer=to, delivery=delivery)

    lanes.submit(forward(0))
    await until(lambda: lanes.parked("slow") == 0, "the lane delivering m0")
    for n in (1, 2, 3):
        lanes.submit(forward(n))  # m1 and m2 are parked, m3 overflows

    assert [b.error.message_id for b in hub.bounced] == ["m3"]
    assert hub.bounced[0].to_peer == "s" and "busy" in hub.bounced[0].error.message
    hub.release.set()
    await until(lambda: hub.delivered == ["s/m0", "s/m1", "s/m2"], "delivered in order")
    await until(lambda: lanes.parked("slow") is None, "the lane ended")
