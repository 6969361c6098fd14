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
from hypha.net.mesh import MeshParts
from hypha.net.relay import Relay
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.scheduler.config import SchedulerSettings
from hypha.scheduler.market import SchedulerMarket
from hypha.scheduler.servicer import SchedulerControlServicer, SchedulerServicer
from hypha.v1 import scheduler_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerNode(Node):
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector
    market: SchedulerMarket


def build(settings: SchedulerSettings, tls: TlsMaterial) -> SchedulerNode:
    cfg = settings.scheduler
    mesh = MeshParts.create(settings, tls, cfg.connect_timeout_s)
    link, relay, connector = mesh.link, mesh.relay, mesh.connector
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
    if not mesh.attach(node, bindings):
        log.warning("no gateway configured (net.gateways): this scheduler cannot lease workers")
    node.add_part(market)
    return node
