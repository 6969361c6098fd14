"""What a node receives over its gateway link, as a domain type.

``from_peer``, ``from_role`` and the sender certificate's serial, issuer and
issuer key id were stamped by the gateway that authenticated the sender's
TLS session; they are the only sender identity a node may trust for a
message that came through the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypha.net.wire import field_number, split_field
from hypha.pki.identity import Role, role_from_proto
from hypha.v1 import gateway_pb2


@dataclass(frozen=True)
class Message:
    from_peer: str
    from_role: Role
    #: The topic of a published message, or the channel of a direct one.
    topic: str
    payload: bytes
    message_id: str
    direct: bool
    #: The sender certificate as the gateway read it (0 / "" / b"": not stamped).
    from_serial: int = 0
    from_issuer: str = ""
    from_issuer_key_id: bytes = b""

    @classmethod
    def from_proto(cls, delivery: gateway_pb2.Delivery, payload: bytes | None = None) -> Message:
        """``payload``: the delivery's, when the caller has it already (``server_frame``)."""
        return cls(
            from_peer=delivery.from_peer,
            from_role=role_from_proto(delivery.from_role),
            topic=delivery.topic,
            payload=delivery.payload if payload is None else payload,
            message_id=delivery.message_id,
            direct=delivery.direct,
            from_serial=int.from_bytes(delivery.from_cert_serial, "big"),
            from_issuer=delivery.from_cert_issuer,
            from_issuer_key_id=delivery.from_cert_issuer_key_id,
        )


@dataclass(frozen=True, slots=True)
class RawDelivery:
    """A delivery parsed around its payload: the ``Delivery`` without it, and the payload."""

    delivery: gateway_pb2.Delivery
    payload: bytes


_DELIVERY = field_number(gateway_pb2.ServerFrame, "delivery")
_PAYLOAD = field_number(gateway_pb2.Delivery, "payload")


def server_frame(data: bytes) -> gateway_pb2.ServerFrame | RawDelivery:
    """The node link's deserializer: a delivery's payload is copied once out of the received
    bytes, where parsing the frame and reading the field copied it twice (``hypha.net.wire``);
    anything else, or anything it cannot take apart, is parsed by protobuf as before."""
    split = split_field(memoryview(data), _DELIVERY)
    if split is not None and not split[0] and (inner := split_field(split[1], _PAYLOAD)) is not None:
        header, payload = inner
        return RawDelivery(gateway_pb2.Delivery.FromString(b"".join(header)), bytes(payload))
    return gateway_pb2.ServerFrame.FromString(data)


#: Direct-message channel that carries relayed gRPC calls.
RELAY_CHANNEL = "hypha/relay"
#: Topic on which schedulers publish advertisements to all workers.
WORKER_TOPIC = "hypha/worker"
