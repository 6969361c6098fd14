"""Wiring of the worker process: what it serves and in which order it starts and stops.

Start order (``Node.start``): gRPC server (bound, so its address is known),
gateway link (announces that address), relay (serves the Worker service to
peers that cannot reach the server), market (intake, offers, pruner), job
manager (accepts dispatches from here on).
Stop order is the reverse: the job manager stops every execution first
(SIGTERM, grace, SIGKILL) while the link can still carry their final status
reports and logs, then the market stops deciding, the relay finishes relayed
calls, the link closes, the slice fetcher closes its channels, then the
server drains.

A lease that ends (expired because its scheduler stopped renewing it, or
released) cancels every job dispatched under it.

Without any gateway configured the worker still serves its status but is not
on the market (nothing reaches it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hypha.market.leases import Lease, LeaseState
from hypha.market.resources import Resources
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.mesh import MeshParts
from hypha.net.metrics_server import MetricsServer
from hypha.net.relay import Relay
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.service import Service
from hypha.worker import resources
from hypha.worker.config import WorkerSettings
from hypha.worker.execution_state import JobDispatch
from hypha.worker.fetcher import SliceFetcher
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_servicer import WorkerJobs
from hypha.worker.market import WorkerMarket
from hypha.worker.metrics import WorkerMetrics
from hypha.worker.scheduler_link import GrpcSchedulerLink, SchedulerLink
from hypha.worker.servicer import WorkerServicer
from hypha.worker.tensor_frames import add_worker_servicer
from hypha.worker.transfer import TensorExchange

log = logging.getLogger(__name__)


class WorkerNode(Node):
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector
    market: WorkerMarket
    servicer: WorkerServicer
    manager: JobManager
    metrics: MetricsServer | None

    def ready_info(self) -> dict[str, Any]:
        metrics = f"https://{self.metrics.address}/metrics" if self.metrics else ""
        return {**super().ready_info(), "metrics": metrics}


class _JobsPart(Service):
    """The job manager and the slice fetcher as one node part (they stop together)."""

    def __init__(self, manager: JobManager, slices: SliceFetcher) -> None:
        self.manager = manager
        self.slices = slices

    async def start(self) -> None:
        await self.manager.start()

    async def stop(self) -> None:
        try:
            await self.manager.stop()
        finally:
            await self.slices.close()


def _own_files(settings: WorkerSettings) -> list[Path]:
    """What no executor's sandbox may show: the key and certificate dirs, the state dir."""
    paths = [settings.tls.key.parent, settings.tls.cert.parent, settings.tls.key, settings.tls.cert]
    return [p.absolute() for p in paths] + ([settings.state_dir] if settings.state_dir is not None else [])


def build(settings: WorkerSettings, tls: TlsMaterial) -> WorkerNode:
    cfg = settings.worker
    work_root = settings.work_dir()
    capacity = resources.capacity(work_root, cfg.resources.limits(), cfg.max_resources.limits())
    mesh = MeshParts.create(settings, tls, cfg.connect_timeout_s)
    link, relay, connector = mesh.link, mesh.relay, mesh.connector
    market = WorkerMarket(tls.identity.peer_id, link, connector, cfg, capacity)
    exchange = TensorExchange(connector, cfg.jobs.transfer_settings(work_root / "tensor-spool"))
    slices = SliceFetcher(
        tls,
        work_root / "slice-cache",
        peers=connector,
        max_cache_bytes=cfg.jobs.slice_cache_bytes,
        chunk_timeout_s=cfg.jobs.slice_chunk_timeout_s,
    )

    def link_factory(dispatch: JobDispatch) -> SchedulerLink:
        return GrpcSchedulerLink(connector, dispatch.scheduler_id, dispatch.scheduler_addresses)

    def lease_grants(lease_id: str) -> Resources | None:
        lease = market.ledger.find(lease_id)
        return None if lease is None else lease.resources

    manager = JobManager(
        cfg.jobs,
        work_root,
        exchange=exchange,
        link_factory=link_factory,
        worker_id=tls.identity.peer_id,
        cpu_count=max(1, int(capacity.cpu)),
        gpu_count=int(capacity.gpu),
        slices=slices,
        hidden=_own_files(settings),
        lease_grants=lease_grants,
        configured_executors=settings.executors,
    )

    def lease_ok(lease_id: str, scheduler_id: str) -> bool:
        lease = market.ledger.find(lease_id)
        return lease is not None and lease.holder == scheduler_id and lease.state is LeaseState.ACTIVE

    jobs = WorkerJobs(manager, exchange, lease_ok=lease_ok, executors=cfg.executors)
    servicer = WorkerServicer(market, settings.name, jobs, manager.result_of)

    async def lease_ended(lease: Lease) -> None:
        expired = lease.state is LeaseState.EXPIRED
        await manager.cancel_jobs_for_lease(lease.lease_id, f"lease {lease.lease_id} ended", expired=expired)

    market.on_lease_end.append(lease_ended)
    bindings = [(add_worker_servicer, servicer, "hypha.v1.Worker")]
    node = WorkerNode.from_settings(settings, tls, bindings, grace_s=cfg.grace_s)
    market.addresses = lambda: node.addresses
    node.link, node.relay, node.connector, node.market, node.servicer, node.manager = (
        link,
        relay,
        connector,
        market,
        servicer,
        manager,
    )
    if not mesh.attach(node, bindings):
        log.warning("no gateway configured (net.gateways): this worker is not on the market")
    node.add_part(market)
    node.add_part(_JobsPart(manager, slices))
    node.metrics = None
    if cfg.metrics_listen:
        registry = WorkerMetrics(market.ledger, manager, exchange, relay).registry
        node.metrics = MetricsServer(registry, tls, cfg.metrics_listen)
        node.add_part(node.metrics)
    return node
