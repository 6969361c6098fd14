"""Wiring of the scheduler process: what it serves and in which order it starts and stops.

Start order (``Node.start``): gRPC server (bound, so its address is known),
gateway link (announces that address), relay (serves the scheduler's services
to workers that cannot reach the server), market (renewals, standing pool).
Stop order is the reverse: the market stops allocating and releases its
leases while the link and relay can still carry the calls, then the relay,
the link, the server.
"""

from __future__ import annotations

import logging

from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.relay import Relay
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.scheduler.config import SchedulerSettings
from hypha.scheduler.market import SchedulerMarket
from hypha.scheduler.servicer import SchedulerControlServicer, SchedulerServicer
from hypha.v1 import scheduler_pb2_grpc

log = logging.getLogger(__name__)


class _LinkPart:
    """Starts the gateway link once the server is bound, so the link announces real addresses."""

    def __init__(self, node: Node, link: NodeLink) -> None:
        self.node = node
        self.link = link

    async def start(self) -> None:
        self.link.addresses = self.node.addresses
        await self.link.start()

    async def stop(self) -> None:
        await self.link.stop()


class _Closer:
    """Closes the direct channels to peers after everything that used them stopped."""

    def __init__(self, connector: PeerConnector) -> None:
        self.connector = connector

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.connector.close()


class SchedulerNode(Node):
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector
    market: SchedulerMarket


def build(settings: SchedulerSettings, tls: TlsMaterial) -> SchedulerNode:
    cfg = settings.scheduler
    gateways = settings.net.gateways
    link = (
        NodeLink(tls, gateways, name=settings.name, max_message_bytes=settings.net.max_message_bytes)
        if gateways
        else None
    )
    relay = Relay(link) if link is not None else None
    connector = PeerConnector(tls, relay, cfg.connect_timeout_s)
    market = SchedulerMarket(tls.identity.peer_id, link, connector, cfg)
    bindings = [
        (scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(market), "hypha.v1.Scheduler"),
        (
            scheduler_pb2_grpc.add_SchedulerControlServicer_to_server,
            SchedulerControlServicer(market),
            "hypha.v1.SchedulerControl",
        ),
    ]
    node = SchedulerNode(
        settings.name,
        tls,
        settings.net.listen,
        bindings,
        max_message_bytes=settings.net.max_message_bytes,
        keepalive_s=settings.net.keepalive_s,
        grace_s=cfg.grace_s,
        external_addresses=settings.net.external_addresses,
    )
    market.addresses = lambda: node.addresses
    node.link, node.relay, node.connector, node.market = link, relay, connector, market
    node.add_part(_Closer(connector))  # first in, last out
    if link is not None and relay is not None:
        relay.serve(bindings)
        link.on_disconnect.append(relay.link_lost)
        node.add_part(_LinkPart(node, link))
        node.add_part(relay)
    else:
        log.warning("no gateway configured (net.gateways): this scheduler cannot lease workers")
    node.add_part(market)
    return node
