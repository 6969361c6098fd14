"""What a node receives over its gateway link, as a domain type.

``from_peer`` and ``from_role`` were stamped by the gateway that
authenticated the sender's TLS session; they are the only sender identity a
node may trust for a message that came through the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @classmethod
    def from_proto(cls, delivery: gateway_pb2.Delivery) -> Message:
        return cls(
            from_peer=delivery.from_peer,
            from_role=role_from_proto(delivery.from_role),
            topic=delivery.topic,
            payload=delivery.payload,
            message_id=delivery.message_id,
            direct=delivery.direct,
        )


#: Direct-message channel that carries relayed gRPC calls.
RELAY_CHANNEL = "hypha/relay"
#: Topic on which schedulers publish advertisements to all workers.
WORKER_TOPIC = "hypha/worker"
