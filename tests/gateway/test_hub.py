"""The gateway's routing core on its own: who is attached, who hears a publish, where a direct
message goes, and what a slow or gone receiver costs. The hub knows nothing of gRPC, so these
tests drive it with real ``Outbox`` queues and read what each stream would send."""

from __future__ import annotations

import asyncio

from hypha.gateway.hub import FederationOut, Hub, Link, ServerOut, Session, hello_problem
from hypha.gateway.outbox import Outbox
from hypha.pki.identity import Role, role_to_proto
from hypha.v1 import common_pb2, gateway_pb2

PEER_UNKNOWN = gateway_pb2.ERROR_CODE_PEER_UNKNOWN


def session(peer_id: str, role: Role = Role.WORKER, size: int = 64) -> Session:
    return Session(peer_id, role, Outbox(size, peer_id), name=f"{peer_id}-name", cert_serial=0x1234)


def link(gateway_id: str, size: int = 64) -> Link:
    return Link(gateway_id, Outbox(size, f"link {gateway_id}"))


async def sent(outbox: Outbox[ServerOut]) -> list[gateway_pb2.ServerFrame]:
    """Every frame queued on a node's stream (pre-encoded ones parsed); ends the stream."""
    outbox.close()
    frames: list[gateway_pb2.ServerFrame] = []
    async with asyncio.timeout(5):
        async for frame in outbox.frames():
            frames.append(
                frame if not isinstance(frame, bytes) else gateway_pb2.ServerFrame.FromString(frame)
            )
    return frames


async def sent_over(outbox: Outbox[FederationOut]) -> list[gateway_pb2.FederationFrame]:
    """Every frame queued on a federation link (pre-encoded ones parsed); ends the link."""
    outbox.close()
    frames: list[gateway_pb2.FederationFrame] = []
    async with asyncio.timeout(5):
        async for frame in outbox.frames():
            if isinstance(frame, bytes):
                frame = gateway_pb2.FederationFrame.FromString(frame)
            frames.append(frame)
    return frames


def payloads(frames: list[gateway_pb2.ServerFrame]) -> list[bytes]:
    return [f.delivery.payload for f in frames if f.WhichOneof("kind") == "delivery"]


def publish(hub: Hub, sender: Session, payload: bytes, topic: str = "t", message_id: str = "") -> str:
    return hub.publish(sender, gateway_pb2.Publish(topic=topic, payload=payload, message_id=message_id))


# ---- attach / detach ------------------------------------------------------------------------


async def test_attach_and_detach_are_announced_to_every_link() -> None:
    # Prepare
    hub = Hub("gw")
    peer = link("other")
    hub.add_link(peer)
    alice = session("alice")

    # Execute
    hub.attach(alice)
    hub.detach(alice)

    # Assert: full presence on link-up, then alice attached (with her info), then detached.
    frames = await sent_over(peer.outbox)
    presences = [f.presence for f in frames]
    assert presences[0].full and presences[0].gateway_id == "gw"
    assert [p.peer_id for p in presences[1].attached] == ["alice"]
    assert presences[1].attached[0].gateway_id == "gw" and presences[1].attached[0].name == "alice-name"
    assert list(presences[2].detached) == ["alice"]
    assert hub.sessions == {} and alice.outbox.closed


async def test_a_reconnect_replaces_the_old_stream_and_its_late_detach_changes_nothing() -> None:
    # Prepare: alice is attached and subscribed.
    hub = Hub("gw")
    old = session("alice")
    hub.attach(old)
    hub.subscribe(old, "t")

    # Execute: she reconnects on a new stream, then the old stream's handler finally ends.
    new = session("alice")
    hub.attach(new)
    hub.detach(old)

    # Assert: the old stream is closed and its subscriptions gone; the new one is the session.
    assert old.outbox.closed and not new.outbox.closed
    assert hub.sessions["alice"] is new
    assert "t" not in hub.topics
    bob = session("bob")
    hub.attach(bob)
    hub.subscribe(new, "t")
    publish(hub, bob, b"hi")
    assert payloads(await sent(new.outbox)) == [b"hi"]


# ---- subscriptions ----------------------------------------------------------------------------


def test_the_subscription_limit_refuses_new_topics_but_not_held_ones() -> None:
    hub = Hub("gw")
    alice = session("alice")
    hub.attach(alice)

    assert hub.subscribe(alice, "a", limit=2) is None
    assert hub.subscribe(alice, "b", limit=2) is None
    refusal = hub.subscribe(alice, "c", limit=2)

    assert refusal is not None and "at most 2" in refusal
    assert hub.subscribe(alice, "a", limit=2) is None  # already held: no new cost
    assert alice.topics == {"a", "b"} and set(hub.topics) == {"a", "b"}


