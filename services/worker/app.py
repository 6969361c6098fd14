"""Wiring of the worker process: what it serves and in which order it starts and stops.

Start order (``Node.start``): gRPC server (bound, so its address is known),
gateway link (announces that address), relay (serves the Worker service to
peers that cannot reach the server), market (intake, offers, pruner).
Stop order is the reverse: the market stops deciding, the relay finishes
relayed calls, the link closes, then the server drains.

Without any gateway configured the worker still serves its status but is not
on the market (nothing reaches it).
"""

from __future__ import annotations

import logging

from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.mesh import MeshParts
from hypha.net.relay import Relay
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.v1 import worker_pb2_grpc
from hypha.worker import resources
from hypha.worker.config import WorkerSettings
from hypha.worker.market import WorkerMarket
from hypha.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class WorkerNode(Node):
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector
    market: WorkerMarket
    servicer: WorkerServicer


def build(settings: WorkerSettings, tls: TlsMaterial) -> WorkerNode:
    cfg = settings.worker
    capacity = resources.capacity(settings.work_dir(), cfg.resources.limits(), cfg.max_resources.limits())
    mesh = MeshParts.create(settings, tls, cfg.connect_timeout_s)
    link, relay, connector = mesh.link, mesh.relay, mesh.connector
    market = WorkerMarket(tls.identity.peer_id, link, connector, cfg, capacity)
    servicer = WorkerServicer(market, settings.name)
    bindings = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "hypha.v1.Worker")]
    node = WorkerNode(
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
    node.link, node.relay, node.connector, node.market, node.servicer = (
        link,
        relay,
        connector,
        market,
        servicer,
    )
    if not mesh.attach(node, bindings):
        log.warning("no gateway configured (net.gateways): this worker is not on the market")
    node.add_part(market)
    return node
