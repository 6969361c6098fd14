"""The gateway's routing core: who is attached, who listens to what, and
where a frame goes next.

It knows nothing about gRPC: the servicer turns stream frames into calls
here, and each attached node or federation link is an ``Outbox`` the hub
fills. Senders are identified by the servicer from the TLS session before a
frame reaches the hub, and every delivery carries that identity.

Routing rules:
- publish: deliver to local subscribers (not back to the sender), then
  forward to every federation link except the one it came from, while the
  hop limit allows; each gateway de-duplicates by message id, so a frame
  crosses each gateway once in any mesh.
- direct: to the local session if the peer is attached here, else over a
  link to the gateway whose presence lists the peer, else an error frame.
  A forwarded direct message that the far gateway cannot deliver (the peer
  left before presence caught up) goes back to its sender as a ``Bounce``
  and arrives as the same error frame, so a relayed call ends at once.
Message ids are namespaced by the authenticated sender, so no node can
suppress another's messages by reusing their ids.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypha.gateway.dedup import SeenCache
from hypha.gateway.frames import RawForward
from hypha.gateway.outbox import Outbox
from hypha.net.wire import Encoded
from hypha.pki.identity import Role, role_to_proto
from hypha.service import Service
from hypha.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

#: What a session's or a link's stream sends: a message, or a frame encoded already
#: (direct messages: ``hypha.net.wire``; the streams serialize with ``frame_bytes``).
ServerOut = gateway_pb2.ServerFrame | bytes
FederationOut = gateway_pb2.FederationFrame | bytes


@dataclass(eq=False)
class Session:
    """One attached node's Connect stream."""

    peer_id: str
    role: Role
    outbox: Outbox[ServerOut]
    name: str = ""
    addresses: list[str] = field(default_factory=list)
    topics: set[str] = field(default_factory=set)
    #: The certificate the peer authenticated with (serial, issuer RFC 4514, issuer key id):
    #: stamped on everything it sends, so receivers can check it against their CRL.
    cert_serial: int = 0
    cert_issuer: str = ""
    cert_issuer_key_id: bytes = b""

    def delivery(self, **fields: Any) -> gateway_pb2.Delivery:
        """A delivery from this session, its sender stamped from TLS (never from the frame)."""
        return gateway_pb2.Delivery(
            from_peer=self.peer_id,
            from_role=role_to_proto(self.role),
            from_cert_serial=self.cert_serial.to_bytes((self.cert_serial.bit_length() + 7) // 8, "big"),
            from_cert_issuer=self.cert_issuer,
            from_cert_issuer_key_id=self.cert_issuer_key_id,
            **fields,
        )

    def info(self, gateway_id: str) -> common_pb2.PeerInfo:
        return common_pb2.PeerInfo(
            peer_id=self.peer_id,
            role=role_to_proto(self.role),
            name=self.name,
            addresses=self.addresses,
            gateway_id=gateway_id,
        )


@dataclass(eq=False)
class Link:
    """One federation stream to another gateway."""

    gateway_id: str
    outbox: Outbox[FederationOut]
    serial: int = 0


@dataclass
class HubStats:
    published: int = 0
    delivered: int = 0
    forwarded: int = 0
    duplicates: int = 0
    direct_failed: int = 0
    hop_limited: int = 0
    #: Topic frames dropped because a subscriber's or peer gateway's queue was full.
    dropped: int = 0
    #: Payload bytes routed: topic messages (once per message), direct messages (the relay) delivered.
    topic_bytes: int = 0
    direct_bytes: int = 0


def hello_problem(hello: gateway_pb2.Hello, max_addresses: int, max_chars: int) -> str | None:
    """Why a Hello is refused, or None: its addresses go to every gateway and every node that
    asks for peers, so their count and size are bounded (``gateway.max_hello_*``)."""
    if len(hello.addresses) > max_addresses:
        return (
            f"hello: {len(hello.addresses)} addresses, at most {max_addresses} (gateway.max_hello_addresses)"
        )
    if len(hello.name) > max_chars:
        return f"hello: name of {len(hello.name)} characters, at most {max_chars} (gateway.max_hello_chars)"
    for address in hello.addresses:
        if len(address) > max_chars or not address.isprintable():
            return f"hello: address {address[:32]!r}... too long or unprintable (gateway.max_hello_chars)"
    return None


class Hub(Service):
    def __init__(
        self,
        gateway_id: str,
        *,
        hop_limit: int = 8,
        direct_timeout_s: float = 10.0,
        dedup_ttl_s: float = 120.0,
        dedup_max: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway_id = gateway_id
        self.hop_limit = hop_limit
        self.direct_timeout_s = direct_timeout_s
        self.sessions: dict[str, Session] = {}
        self.topics: dict[str, set[str]] = {}
        self.links: list[Link] = []
        #: gateway id -> peers attached there, as that gateway last told us.
        self.remote: dict[str, dict[str, common_pb2.PeerInfo]] = {}
        self.seen = SeenCache(dedup_ttl_s, dedup_max)
        self.stats = HubStats()
        self._clock = clock
        self._ids = itertools.count(1)
        self._link_serials = itertools.count(1)

    # ---- local sessions -------------------------------------------------

    def attach(self, session: Session) -> None:
        old = self.sessions.get(session.peer_id)
        if old is not None and old is not session:
            log.info("peer %s reconnected; closing its previous stream", session.peer_id)
            self._drop_subscriptions(old)
            old.outbox.close()
        self.sessions[session.peer_id] = session
        self._announce(
            gateway_pb2.PeerPresence(gateway_id=self.gateway_id, attached=[session.info(self.gateway_id)])
        )

    def detach(self, session: Session) -> None:
        if self.sessions.get(session.peer_id) is not session:
            return  # already replaced by a newer stream of the same peer
        del self.sessions[session.peer_id]
        self._drop_subscriptions(session)
        session.outbox.close()
        self._announce(gateway_pb2.PeerPresence(gateway_id=self.gateway_id, detached=[session.peer_id]))

    def subscribe(self, session: Session, topic: str, limit: int | None = None) -> str | None:
        """Add ``topic`` to the session; the refusal's text when ``limit`` topics are held already
        (every subscription costs the gateway memory and every publish a lookup)."""
        if limit is not None and topic not in session.topics and len(session.topics) >= limit:
            return f"subscription limit: at most {limit} topics per session (gateway.max_subscriptions)"
        session.topics.add(topic)
        self.topics.setdefault(topic, set()).add(session.peer_id)
        return None

    def unsubscribe(self, session: Session, topic: str) -> None:
        session.topics.discard(topic)
        members = self.topics.get(topic)
        if members is not None:
            members.discard(session.peer_id)
            if not members:
                del self.topics[topic]

    def _drop_subscriptions(self, session: Session) -> None:
        for topic in list(session.topics):
            self.unsubscribe(session, topic)

    # ---- publish ---------------------------------------------------------

    def publish(self, session: Session, frame: gateway_pb2.Publish) -> str:
        message_id = f"{session.peer_id}/{frame.message_id or f'{self.gateway_id}-{next(self._ids)}'}"
        delivery = session.delivery(
            topic=frame.topic,
            payload=frame.payload,
            message_id=message_id,
        )
        self.stats.published += 1
        self._route_publish(delivery, hops=0, origin=self.gateway_id, came_from=None)
        return message_id

    def _route_publish(
        self, delivery: gateway_pb2.Delivery, hops: int, origin: str, came_from: Link | None
    ) -> None:
        if not self.seen.first_time(delivery.message_id, self._clock()):
            self.stats.duplicates += 1
            return
        self.stats.topic_bytes += len(delivery.payload)
        out = gateway_pb2.ServerFrame(delivery=delivery)
        for peer_id in self.topics.get(delivery.topic, ()):
            if peer_id == delivery.from_peer:
                continue
            target = self.sessions.get(peer_id)
            if target is not None:
                self._offer(target.outbox, out)
        if hops + 1 > self.hop_limit:
            self.stats.hop_limited += 1
            return
        forward = gateway_pb2.FederationFrame(
            forward=gateway_pb2.Forward(
                message_id=delivery.message_id, origin_gateway=origin, hops=hops + 1, delivery=delivery
            )
        )
        for link in self.links:
            if link is not came_from and link.gateway_id != origin and self._offer(link.outbox, forward):
                self.stats.forwarded += 1

    def _offer(self, outbox: Outbox[Any], frame: Any) -> bool:
        """Offer a topic frame; a full queue drops it (counted), a closed one is a peer leaving."""
        if outbox.offer(frame):
            if isinstance(frame, gateway_pb2.ServerFrame):
                self.stats.delivered += 1
            return True
        if not outbox.closed:
            self.stats.dropped += 1
        return False

    # ---- direct ----------------------------------------------------------

    async def send(
        self, session: Session, frame: gateway_pb2.Send, payload: bytes | memoryview | None = None
    ) -> gateway_pb2.GatewayError | None:
        """Route a direct message; ``payload``: ``frame.payload`` when the caller already read it
        (each read of a bytes field copies it)."""
        message_id = f"{session.peer_id}/{frame.message_id or f'{self.gateway_id}-{next(self._ids)}'}"
        header = session.delivery(topic=frame.channel, message_id=message_id, direct=True)
        payload = frame.payload if payload is None else payload
        delivered = await self._route_direct(frame.to_peer, header, payload, hops=0)
        if delivered is None:
            return None
        self.stats.direct_failed += 1
        return gateway_pb2.GatewayError(
            code=delivered, message=f"cannot deliver to {frame.to_peer}", message_id=frame.message_id
        )

    async def _route_direct(
        self, to_peer: str, header: gateway_pb2.Delivery, payload: bytes | memoryview, hops: int
    ) -> gateway_pb2.ErrorCode | None:
        """Deliver or forward the delivery ``header`` carrying ``payload``; None on success, else
        an ErrorCode.

        The frame is encoded by hand around the payload (``hypha.net.wire``): one copy of it
        per hop, where building and serializing the nested messages cost five.
        """
        delivery = Encoded.with_field(header, "payload", payload)
        target = self.sessions.get(to_peer)
        if target is not None:
            out = bytes(delivery.within(gateway_pb2.ServerFrame(), "delivery"))
            if await target.outbox.put(out, self.direct_timeout_s):
                self.stats.delivered += 1
                self.stats.direct_bytes += len(payload)
                return None
            return gateway_pb2.ERROR_CODE_PEER_UNKNOWN
        if hops + 1 > self.hop_limit:
            return gateway_pb2.ERROR_CODE_PEER_UNKNOWN
        link = self._link_to_peer(to_peer)
        if link is None:
            return gateway_pb2.ERROR_CODE_PEER_UNKNOWN
        forward = gateway_pb2.Forward(
            message_id=header.message_id, origin_gateway=self.gateway_id, hops=hops + 1, to_peer=to_peer
        )
        frame = bytes(delivery.within(forward, "delivery").within(gateway_pb2.FederationFrame(), "forward"))
        if await link.outbox.put(frame, self.direct_timeout_s):
            self.stats.forwarded += 1
            self.stats.direct_bytes += len(payload)
            return None
        return gateway_pb2.ERROR_CODE_PEER_UNKNOWN

    def _link_to_peer(self, peer_id: str) -> Link | None:
        for gateway_id, peers in self.remote.items():
            if peer_id in peers:
                for link in self.links:
                    if link.gateway_id == gateway_id and not link.outbox.closed:
                        return link
        return None

    # ---- federation ------------------------------------------------------

    def add_link(self, link: Link) -> None:
        link.serial = next(self._link_serials)
        self.links.append(link)
        link.outbox.offer(gateway_pb2.FederationFrame(presence=self.full_presence()))
        log.info("federation link to %s up", link.gateway_id)

    def remove_link(self, link: Link) -> None:
        if link not in self.links:
            return
        self.links.remove(link)
        link.outbox.close()
        if not any(other.gateway_id == link.gateway_id for other in self.links):
            self.remote.pop(link.gateway_id, None)
        log.info("federation link to %s down", link.gateway_id)

    def full_presence(self) -> gateway_pb2.PeerPresence:
        return gateway_pb2.PeerPresence(
            gateway_id=self.gateway_id,
            full=True,
            attached=[s.info(self.gateway_id) for s in self.sessions.values()],
        )

    def on_presence(self, link: Link, presence: gateway_pb2.PeerPresence) -> None:
        # NOTE: presence is only trusted for the gateway at the other end of the
        # link; federation is a full mesh, so no presence is re-forwarded.
        if presence.gateway_id != link.gateway_id:
            log.warning(
                "ignoring presence for %s received over link to %s", presence.gateway_id, link.gateway_id
            )
            return
        peers = self.remote.setdefault(link.gateway_id, {})
        if presence.full:
            peers.clear()
        for info in presence.attached:
            peers[info.peer_id] = info
        for peer_id in presence.detached:
            peers.pop(peer_id, None)

    async def on_forward(self, link: Link, message: gateway_pb2.Forward | RawForward) -> None:
        """Route a frame that came over ``link``; a direct one's payload is taken out of it."""
        payload: bytes | memoryview = b""
        if isinstance(message, RawForward):
            forward, payload = message.forward, message.payload
        else:
            forward = message
            if forward.to_peer:
                # Read once and cleared, so the header re-encodes without it (each read copies it).
                payload = forward.delivery.payload
                forward.delivery.ClearField("payload")
        if forward.to_peer:
            code = await self._route_direct(forward.to_peer, forward.delivery, payload, forward.hops)
            if code is not None:
                self.stats.direct_failed += 1
                log.info("direct message for %s not delivered: bounced to its sender", forward.to_peer)
                delivery = forward.delivery
                sender_prefix = f"{delivery.from_peer}/"
                error = gateway_pb2.GatewayError(
                    code=code,
                    message=f"cannot deliver to {forward.to_peer}",
                    message_id=delivery.message_id.removeprefix(sender_prefix),
                )
                self.on_bounce(link, gateway_pb2.Bounce(to_peer=delivery.from_peer, error=error))
            return
        self._route_publish(forward.delivery, forward.hops, forward.origin_gateway, came_from=link)

    def on_bounce(self, came_from: Link | None, bounce: gateway_pb2.Bounce) -> None:
        """Hand an undelivered message's error to its sender, here or one link nearer."""
        session = self.sessions.get(bounce.to_peer)
        if session is not None:
            session.outbox.offer(gateway_pb2.ServerFrame(error=bounce.error))
            return
        if bounce.hops + 1 > self.hop_limit:
            return
        link = self._link_to_peer(bounce.to_peer) or came_from
        if link is not None:
            frame = gateway_pb2.Bounce(to_peer=bounce.to_peer, error=bounce.error, hops=bounce.hops + 1)
            link.outbox.offer(gateway_pb2.FederationFrame(bounce=frame))

    def _announce(self, presence: gateway_pb2.PeerPresence) -> None:
        frame = gateway_pb2.FederationFrame(presence=presence)
        for link in self.links:
            link.outbox.offer(frame)

    async def start(self) -> None:
        """Nothing to start: the hub is driven by the servicer's streams."""

    async def stop(self) -> None:
        """End every stream so attached nodes move to another gateway at once,
        instead of the server waiting out its grace period on open streams."""
        for session in list(self.sessions.values()):
            session.outbox.close()
        for link in list(self.links):
            link.outbox.close()

    # ---- views -------------------------------------------------------------

    def peers(self) -> list[common_pb2.PeerInfo]:
        local = [s.info(self.gateway_id) for s in self.sessions.values()]
        seen = {p.peer_id for p in local}
        remote = [p for peers in self.remote.values() for p in peers.values() if p.peer_id not in seen]
        return local + remote