def test_unsubscribing_the_last_member_forgets_the_topic() -> None:
    hub = Hub("gw")
    alice, bob = session("alice"), session("bob")
    for s in (alice, bob):
        hub.attach(s)
        hub.subscribe(s, "t")

    hub.unsubscribe(alice, "t")
    assert hub.topics == {"t": {"bob"}}
    hub.unsubscribe(bob, "t")
    hub.unsubscribe(bob, "never-held")  # harmless

    assert hub.topics == {}


# ---- publish ------------------------------------------------------------------------------------


async def test_a_publish_reaches_subscribers_but_not_the_sender_or_other_topics() -> None:
    # Prepare
    hub = Hub("gw")
    sender, listener, elsewhere = session("sender", Role.SCHEDULER), session("listener"), session("other")
    for s in (sender, listener, elsewhere):
        hub.attach(s)
    hub.subscribe(sender, "t")
    hub.subscribe(listener, "t")
    hub.subscribe(elsewhere, "u")

    # Execute
    message_id = publish(hub, sender, b"hello", message_id="m1")

    # Assert: one delivery, stamped with the sender's authenticated identity.
    (frame,) = await sent(listener.outbox)
    assert frame.delivery.payload == b"hello" and frame.delivery.topic == "t"
    assert frame.delivery.from_peer == "sender"
    assert frame.delivery.from_role == role_to_proto(Role.SCHEDULER)
    assert frame.delivery.from_cert_serial == (0x1234).to_bytes(2, "big")
    assert message_id == frame.delivery.message_id == "sender/m1"
    assert await sent(sender.outbox) == [] and await sent(elsewhere.outbox) == []
    assert (hub.stats.published, hub.stats.delivered, hub.stats.topic_bytes) == (1, 1, 5)


async def test_message_ids_are_namespaced_by_sender_and_repeats_are_dropped() -> None:
    hub = Hub("gw")
    alice, mallory, listener = session("alice"), session("mallory"), session("listener")
    for s in (alice, mallory, listener):
        hub.attach(s)
    hub.subscribe(listener, "t")

    publish(hub, mallory, b"first", message_id="same")  # mallory cannot pre-empt alice's id
    publish(hub, alice, b"second", message_id="same")
    publish(hub, alice, b"again", message_id="same")  # a true repeat
    publish(hub, alice, b"x")
    publish(hub, alice, b"y")  # no id given: the gateway numbers them, so both pass

    assert payloads(await sent(listener.outbox)) == [b"first", b"second", b"x", b"y"]
    assert hub.stats.duplicates == 1


async def test_a_full_subscriber_loses_only_its_own_frames() -> None:
    # Prepare: one subscriber with room for a single frame, one with plenty.
    hub = Hub("gw")
    sender, slow, fast = session("sender"), session("slow", size=1), session("fast")
    for s in (sender, slow, fast):
        hub.attach(s)
    hub.subscribe(slow, "t")
    hub.subscribe(fast, "t")

    # Execute
    for i in range(3):
        publish(hub, sender, f"m{i}".encode())

    # Assert: the slow one got the first and lost the rest (counted); the fast one got all three.
    assert slow.outbox.dropped == 2 and hub.stats.dropped == 2
    assert payloads(await sent(fast.outbox)) == [b"m0", b"m1", b"m2"]
    assert hub.stats.delivered == 4


async def test_a_publish_is_forwarded_to_every_link_but_the_one_it_came_from() -> None:
    # Prepare: links to three gateways; a frame arrives over the link from "b", originating at "a".
    hub = Hub("gw")
    to_a, to_b, to_c = link("a"), link("b"), link("c")
    for each in (to_a, to_b, to_c):
        hub.add_link(each)
    listener = session("listener")
    hub.attach(listener)
    hub.subscribe(listener, "t")
    delivery = gateway_pb2.Delivery(from_peer="remote", topic="t", payload=b"p", message_id="remote/1")
    forward = gateway_pb2.Forward(message_id="remote/1", origin_gateway="a", hops=1, delivery=delivery)

    # Execute: it arrives twice (a mesh has more than one path).
    await hub.on_forward(to_b, forward)
    await hub.on_forward(to_c, forward)

    # Assert: delivered once locally, passed on only to "c" with one more hop.
    assert payloads(await sent(listener.outbox)) == [b"p"]
    forwarded = {
        name: [f.forward for f in await sent_over(each.outbox) if f.WhichOneof("kind") == "forward"]
        for name, each in (("a", to_a), ("b", to_b), ("c", to_c))
    }
    assert forwarded["a"] == [] and forwarded["b"] == []
    assert [(f.hops, f.origin_gateway, f.delivery.payload) for f in forwarded["c"]] == [(2, "a", b"p")]
    assert hub.stats.duplicates == 1


