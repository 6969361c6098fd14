"""Parsing the gateway's incoming stream frames so that a direct message's payload is
never copied out of the received bytes until it is re-framed for its next hop.

Why (docs/performance.md, ``relay``): protobuf copies a bytes field when it
parses a frame and again each time the field is read; a relayed 1 MiB chunk
paid both at every gateway. A direct message (``Send`` from a node, a
``Forward`` with ``to_peer`` from a peer gateway) is parsed here as its small
header message, by protobuf as before, plus a view of the payload; the hub
then copies the payload once, into the frame it sends on (``hypha.net.wire``).
Every other frame, and any frame this cannot take apart (a payload repeated,
unusual encoding), is parsed by protobuf as before, which also refuses
malformed ones the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypha.net.wire import field_number, split_field
from hypha.v1 import gateway_pb2

_SEND = field_number(gateway_pb2.ClientFrame, "send")
_SEND_PAYLOAD = field_number(gateway_pb2.Send, "payload")
_FORWARD = field_number(gateway_pb2.FederationFrame, "forward")
_FORWARD_DELIVERY = field_number(gateway_pb2.Forward, "delivery")
_DELIVERY_PAYLOAD = field_number(gateway_pb2.Delivery, "payload")


@dataclass(frozen=True, slots=True)
class RawSend:
    """A node's direct message: its ``Send`` without the payload, and the payload."""

    send: gateway_pb2.Send
    payload: memoryview


@dataclass(frozen=True, slots=True)
class RawForward:
    """A peer gateway's direct message: its ``Forward`` without the delivery's payload, and the payload."""

    forward: gateway_pb2.Forward
    payload: memoryview


def _only(data: memoryview, number: int) -> memoryview | None:
    """The value of field ``number`` when it is the message's only field (a oneof's one member)."""
    split = split_field(data, number)
    return split[1] if split is not None and not split[0] else None


def client_frame(data: bytes) -> gateway_pb2.ClientFrame | RawSend:
    """The Connect stream's request deserializer."""
    send = _only(memoryview(data), _SEND)
    if send is not None and (split := split_field(send, _SEND_PAYLOAD)) is not None:
        header, payload = split
        return RawSend(gateway_pb2.Send.FromString(b"".join(header)), payload)
    return gateway_pb2.ClientFrame.FromString(data)


def federation_frame(data: bytes) -> gateway_pb2.FederationFrame | RawForward:
    """The Federate stream's deserializer (both sides)."""
    forward = _only(memoryview(data), _FORWARD)
    if forward is not None and (outer := split_field(forward, _FORWARD_DELIVERY)) is not None:
        inner = split_field(outer[1], _DELIVERY_PAYLOAD)
        if inner is not None:
            header = gateway_pb2.Forward.FromString(b"".join(outer[0]))
            if header.to_peer:  # a direct message; topic messages take the usual path
                header.delivery.MergeFromString(b"".join(inner[0]))
                return RawForward(header, inner[1])
    return gateway_pb2.FederationFrame.FromString(data)


__all__ = ["RawForward", "RawSend", "client_frame", "federation_frame"]
