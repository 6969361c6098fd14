"""The gateway's DHT node: a stable bootstrap point for everyone else.

Gateways are the reachable, long-lived nodes, so they anchor the Kademlia
DHT; they store and serve signed provider records like any other node and
verify them against the same trust bundle as their TLS.
"""

from __future__ import annotations

import logging

from hypha.dht.node import DhtNode
from hypha.dht.records import RecordVerifier
from hypha.gateway.config import GatewaySection
from hypha.net.tls import TlsMaterial
from hypha.service import Service

log = logging.getLogger(__name__)


class GatewayDht(Service):
    def __init__(self, tls: TlsMaterial, config: GatewaySection) -> None:
        self.tls = tls
        self.config = config
        self.node: DhtNode | None = None

    @property
    def address(self) -> str:
        return self.node.address if self.node is not None else ""

    async def start(self) -> None:
        cfg = self.config
        assert cfg.dht_port is not None
        self.node = await DhtNode.create(
            cfg.dht_host,
            cfg.dht_port,
            cfg.dht_bootstrap,
            verifier=RecordVerifier(self.tls.trusted_cas, revocation=self.tls.revocation),
            rpc_timeout_s=cfg.dht_rpc_timeout_s,
            max_records_per_provider=cfg.dht_max_records_per_provider,
            max_stored_bytes=cfg.dht_max_stored_bytes,
        )
        log.info("DHT bootstrap node on %s", self.node.address)

    async def stop(self) -> None:
        node, self.node = self.node, None
        if node is not None:
            await node.stop()
