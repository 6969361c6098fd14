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
from hypha.gateway.metrics import GatewayMetrics
from hypha.gateway.servicer import GatewayServicer, add_gateway_servicer
from hypha.net.metrics_server import MetricsServer
from hypha.net.tls import TlsMaterial
from hypha.node import Node


class GatewayNode(Node):
    hub: Hub
    federation: Federation
    dht: GatewayDht | None
    metrics: MetricsServer | None

    def ready_info(self) -> dict[str, Any]:
        metrics = f"https://{self.metrics.address}/metrics" if self.metrics else ""
        return {**super().ready_info(), "dht": self.dht.address if self.dht else "", "metrics": metrics}


def build(settings: GatewaySettings, tls: TlsMaterial) -> GatewayNode:
    cfg = settings.gateway
    hub = Hub(
        tls.identity.peer_id,
        hop_limit=cfg.hop_limit,
        direct_timeout_s=cfg.direct_timeout_s,
        dedup_ttl_s=cfg.dedup_ttl_s,
        dedup_max=cfg.dedup_max,
    )
    node = GatewayNode.from_settings(
        settings,
        tls,
        [(add_gateway_servicer, GatewayServicer(hub, cfg), "hypha.v1.Gateway")],
        grace_s=cfg.grace_s,
    )
    node.hub = hub
    node.federation = Federation(hub, tls, cfg, settings.net.max_message_bytes)
    # Parts stop in reverse: federation first, then the hub ends every stream.
    node.add_part(hub)
    node.add_part(node.federation)
    node.dht = GatewayDht(tls, cfg) if cfg.dht_port is not None else None
    if node.dht is not None:
        node.add_part(node.dht)
    node.metrics = None
    if cfg.metrics_listen:
        node.metrics = MetricsServer(GatewayMetrics(hub).registry, tls, cfg.metrics_listen)
        node.add_part(node.metrics)
    return node
