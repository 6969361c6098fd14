"""The gateway reads direct messages around their payload (``hypha.gateway.frames``) and every
other frame exactly as protobuf does."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from hypha.gateway.frames import RawForward, RawSend, client_frame, federation_frame
from hypha.v1 import gateway_pb2
from tests.gateway.conftest import Mesh, until

pytestmark = pytest.mark.timeout(30)

PAYLOAD = bytes(range(256)) * 64


def test_a_send_is_read_as_its_header_and_a_view_of_the_payload() -> None:
    send = gateway_pb2.Send(to_peer="q", payload=PAYLOAD, message_id="m1", channel="hypha/relay")
    data = gateway_pb2.ClientFrame(send=send).SerializeToString()

    frame = client_frame(data)

    assert isinstance(frame, RawSend)
    assert frame.payload.obj is data and bytes(frame.payload) == PAYLOAD
    assert frame.send == gateway_pb2.Send(to_peer="q", message_id="m1", channel="hypha/relay")


@pytest.mark.parametrize(
    "frame",
    [
        gateway_pb2.ClientFrame(ping=gateway_pb2.Ping(nonce=7)),
        gateway_pb2.ClientFrame(publish=gateway_pb2.Publish(topic="t", payload=b"x")),
        gateway_pb2.ClientFrame(send=gateway_pb2.Send(to_peer="q", message_id="empty payload")),
    ],
)
def test_other_client_frames_are_parsed_by_protobuf(frame: gateway_pb2.ClientFrame) -> None:
    assert client_frame(frame.SerializeToString()) == frame


def test_a_send_with_its_payload_twice_is_left_to_protobuf_and_the_last_one_wins() -> None:
    first = gateway_pb2.ClientFrame(send=gateway_pb2.Send(to_peer="q", payload=b"first"))
    second = gateway_pb2.ClientFrame(send=gateway_pb2.Send(payload=b"second"))

    frame = client_frame(first.SerializeToString() + second.SerializeToString())

    assert isinstance(frame, gateway_pb2.ClientFrame)
    assert (frame.send.to_peer, frame.send.payload) == ("q", b"second")


def test_malformed_frames_are_refused_as_before() -> None:
    for parse in (client_frame, federation_frame):
        with pytest.raises(DecodeError):
            parse(b"\x2a\x10short")


def _forward(to_peer: str) -> gateway_pb2.FederationFrame:
    delivery = gateway_pb2.Delivery(
        from_peer="p", from_role=2, topic="c", payload=PAYLOAD, message_id="p/1", direct=bool(to_peer)
    )
    delivery.from_cert_serial = b"\x05"
    delivery.from_cert_issuer = "CN=ca"
    forward = gateway_pb2.Forward(message_id="p/1", origin_gateway="gw1", hops=1, to_peer=to_peer)
    forward.delivery.CopyFrom(delivery)
    return gateway_pb2.FederationFrame(forward=forward)


def test_a_forwarded_direct_message_keeps_its_stamped_sender_and_a_view_of_the_payload() -> None:
    expected = _forward("q")

    frame = federation_frame(expected.SerializeToString())

    assert isinstance(frame, RawForward)
    assert bytes(frame.payload) == PAYLOAD
    expected.forward.delivery.ClearField("payload")
    assert frame.forward == expected.forward


@pytest.mark.parametrize(
    "frame",
    [
        _forward(""),  # a topic message
        gateway_pb2.FederationFrame(presence=gateway_pb2.PeerPresence(gateway_id="gw1", full=True)),
        gateway_pb2.FederationFrame(bounce=gateway_pb2.Bounce(to_peer="p")),
    ],
)
def test_other_federation_frames_are_parsed_by_protobuf(frame: gateway_pb2.FederationFrame) -> None:
    assert federation_frame(frame.SerializeToString()) == frame


async def test_large_direct_messages_cross_the_mesh_intact_and_stamped(mesh: Mesh) -> None:
    # Prepare: gw0 - gw1; a sender on gw0, one receiver beside it and one behind gw1.
    gw0, gw1 = await mesh.full_mesh(2)
    sender = await mesh.add_link("worker", "frames-sender", [gw0.address])
    near = await mesh.add_link("worker", "frames-near", [gw0.address])
    far = await mesh.add_link("worker", "frames-far", [gw1.address])
    inboxes = {near.peer_id: near.direct("c"), far.peer_id: far.direct("c")}
    await until(lambda: far.peer_id in gw0.hub.remote.get(gw1.peer_id, {}), "far known at gw0")
    payload = bytes(range(256)) * 4096  # 1 MiB

    for peer_id, inbox in inboxes.items():
        # Execute
        await sender.send(peer_id, payload, "c")
        got = await inbox.get(timeout=10)

        # Assert: the same bytes, the sender as the gateway authenticated it.
        assert got.payload == payload
        assert (got.from_peer, got.topic, got.direct) == (sender.peer_id, "c", True)
        assert got.from_serial == sender.tls.identity.serial
