"""Wiring of the gateway process.

Start order: gRPC server (with the hub), federation links, DHT bootstrap
node. Stop order is the reverse (see ``hypha.node.Node.stop``).
"""

from __future__ import annotations

from typing import Any

from hypha.gateway.config import GatewaySettings
from hypha.gateway.dht import GatewayDht
from hypha.gateway.federation import Federation
from hypha.gateway.hub import Hub
from hypha.gateway.servicer import GatewayServicer
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.v1 import gateway_pb2_grpc


class GatewayNode(Node):
    hub: Hub
    federation: Federation
    dht: GatewayDht | None

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "dht": self.dht.address if self.dht else ""}


def build(settings: GatewaySettings, tls: TlsMaterial) -> GatewayNode:
    cfg = settings.gateway
    hub = Hub(
        tls.identity.peer_id,
        hop_limit=cfg.hop_limit,
        direct_timeout_s=cfg.direct_timeout_s,
        dedup_ttl_s=cfg.dedup_ttl_s,
        dedup_max=cfg.dedup_max,
    )
    node = GatewayNode(
        settings.name,
        tls,
        settings.net.listen,
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(hub, cfg), "hypha.v1.Gateway")],
        max_message_bytes=settings.net.max_message_bytes,
        keepalive_s=settings.net.keepalive_s,
        grace_s=cfg.grace_s,
        external_addresses=settings.net.external_addresses,
    )
    node.hub = hub
    node.federation = Federation(hub, tls, cfg, settings.net.max_message_bytes)
    # Parts stop in reverse: federation first, then the hub ends every stream.
    node.add_part(hub)
    node.add_part(node.federation)
    node.dht = GatewayDht(tls, cfg) if cfg.dht_port is not None else None
    if node.dht is not None:
        node.add_part(node.dht)
    return node
