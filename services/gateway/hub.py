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
Message ids are namespaced by the authenticated sender, so no node can
suppress another's messages by reusing their ids.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypha.gateway.dedup import SeenCache
from hypha.gateway.outbox import Outbox
from hypha.pki.identity import Role, role_to_proto
from hypha.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    """One attached node's Connect stream."""

    peer_id: str
    role: Role
    outbox: Outbox[gateway_pb2.ServerFrame]
    name: str = ""
    addresses: list[str] = field(default_factory=list)
    topics: set[str] = field(default_factory=set)

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
    outbox: Outbox[gateway_pb2.FederationFrame]
    serial: int = 0


@dataclass
class HubStats:
    published: int = 0
    delivered: int = 0
    forwarded: int = 0
    duplicates: int = 0
    direct_failed: int = 0
    hop_limited: int = 0


class Hub:
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

    def subscribe(self, session: Session, topic: str) -> None:
        session.topics.add(topic)
        self.topics.setdefault(topic, set()).add(session.peer_id)

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
        delivery = gateway_pb2.Delivery(
            from_peer=session.peer_id,
            from_role=role_to_proto(session.role),
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
        out = gateway_pb2.ServerFrame(delivery=delivery)
        for peer_id in self.topics.get(delivery.topic, ()):
            if peer_id == delivery.from_peer:
                continue
            target = self.sessions.get(peer_id)
            if target is not None and target.outbox.offer(out):
                self.stats.delivered += 1
        if hops + 1 > self.hop_limit:
            self.stats.hop_limited += 1
            return
        forward = gateway_pb2.FederationFrame(
            forward=gateway_pb2.Forward(
                message_id=delivery.message_id, origin_gateway=origin, hops=hops + 1, delivery=delivery
            )
        )
        for link in self.links:
            if link is not came_from and link.gateway_id != origin and link.outbox.offer(forward):
                self.stats.forwarded += 1

    # ---- direct ----------------------------------------------------------

    async def send(self, session: Session, frame: gateway_pb2.Send) -> gateway_pb2.GatewayError | None:
        message_id = f"{session.peer_id}/{frame.message_id or f'{self.gateway_id}-{next(self._ids)}'}"
        delivery = gateway_pb2.Delivery(
            from_peer=session.peer_id,
            from_role=role_to_proto(session.role),
            topic=frame.channel,
            payload=frame.payload,
            message_id=message_id,
            direct=True,
        )
        delivered = await self._route_direct(frame.to_peer, delivery, hops=0)
        if delivered is None:
            return None
        self.stats.direct_failed += 1
        return gateway_pb2.GatewayError(
            code=delivered, message=f"cannot deliver to {frame.to_peer}", message_id=frame.message_id
        )

    async def _route_direct(
        self, to_peer: str, delivery: gateway_pb2.Delivery, hops: int
    ) -> gateway_pb2.ErrorCode | None:
        """Deliver or forward; None on success, else an ErrorCode."""
        target = self.sessions.get(to_peer)
        if target is not None:
            if await target.outbox.put(gateway_pb2.ServerFrame(delivery=delivery), self.direct_timeout_s):
                self.stats.delivered += 1
                return None
            return gateway_pb2.ERROR_CODE_PEER_UNKNOWN
        if hops + 1 > self.hop_limit:
            return gateway_pb2.ERROR_CODE_PEER_UNKNOWN
        link = self._link_to_peer(to_peer)
        if link is None:
            return gateway_pb2.ERROR_CODE_PEER_UNKNOWN
        forward = gateway_pb2.FederationFrame(
            forward=gateway_pb2.Forward(
                message_id=delivery.message_id,
                origin_gateway=self.gateway_id,
                hops=hops + 1,
                delivery=delivery,
                to_peer=to_peer,
            )
        )
        if await link.outbox.put(forward, self.direct_timeout_s):
            self.stats.forwarded += 1
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

    async def on_forward(self, link: Link, forward: gateway_pb2.Forward) -> None:
        if forward.to_peer:
            if await self._route_direct(forward.to_peer, forward.delivery, forward.hops) is not None:
                self.stats.direct_failed += 1
                log.info("dropping direct message for %s: not attached here", forward.to_peer)
            return
        self._route_publish(forward.delivery, forward.hops, forward.origin_gateway, came_from=link)

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
