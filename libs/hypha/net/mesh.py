"""How a role joins the gateway mesh: its link, relay and peer connector,
added to the node's lifecycle in the one right order.

Start order: the connector (nothing to start), the link once the server is
bound (so it announces real addresses), then the relay (serves the node's
own services to peers that cannot reach its server). Stop order is the
reverse, so peers' channels close after everything that used them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypha.config.common import NodeSettings
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.relay import Relay, RelayLimits
from hypha.net.server import ServiceBinding
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.service import Service


@dataclass
class MeshParts:
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector

    @classmethod
    def create(cls, settings: NodeSettings, tls: TlsMaterial, connect_timeout_s: float) -> MeshParts:
        gateways = settings.net.gateways
        link = (
            NodeLink(
                tls,
                gateways,
                name=settings.name,
                max_message_bytes=settings.net.max_message_bytes,
                keepalive_s=settings.net.keepalive_s,
            )
            if gateways
            else None
        )
        net = settings.net
        limits = RelayLimits(
            max_concurrent_calls=net.relay_max_calls,
            max_calls_per_peer=net.relay_max_calls_per_peer,
            max_call_s=net.relay_max_call_s,
        )
        relay = Relay(link, limits=limits, revocation=tls.revocation) if link is not None else None
        return cls(link, relay, PeerConnector(tls, relay, connect_timeout_s))

    def attach(self, node: Node, bindings: list[ServiceBinding]) -> bool:
        """Add the parts to ``node``; False when no gateway is configured."""
        node.add_part(_Closer(self.connector))
        if self.link is None or self.relay is None:
            return False
        self.relay.serve(bindings)
        self.link.on_disconnect.append(self.relay.link_lost)
        node.add_part(_LinkPart(node, self.link))
        node.add_part(self.relay)
        return True


class _LinkPart(Service):
    def __init__(self, node: Node, link: NodeLink) -> None:
        self.node = node
        self.link = link

    async def start(self) -> None:
        self.link.addresses = self.node.addresses
        await self.link.start()

    async def stop(self) -> None:
        await self.link.stop()


class _Closer(Service):
    def __init__(self, connector: PeerConnector) -> None:
        self.connector = connector

    async def stop(self) -> None:
        await self.connector.close()
