"""Wiring of the data process: what it serves and in which order it starts and stops.

Start order: the gRPC server (DataNode service over the data dir), then, when
``data.dht_bootstrap`` is set, the DHT endpoint and the announcer that keeps
one signed provider record per served dataset alive. Stop order is the reverse
(see ``hypha.node.Node.stop``): announcements stop before the server drains,
and records simply expire in the DHT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hypha.data.config import DataNodeSection, DataNodeSettings
from hypha.data.servicer import DataNodeServicer, DatasetCatalog, add_data_node_servicer
from hypha.dht.node import DhtNode
from hypha.dht.publisher import Publisher
from hypha.dht.records import RecordVerifier
from hypha.errors import ConfigError, HyphaError
from hypha.net.mesh import MeshParts
from hypha.net.server import ServiceBinding
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.service import BackgroundTasks, Service

log = logging.getLogger(__name__)


class DatasetAnnouncer(Service):
    """Keeps the DHT's provider records in step with the datasets this node serves.

    Every ``poll_s`` it compares the catalog (which rescans only when the data
    dir changed) with what it announced: new datasets and changed contents
    are published, removed datasets withdrawn. The ``Publisher`` re-signs each
    record before it expires.
    """

    def __init__(
        self,
        catalog: DatasetCatalog,
        tls: TlsMaterial,
        addresses: Callable[[], Sequence[str]],
        cfg: DataNodeSection,
    ) -> None:
        self.catalog = catalog
        self.tls = tls
        self.cfg = cfg
        self._addresses = addresses
        self.dht: DhtNode | None = None
        self.publisher: Publisher | None = None
        #: Dataset name -> (slice count, manifest digest) last announced.
        self.announced: dict[str, tuple[int, str]] = {}
        self._tasks = BackgroundTasks(log)

    async def start(self) -> None:
        key = serialization.load_pem_private_key(self.tls.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError("tls.key: provider records are signed with an ECDSA (P-256) node key")
        chain = x509.load_pem_x509_certificates(self.tls.cert_chain_pem)
        verifier = RecordVerifier(self.tls.trusted_cas, revocation=self.tls.revocation)
        self.dht = await DhtNode.create(
            self.cfg.dht_host,
            self.cfg.dht_port,
            self.cfg.dht_bootstrap,
            verifier=verifier,
            rpc_timeout_s=self.cfg.dht_rpc_timeout_s,
        )
        self.publisher = Publisher(self.dht, key, chain, lifetime_s=self.cfg.record_ttl_s)
        await self.publisher.start()
        self._tasks.spawn(self._run(), "dataset-announcer")
        log.info(
            "DHT endpoint on %s:%d, bootstrapping through %s",
            self.dht.host,
            self.dht.port,
            ", ".join(self.cfg.dht_bootstrap),
        )

    async def stop(self) -> None:
        await self._tasks.cancel()
        if self.publisher is not None:
            await self.publisher.stop()
        if self.dht is not None:
            await self.dht.stop()

    async def sync(self) -> None:
        """Announce what is new or changed, withdraw what is gone."""
        assert self.publisher is not None, "sync() before start()"
        datasets = await self.catalog.datasets()
        # Keyed by the manifest's digest too: a dataset rebuilt in place is announced anew, pinned
        # to its new content.
        wanted = {
            name: (dataset.manifest.slice_count, dataset.manifest.digest())
            for name, dataset in datasets.items()
        }
        for name in sorted(set(self.announced) - set(wanted)):
            self.publisher.withdraw(name)
            del self.announced[name]
            log.info("withdrew provider record for %s", name)
        addresses = list(self._addresses())
        for name, (slice_count, pin) in sorted(wanted.items()):
            if self.announced.get(name) == (slice_count, pin):
                continue
            await self.publisher.publish(name, addresses, slice_count, pin)
            self.announced[name] = (slice_count, pin)
            log.info("announced %s (%d slices) at %s", name, slice_count, ", ".join(addresses))

    async def _run(self) -> None:
        # NOTE: polling, because a data dir has no portable change notification; the catalog
        # makes an unchanged poll a handful of stat calls.
        while True:
            try:
                await self.sync()
            except (HyphaError, OSError) as err:
                log.warning("announcing datasets failed: %s", err)
            await asyncio.sleep(self.cfg.announce_poll_s)


class DataNode(Node):
    catalog: DatasetCatalog
    servicer: DataNodeServicer
    announcer: DatasetAnnouncer | None


def build(settings: DataNodeSettings, tls: TlsMaterial) -> DataNode:
    cfg = settings.data
    catalog = DatasetCatalog(cfg.data_dir)
    servicer = DataNodeServicer(
        catalog,
        chunk_bytes=cfg.chunk_bytes,
        max_concurrent_streams=cfg.max_concurrent_streams,
        stream_wait_s=cfg.stream_wait_s,
        trust_verified_s=cfg.trust_verified_s,
        wire_compression=cfg.wire_compression,
    )
    bindings: list[ServiceBinding] = [(add_data_node_servicer, servicer, "hypha.v1.DataNode")]
    node = DataNode.from_settings(settings, tls, bindings, grace_s=cfg.grace_s)
    node.catalog = catalog
    node.servicer = servicer
    node.announcer = None
    # Attached to its gateways (net.gateways) like any node, a data node is
    # reachable through the relay too: fetchers behind NAT, or a data node with
    # no inbound port, still get their slices. It dials no peers itself, so the
    # connector's timeout only bounds its (unused) direct dials.
    if not MeshParts.create(settings, tls, connect_timeout_s=10.0).attach(node, bindings):
        log.info("no gateway configured (net.gateways): serving direct connections only")
    if cfg.dht_bootstrap:
        node.announcer = DatasetAnnouncer(catalog, tls, lambda: node.addresses, cfg)
        node.add_part(node.announcer)
    return node
