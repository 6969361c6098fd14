"""A worker's /metrics: leases from its ledger, tensor bytes from real transfers, served over mTLS."""

from __future__ import annotations

from pathlib import Path

from hypha.market.leases import LeaseLedger
from hypha.market.resources import Resources
from hypha.net.metrics_server import MetricsServer
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.metrics import WorkerMetrics
from tests.conftest import Pki
from tests.gateway.test_metrics import scrape
from tests.helpers import eventually
from tests.market_net.conftest import market
from tests.market_net.test_market_net import TASK, Market
from tests.worker.fakes import FakeSchedulerLink
from tests.worker.test_tensor_transfer import JOB, Node, pair, write_state

__all__ = ["market", "pair"]  # the fixtures, shared with the transfer and market tests


async def test_worker_metrics_report_leases_and_the_tensor_bytes_really_moved(
    pair: tuple[Node, Node], pki: Pki, tmp_path: Path
) -> None:
    # Prepare: A's ledger holds one active and one temporary lease; A pushes a delta to B and
    # pulls B's published update.
    a, b = pair
    ledger = LeaseLedger(Resources(cpu=8, memory_gb=16))
    active = ledger.reserve("sched", Resources(cpu=2), ttl_s=30, now=0.0)
    ledger.activate(active.lease_id, "sched", ttl_s=30, now=0.0)
    ledger.reserve("sched", Resources(cpu=1), ttl_s=30, now=0.0)
    write_state(tmp_path / "delta.safetensors", megabytes=1)
    write_state(tmp_path / "update.safetensors", megabytes=1, seed=1)
    await b.exchange.publish(JOB, "update", 1, tmp_path / "update.safetensors")
    accepted, _ = await a.exchange.send(
        JOB, b.peer_id, [b.server.address], "delta", 1, 8, tmp_path / "delta.safetensors"
    )
    assert accepted
    assert await a.exchange.fetch(JOB, b.peer_id, [b.server.address], "update", 1, timeout_s=20) is not None
    manager = JobManager(
        JobsSection(), tmp_path / "jobs", exchange=a.exchange, link_factory=lambda d: FakeSchedulerLink()
    )
    metrics = WorkerMetrics(ledger, manager, a.exchange, relay=None)

    # Execute: scrape over mTLS with a certificate of the network.
    async with MetricsServer(metrics.registry, pki.tls("worker"), "127.0.0.1:0") as server:
        samples = await scrape(f"https://{server.address}/metrics", pki.tls("client"), pki.tls("client"))

    # Assert: the figures are the exchange's own per-job wire-byte counts, summed.
    pushed, pulled = a.exchange.job_bytes(JOB)
    assert pushed > 1_000_000 and pulled > 1_000_000
    assert samples["hypha_worker_tensor_bytes_total{direction=pushed}"] == pushed
    assert samples["hypha_worker_tensor_bytes_total{direction=pulled}"] == pulled
    assert samples["hypha_worker_leases{state=active}"] == 1
    assert samples["hypha_worker_leases{state=temporary}"] == 1
    assert samples["hypha_worker_executions{state=running}"] == 0
    assert samples["hypha_worker_tensor_transfers_total{outcome=sent}"] >= 1


async def test_a_worker_with_metrics_listen_serves_its_leases_as_a_scheduler_takes_one(
    market: Market, pki: Pki
) -> None:
    worker = await market.worker("w-metrics", metrics_listen="127.0.0.1:0")
    plain = await market.worker("w-plain", gateway=1)
    scheduler = await market.scheduler("s-metrics", offer_window_s=0.6)
    await market.workers_listening(2)
    assert worker.metrics is not None and plain.metrics is None
    url = worker.ready_info()["metrics"]
    client = pki.tls("client")

    held = await scheduler.market.allocate(TASK, 2)

    assert worker.peer_id in {lease.worker_id for lease in held}

    async def active_lease_shown() -> bool:
        return (await scrape(url, client, client)).get("hypha_worker_leases{state=active}") == 1

    await eventually(active_lease_shown, timeout=10, message="the active lease on /metrics")
