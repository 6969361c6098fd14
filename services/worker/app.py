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

from hypha.market.leases import Lease, LeaseState
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.mesh import MeshParts
from hypha.net.relay import Relay
from hypha.net.tls import TlsMaterial
from hypha.node import Node
from hypha.v1 import worker_pb2_grpc
from hypha.worker import resources
from hypha.worker.config import WorkerSettings
from hypha.worker.fetcher import SliceFetcher
from hypha.worker.job_state import JobDispatch
from hypha.worker.jobs import JobManager
from hypha.worker.jobs_servicer import WorkerJobs
from hypha.worker.market import WorkerMarket
from hypha.worker.scheduler_link import GrpcSchedulerLink, SchedulerLink
from hypha.worker.servicer import WorkerServicer
from hypha.worker.transfer import TensorExchange

log = logging.getLogger(__name__)


class WorkerNode(Node):
    link: NodeLink | None
    relay: Relay | None
    connector: PeerConnector
    market: WorkerMarket
    servicer: WorkerServicer
    manager: JobManager


class _JobsPart:
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


def build(settings: WorkerSettings, tls: TlsMaterial) -> WorkerNode:
    cfg = settings.worker
    work_root = settings.work_dir()
    capacity = resources.capacity(work_root, cfg.resources.limits(), cfg.max_resources.limits())
    mesh = MeshParts.create(settings, tls, cfg.connect_timeout_s)
    link, relay, connector = mesh.link, mesh.relay, mesh.connector
    market = WorkerMarket(tls.identity.peer_id, link, connector, cfg, capacity)
    exchange = TensorExchange(connector, cfg.jobs.transfer_settings())
    slices = SliceFetcher(tls, work_root / "slice-cache")

    def link_factory(dispatch: JobDispatch) -> SchedulerLink:
        return GrpcSchedulerLink(connector, dispatch.scheduler_id, dispatch.scheduler_addresses)

    manager = JobManager(
        cfg.jobs,
        work_root,
        exchange=exchange,
        link_factory=link_factory,
        worker_id=tls.identity.peer_id,
        cpu_count=max(1, int(capacity.cpu)),
        gpu_count=int(capacity.gpu),
        slices=slices,
    )

    def lease_ok(lease_id: str, scheduler_id: str) -> bool:
        lease = market.ledger.find(lease_id)
        return lease is not None and lease.holder == scheduler_id and lease.state is LeaseState.ACTIVE

    jobs = WorkerJobs(manager, exchange, lease_ok=lease_ok, executors=cfg.executors)
    servicer = WorkerServicer(market, settings.name, jobs, manager.result_of)

    async def lease_ended(lease: Lease) -> None:
        await manager.cancel_jobs_for_lease(lease.lease_id, f"lease {lease.lease_id} ended")

    market.on_lease_end.append(lease_ended)
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
    return node