async def test_the_hop_limit_stops_forwarding_but_not_local_delivery() -> None:
    hub = Hub("gw", hop_limit=2)
    onward = link("c")
    hub.add_link(onward)
    listener = session("listener")
    hub.attach(listener)
    hub.subscribe(listener, "t")
    delivery = gateway_pb2.Delivery(from_peer="remote", topic="t", payload=b"p", message_id="remote/1")

    await hub.on_forward(link("b"), gateway_pb2.Forward(origin_gateway="a", hops=2, delivery=delivery))

    assert payloads(await sent(listener.outbox)) == [b"p"]
    assert [f for f in await sent_over(onward.outbox) if f.WhichOneof("kind") == "forward"] == []
    assert hub.stats.hop_limited == 1


# ---- direct -------------------------------------------------------------------------------------


async def test_a_direct_message_reaches_a_local_peer_as_a_stamped_delivery() -> None:
    hub = Hub("gw")
    alice, bob = session("alice", Role.SCHEDULER), session("bob")
    hub.attach(alice)
    hub.attach(bob)

    error = await hub.send(alice, gateway_pb2.Send(to_peer="bob", channel="c", payload=b"hi", message_id="7"))

    assert error is None
    (frame,) = await sent(bob.outbox)
    assert frame.delivery.payload == b"hi" and frame.delivery.direct and frame.delivery.topic == "c"
    assert (frame.delivery.from_peer, frame.delivery.message_id) == ("alice", "alice/7")
    assert hub.stats.direct_bytes == 2


async def test_a_direct_message_to_nobody_known_is_an_error_for_the_sender() -> None:
    hub = Hub("gw")
    alice = session("alice")
    hub.attach(alice)

    error = await hub.send(alice, gateway_pb2.Send(to_peer="ghost", payload=b"x", message_id="9"))

    assert error is not None
    assert (error.code, error.message_id) == (PEER_UNKNOWN, "9")
    assert "ghost" in error.message
    assert hub.stats.direct_failed == 1


async def test_a_direct_message_to_a_full_receiver_fails_at_the_deadline() -> None:
    # Prepare: bob's queue is full and nobody reads it.
    hub = Hub("gw", direct_timeout_s=0.05)
    alice, bob = session("alice"), session("bob", size=1)
    hub.attach(alice)
    hub.attach(bob)
    assert await hub.send(alice, gateway_pb2.Send(to_peer="bob", payload=b"fits")) is None

    # Execute
    async with asyncio.timeout(5):
        error = await hub.send(alice, gateway_pb2.Send(to_peer="bob", payload=b"no room", message_id="2"))

    # Assert: never dropped silently.
    assert error is not None and error.code == PEER_UNKNOWN
    assert bob.outbox.full and hub.stats.direct_failed == 1
    assert b"no room" not in payloads(await sent(bob.outbox))


async def test_a_direct_message_for_a_remote_peer_goes_over_the_link_to_its_gateway() -> None:
    # Prepare: two links; only "far" has said that bob is attached there.
    hub = Hub("gw")
    near, far = link("near"), link("far")
    hub.add_link(near)
    hub.add_link(far)
    bob_info = common_pb2.PeerInfo(peer_id="bob", gateway_id="far")
    hub.on_presence(far, gateway_pb2.PeerPresence(gateway_id="far", full=True, attached=[bob_info]))
    alice = session("alice")
    hub.attach(alice)

    # Execute
    error = await hub.send(alice, gateway_pb2.Send(to_peer="bob", channel="c", payload=b"hi", message_id="3"))

    # Assert
    assert error is None
    forwards = [f.forward for f in await sent_over(far.outbox) if f.WhichOneof("kind") == "forward"]
    assert [(f.to_peer, f.hops, f.origin_gateway, f.delivery.payload) for f in forwards] == [
        ("bob", 1, "gw", b"hi")
    ]
    assert not [f for f in await sent_over(near.outbox) if f.WhichOneof("kind") == "forward"]


