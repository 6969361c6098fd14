"""Hand-encoded frames (``hypha.net.wire``) parse to exactly the messages the generated code builds."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from hypha.net.messages import Message, RawDelivery, server_frame
from hypha.net.relay_frames import relay_frame_bytes
from hypha.net.wire import Encoded, field_number, frame_bytes, split_field, varint
from hypha.v1 import gateway_pb2

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16_383, 16_384, 2**32 + 5])
def test_varint_matches_protobuf(value: int) -> None:
    # A uint64 field's encoding is its key followed by the varint.
    encoded = gateway_pb2.RelayFrame(seq=value).SerializeToString()
    expected = encoded[1:] if value else b"\x00"
    assert varint(value) == expected


@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 700])
def test_a_nested_frame_parses_to_the_generated_message(payload: bytes) -> None:
    delivery = gateway_pb2.Delivery(from_peer="p", from_role=2, topic="c", message_id="p/1", direct=True)
    forward = gateway_pb2.Forward(message_id="p/1", origin_gateway="gw", hops=1, to_peer="q")

    data = bytes(
        Encoded.with_field(delivery, "payload", payload)
        .within(forward, "delivery")
        .within(gateway_pb2.FederationFrame(), "forward")
    )

    expected = gateway_pb2.FederationFrame(forward=forward)
    expected.forward.delivery.CopyFrom(delivery)
    expected.forward.delivery.payload = payload
    assert gateway_pb2.FederationFrame.FromString(data) == expected


def test_a_relay_message_frame_sets_the_oneof_even_when_empty() -> None:
    header = gateway_pb2.RelayFrame(call_id="c", seq=7)

    for message in (b"", b"response"):
        frame = gateway_pb2.RelayFrame.FromString(relay_frame_bytes(header, message))
        assert frame.WhichOneof("kind") == "message"
        assert (frame.call_id, frame.seq, frame.message) == ("c", 7, message)


def test_frame_bytes_passes_encoded_frames_through_and_serializes_messages() -> None:
    frame = gateway_pb2.ClientFrame(ping=gateway_pb2.Ping(nonce=3))
    assert frame_bytes(b"\x01\x02") == b"\x01\x02"
    assert frame_bytes(frame) == frame.SerializeToString()


def test_field_numbers_come_from_the_descriptor() -> None:
    assert field_number(gateway_pb2.ClientFrame, "send") == 5
    with pytest.raises(KeyError):
        field_number(gateway_pb2.ClientFrame, "no_such_field")


def _send_frame(payload: bytes) -> bytes:
    send = gateway_pb2.Send(to_peer="q", payload=payload, message_id="m1", channel="c")
    return gateway_pb2.ClientFrame(send=send).SerializeToString()


def test_split_field_takes_one_field_out_without_copying() -> None:
    data = gateway_pb2.Send(to_peer="q", payload=b"body", message_id="m1", channel="c").SerializeToString()

    split = split_field(memoryview(data), field_number(gateway_pb2.Send, "payload"))

    assert split is not None
    rest, value = split
    assert value.obj is data and bytes(value) == b"body"
    assert gateway_pb2.Send.FromString(b"".join(rest)) == gateway_pb2.Send(
        to_peer="q", message_id="m1", channel="c"
    )


@pytest.mark.parametrize(
    "data",
    [
        gateway_pb2.Send(to_peer="q").SerializeToString(),  # absent
        _send_frame(b"a")[2:] + gateway_pb2.Send(payload=b"b").SerializeToString(),  # repeated
        gateway_pb2.Send(payload=b"abcdef").SerializeToString()[:-3],  # truncated
        b"\x10\x05",  # the field number with another wire type (varint)
        b"\x13",  # a group
    ],
)
def test_split_field_gives_up_on_anything_but_one_plain_occurrence(data: bytes) -> None:
    assert split_field(memoryview(data), field_number(gateway_pb2.Send, "payload")) is None


def test_a_delivery_is_read_around_its_payload_and_other_frames_as_before() -> None:
    delivery = gateway_pb2.Delivery(
        from_peer="p", from_role=2, topic="c", payload=b"x" * 3000, message_id="p/1", direct=True
    )
    delivery.from_cert_serial = b"\x01\x02"

    raw = server_frame(gateway_pb2.ServerFrame(delivery=delivery).SerializeToString())
    error = gateway_pb2.ServerFrame(error=gateway_pb2.GatewayError(code=1, message="no"))

    assert isinstance(raw, RawDelivery)
    assert raw.payload == delivery.payload
    assert Message.from_proto(raw.delivery, raw.payload) == Message.from_proto(delivery)
    assert server_frame(error.SerializeToString()) == error
    with pytest.raises(DecodeError):
        server_frame(b"\x12\x05abc")
