"""The Gateway gRPC service: a thin edge between streams and the hub.

It authenticates each stream's peer from TLS, turns frames into hub calls
and enforces frame limits; all routing decisions live in ``hub.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from hypha.errors import InvalidArgumentError, PermissionDeniedError
from hypha.gateway.config import GatewaySection
from hypha.gateway.frames import RawForward, RawSend, client_frame, federation_frame
from hypha.gateway.hub import FederationOut, Hub, Link, ServerOut, Session, hello_problem
from hypha.gateway.lanes import DirectLanes
from hypha.gateway.outbox import Outbox
from hypha.gateway.streams import serve_frames
from hypha.net.auth import peer_identity
from hypha.net.wire import frame_bytes, with_codecs
from hypha.pki.identity import Role
from hypha.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, hub: Hub, config: GatewaySection) -> None:
        self.hub = hub
        self.config = config

    async def Connect(
        self, request_iterator: AsyncIterator[gateway_pb2.ClientFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ServerOut]:
        peer = peer_identity(context)
        outbox: Outbox[ServerOut] = Outbox(self.config.queue_size, f"peer {peer.peer_id}")
        session = Session(
            peer.peer_id,
            peer.role,
            outbox,
            name=peer.name,
            cert_serial=peer.serial,
            cert_issuer=peer.issuer.rfc4514_string(),
            cert_issuer_key_id=peer.authority_key_id or b"",
        )
        outbox.offer(
            gateway_pb2.ServerFrame(
                welcome=gateway_pb2.Welcome(gateway_id=self.hub.gateway_id, peer_id=peer.peer_id)
            )
        )
        self.hub.attach(session)
        log.info("attached %s (%s %s)", peer.peer_id, peer.role.value, peer.name)

        async def handle(frame: gateway_pb2.ClientFrame | RawSend) -> None:
            await self._on_client_frame(session, frame)

        try:
            async for out in serve_frames(request_iterator, outbox, handle):
                yield out
        finally:
            self.hub.detach(session)
            log.info("detached %s", peer.peer_id)

    async def _on_client_frame(self, session: Session, frame: gateway_pb2.ClientFrame | RawSend) -> None:
        if isinstance(frame, RawSend):
            await self._on_send(session, frame.send, frame.payload)
            return
        kind = frame.WhichOneof("kind")
        if kind == "publish":
            if not self._payload_ok(session, len(frame.publish.payload), frame.publish.message_id):
                return
            if not frame.publish.topic:
                self._error(
                    session,
                    gateway_pb2.ERROR_CODE_BAD_FRAME,
                    "publish without topic",
                    frame.publish.message_id,
                )
                return
            self.hub.publish(session, frame.publish)
        elif kind == "send":
            await self._on_send(session, frame.send, frame.send.payload)
        elif kind == "subscribe" and frame.subscribe.topic:
            refused = self.hub.subscribe(session, frame.subscribe.topic, self.config.max_subscriptions)
            if refused is not None:
                self._error(session, gateway_pb2.ERROR_CODE_BAD_FRAME, refused, "")
        elif kind == "unsubscribe":
            self.hub.unsubscribe(session, frame.unsubscribe.topic)
        elif kind == "hello":
            refused = hello_problem(frame.hello, self.config.max_hello_addresses, self.config.max_hello_chars)
            if refused is not None:
                self._error(session, gateway_pb2.ERROR_CODE_BAD_FRAME, refused, "")
                return
            session.addresses = list(frame.hello.addresses)
            session.name = frame.hello.name or session.name
            self.hub.attach(session)  # re-announce with the addresses
        elif kind == "ping":
            session.outbox.offer(gateway_pb2.ServerFrame(pong=gateway_pb2.Pong(nonce=frame.ping.nonce)))
        else:
            self._error(session, gateway_pb2.ERROR_CODE_BAD_FRAME, f"unexpected frame {kind}", "")

    async def _on_send(self, session: Session, send: gateway_pb2.Send, payload: bytes | memoryview) -> None:
        """A direct message; ``payload`` is read once by the caller (``frames``: a view of the frame)."""
        if not self._payload_ok(session, len(payload), send.message_id):
            return
        error = await self.hub.send(session, send, payload)
        if error is not None:
            session.outbox.offer(gateway_pb2.ServerFrame(error=error))

    def _payload_ok(self, session: Session, size: int, message_id: str) -> bool:
        if size <= self.config.max_payload_bytes:
            return True
        self._error(
            session,
            gateway_pb2.ERROR_CODE_FRAME_TOO_LARGE,
            f"payload of {size} bytes exceeds {self.config.max_payload_bytes}",
            message_id,
        )
        return False

    @staticmethod
    def _error(session: Session, code: gateway_pb2.ErrorCode, message: str, message_id: str) -> None:
        session.outbox.offer(
            gateway_pb2.ServerFrame(
                error=gateway_pb2.GatewayError(code=code, message=message, message_id=message_id)
            )
        )

    async def Federate(
        self, request_iterator: AsyncIterator[gateway_pb2.FederationFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[FederationOut]:
        peer = peer_identity(context)
        if peer.role != Role.GATEWAY:
            raise PermissionDeniedError("only gateways federate")
        incoming = aiter(request_iterator)
        first = await anext(incoming, None)
        if not isinstance(first, gateway_pb2.FederationFrame) or first.WhichOneof("kind") != "presence":
            raise InvalidArgumentError("federation must start with the peer's presence")
        if first.presence.gateway_id != peer.peer_id:
            raise PermissionDeniedError("presence gateway id does not match the TLS identity")
        async for out in serve_link(self.hub, self.config, peer.peer_id, first, incoming):
            yield out

    async def ListPeers(
        self, request: gateway_pb2.ListPeersRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListPeersResponse:
        return gateway_pb2.ListPeersResponse(peers=self.hub.peers())


async def serve_link(
    hub: Hub,
    config: GatewaySection,
    gateway_id: str,
    first: gateway_pb2.FederationFrame,
    incoming: AsyncIterator[gateway_pb2.FederationFrame | RawForward],
) -> AsyncIterator[FederationOut]:
    """Run one federation link (either side) until it breaks; yields frames to send."""
    link = Link(gateway_id, Outbox(config.queue_size, f"link {gateway_id}"))
    hub.add_link(link)
    hub.on_presence(link, first.presence)
    # A direct message waits for its receiver in that receiver's lane, not in the link's reader.
    lanes = DirectLanes(hub, link, config.queue_size)

    async def handle(frame: gateway_pb2.FederationFrame | RawForward) -> None:
        if isinstance(frame, RawForward):
            lanes.submit(frame)
            return
        kind = frame.WhichOneof("kind")
        if kind == "presence":
            hub.on_presence(link, frame.presence)
        elif kind == "forward" and frame.forward.to_peer:
            lanes.submit(frame.forward)
        elif kind == "forward":
            await hub.on_forward(link, frame.forward)
        elif kind == "bounce":
            hub.on_bounce(None, frame.bounce)

    try:
        async for out in serve_frames(incoming, link.outbox, handle):
            yield out
    finally:
        hub.remove_link(link)
        lanes.close()


#: Full method names of the two streams (the generated stub's).
CONNECT_METHOD = "/hypha.v1.Gateway/Connect"
FEDERATE_METHOD = "/hypha.v1.Gateway/Federate"


#: ``add_GatewayServicer_to_server`` with the streams' direct messages kept as bytes: incoming ones
#: are parsed around their payload (``frames``), outgoing ones may be pre-encoded bytes
#: (``hypha.net.wire``), which ``frame_bytes`` passes through.
add_gateway_servicer = with_codecs(
    gateway_pb2_grpc.add_GatewayServicer_to_server,
    {
        "Connect": {"request_deserializer": client_frame, "response_serializer": frame_bytes},
        "Federate": {"request_deserializer": federation_frame, "response_serializer": frame_bytes},
    },
)