async def test_a_forwarded_direct_message_that_cannot_be_delivered_bounces_to_its_sender() -> None:
    # Prepare: this gateway is told bob is here, but he has left; alice sent from gateway "a".
    hub = Hub("gw")
    came_from = link("a")
    hub.add_link(came_from)
    header = gateway_pb2.Delivery(from_peer="alice", message_id="alice/42", direct=True, payload=b"x")
    forward = gateway_pb2.Forward(
        message_id="alice/42", origin_gateway="a", hops=1, to_peer="bob", delivery=header
    )

    # Execute
    await hub.on_forward(came_from, forward)

    # Assert: the bounce goes back over the link it came on, with the id as alice gave it.
    bounces = [f.bounce for f in await sent_over(came_from.outbox) if f.WhichOneof("kind") == "bounce"]
    assert [(b.to_peer, b.error.code, b.error.message_id, b.hops) for b in bounces] == [
        ("alice", PEER_UNKNOWN, "42", 1)
    ]
    assert hub.stats.direct_failed == 1


async def test_a_bounce_for_a_local_sender_arrives_as_an_error_frame() -> None:
    hub = Hub("gw")
    alice = session("alice")
    hub.attach(alice)
    error = gateway_pb2.GatewayError(code=PEER_UNKNOWN, message="cannot deliver to bob", message_id="42")

    hub.on_bounce(None, gateway_pb2.Bounce(to_peer="alice", error=error))

    (frame,) = await sent(alice.outbox)
    assert frame.WhichOneof("kind") == "error" and frame.error == error


# ---- federation state ---------------------------------------------------------------------------


def test_presence_is_trusted_only_for_the_gateway_at_the_other_end() -> None:
    hub = Hub("gw")
    far = link("far")
    hub.add_link(far)

    def info(peer: str) -> common_pb2.PeerInfo:
        return common_pb2.PeerInfo(peer_id=peer, gateway_id="far")

    hub.on_presence(
        far, gateway_pb2.PeerPresence(gateway_id="far", full=True, attached=[info("a"), info("b")])
    )
    hub.on_presence(far, gateway_pb2.PeerPresence(gateway_id="far", attached=[info("c")], detached=["a"]))
    hub.on_presence(far, gateway_pb2.PeerPresence(gateway_id="elsewhere", attached=[info("evil")]))

    assert set(hub.remote) == {"far"} and set(hub.remote["far"]) == {"b", "c"}
    hub.on_presence(far, gateway_pb2.PeerPresence(gateway_id="far", full=True, attached=[info("d")]))
    assert set(hub.remote["far"]) == {"d"}  # a full presence replaces, not adds


def test_a_gateways_peers_are_forgotten_only_with_its_last_link() -> None:
    hub = Hub("gw")
    first, second = link("far"), link("far")
    hub.add_link(first)
    hub.add_link(second)
    hub.on_presence(
        first,
        gateway_pb2.PeerPresence(gateway_id="far", full=True, attached=[common_pb2.PeerInfo(peer_id="bob")]),
    )
    local = session("local")
    hub.attach(local)

    hub.remove_link(first)
    assert first.outbox.closed and "bob" in hub.remote["far"]
    assert {p.peer_id for p in hub.peers()} == {"local", "bob"}
    hub.remove_link(second)
    hub.remove_link(second)  # twice is harmless

    assert hub.remote == {} and [p.peer_id for p in hub.peers()] == ["local"]
    assert first.serial < second.serial


async def test_stop_ends_every_stream() -> None:
    hub = Hub("gw")
    alice, far = session("alice"), link("far")
    hub.attach(alice)
    hub.add_link(far)

    await hub.stop()

    assert alice.outbox.closed and far.outbox.closed


def test_a_hello_is_refused_for_too_many_too_long_or_unprintable_addresses() -> None:
    def hello(*addresses: str, name: str = "n") -> gateway_pb2.Hello:
        return gateway_pb2.Hello(addresses=list(addresses), name=name)

    assert hello_problem(hello("127.0.0.1:1", "127.0.0.1:2"), max_addresses=2, max_chars=32) is None
    assert "3 addresses" in (hello_problem(hello("a", "b", "c"), max_addresses=2, max_chars=32) or "")
    assert "name of 33" in (hello_problem(hello(name="n" * 33), max_addresses=2, max_chars=32) or "")
    assert "too long" in (hello_problem(hello("a" * 33), max_addresses=2, max_chars=32) or "")
    assert "unprintable" in (hello_problem(hello("a\nb"), max_addresses=2, max_chars=32) or "")
