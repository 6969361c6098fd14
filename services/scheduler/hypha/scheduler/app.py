"""Wiring of the scheduler process: what it serves and in which order it starts and stops.

Start order (``Node.start``): gRPC server (bound, so its address is known),
gateway link (announces that address), relay (serves the scheduler's services
to workers that cannot reach the server), market (renewals, standing pool),
jobs (the job store opens, the status bridge starts, the DHT endpoint joins,
jobs a previous process left are settled and the active ones driven again,
then the REST mirror opens; its URL is in the ready info as ``rest``).
Stop order is the reverse: the REST mirror closes, orchestration stops driving jobs (their state
stays in the store; a running DiLoCo job's leases are left to the next start,
``RunRegistry._leave_running``), then the market stops allocating and releases its
other leases while the link and relay can still carry the calls (the workers
cancel what ran under them), then the relay, the link, the server.

The store lives in ``<state_dir>/scheduler.db`` and results in
``<state_dir>/results/``; without a state dir both are temporary (an
in-memory database, a temporary directory removed at stop).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypha.bundles import BUNDLES_DIR, BundleStore
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.mesh import MeshParts
from hypha.net.relay import Relay
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.scheduler.config import SchedulerSettings
from hypha.scheduler.control_servicer import SchedulerControlServicer
from hypha.scheduler.diloco.round_planner import round_planners
from hypha.scheduler.market import SchedulerMarket
from hypha.scheduler.metrics import SchedulerMetrics, StatusBridge
from hypha.scheduler.orchestrator import Orchestrator
from hypha.scheduler.providers import DatasetProviders
from hypha.scheduler.rest import RestServer
from hypha.scheduler.servicer import SchedulerServicer
from hypha.scheduler.status_page import StatusPage
from hypha.scheduler.store import DB_NAME, JobStore
from hypha.v1 import scheduler_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerNode(Node):
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector
    market: SchedulerMarket
    store: JobStore
    orchestrator: Orchestrator
    metrics: SchedulerMetrics
    rest: RestServer | None
    status_page: StatusPage | None

    def ready_info(self) -> dict[str, Any]:
        info = super().ready_info()
        if self.rest is not None:
            info["rest"] = self.rest.url
        if self.status_page is not None:
            info["status_page"] = self.status_page.url
        return info


class _JobsPart:
    """Job store, orchestrator, REST mirror and status bridge: started after the market, stopped before it."""

    def __init__(
        self,
        store: JobStore,
        orchestrator: Orchestrator,
        temp_dir: Path | None,
        rest: RestServer | None,
        bridge: StatusBridge | None,
        status_page: StatusPage | None = None,
    ) -> None:
        self.store = store
        self.orchestrator = orchestrator
        self.temp_dir = temp_dir
        self.rest = rest
        self.bridge = bridge
        self.status_page = status_page

    async def start(self) -> None:
        # The servicers were built with this JobStore before any event loop ran; open it in place.
        await self.store.start()
        if self.bridge is not None:
            await self.bridge.start()
        await self.orchestrator.start()
        if self.rest is not None:
            await self.rest.start()
        if self.status_page is not None:
            await self.status_page.start()

    async def stop(self) -> None:
        try:
            if self.status_page is not None:
                await self.status_page.stop()
            if self.rest is not None:
                await self.rest.stop()
            await self.orchestrator.stop()
            if self.bridge is not None:
                await self.bridge.stop()
        finally:
            await self.store.close()
            if self.temp_dir is not None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)


def build(settings: SchedulerSettings, tls: TlsMaterial) -> SchedulerNode:
    cfg = settings.scheduler
    mesh = MeshParts.create(settings, tls, cfg.connect_timeout_s)
    link, relay, connector = mesh.link, mesh.relay, mesh.connector
    market = SchedulerMarket(tls.identity.peer_id, link, connector, cfg)
    temp_dir: Path | None = None
    if settings.state_dir is not None:
        state_dir = Path(settings.state_dir)
        store = JobStore(state_dir / DB_NAME, max_metric_rows=cfg.jobs.max_metric_rows)
    else:
        temp_dir = state_dir = Path(tempfile.mkdtemp(prefix="hypha-scheduler-"))
        store = JobStore(":memory:", max_metric_rows=cfg.jobs.max_metric_rows)
        log.warning(
            "no state_dir: jobs and results are kept in memory only and lost when this scheduler stops"
        )
    metrics = SchedulerMetrics()
    metrics.watch_store(store.counts)
    providers = DatasetProviders(tls, cfg) if cfg.dht_bootstrap else None
    bridge = StatusBridge(cfg.status_bridge) if cfg.status_bridge else None
    orchestrator = Orchestrator(
        market,
        store,
        cfg,
        state_dir,
        planners=round_planners(cfg.jobs.sync_lookahead),
        providers=providers,
        metrics=metrics,
        status_bridge=bridge,
    )

    async def busy_flags() -> list[bool]:
        return [bool(view.job_id) for view in await orchestrator.list_workers() if view.leases]

    metrics.watch_workers(busy_flags)
    api = SchedulerServicer(
        store, orchestrator, metrics=metrics, bundles=BundleStore(state_dir / BUNDLES_DIR)
    )
    rest = RestServer(api, tls, cfg.rest_listen, metrics=metrics) if cfg.rest_listen else None
    status_page = StatusPage(api, cfg.status_page_listen) if cfg.status_page_listen else None
    bindings = [
        (scheduler_pb2_grpc.add_SchedulerServicer_to_server, api, "hypha.v1.Scheduler"),
        (
            scheduler_pb2_grpc.add_SchedulerControlServicer_to_server,
            SchedulerControlServicer(market, orchestrator),
            "hypha.v1.SchedulerControl",
        ),
    ]
    node = SchedulerNode.from_settings(settings, tls, bindings, grace_s=cfg.grace_s)
    market.addresses = lambda: node.addresses
    node.link, node.relay, node.connector, node.market = link, relay, connector, market
    node.store, node.orchestrator, node.metrics, node.rest = store, orchestrator, metrics, rest
    node.status_page = status_page
    if not mesh.attach(node, bindings):
        log.warning("no gateway configured (net.gateways): this scheduler cannot lease workers")
    node.add_part(market)
    node.add_part(_JobsPart(store, orchestrator, temp_dir, rest, bridge, status_page))
    return node
