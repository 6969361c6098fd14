"""The worker's Prometheus metrics (``hypha_worker_*``), read at scrape time from the parts that count.

Leases come from the market's ledger, executions from the job manager,
tensor bytes from the tensor exchange (the same wire-byte count a job's
``bytes_exchanged`` reports), relay drops from the relay; nothing is counted
twice. Served by ``hypha.net.metrics_server`` on ``worker.metrics_listen``
(off by default).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hypha.market.leases import LeaseLedger, LeaseState
from hypha.net.relay import Relay
from hypha.worker.execution_state import ExecutionState
from hypha.worker.job_manager import JobManager
from hypha.worker.transfer import TensorExchange


class WorkerMetrics(Collector):
    """The worker's figures on a registry of their own."""

    def __init__(
        self, ledger: LeaseLedger, manager: JobManager, exchange: TensorExchange, relay: Relay | None
    ) -> None:
        self.ledger = ledger
        self.manager = manager
        self.exchange = exchange
        self.relay = relay
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        leases = GaugeMetricFamily(
            "hypha_worker_leases",
            "Live leases: temporary (reserved behind an offer) and active (accepted by a scheduler).",
            labels=("state",),
        )
        by_state = Counter(lease.state for lease in self.ledger.live())
        for state in (LeaseState.TEMPORARY, LeaseState.ACTIVE):
            leases.add_metric((state.value,), by_state[state])
        yield leases
        executions = GaugeMetricFamily(
            "hypha_worker_executions", "Job executions this worker holds, by state.", labels=("state",)
        )
        by_execution = Counter(record.state for record in self.manager.records())
        for execution_state in ExecutionState:
            executions.add_metric((execution_state.value,), by_execution[execution_state])
        yield executions
        tensor_bytes = CounterMetricFamily(
            "hypha_worker_tensor_bytes",
            "Tensor bytes exchanged with other workers (gRPC messages as sent), by direction: pushed "
            "(sent) and pulled (fetched).",
            labels=("direction",),
        )
        for direction, size in sorted(self.exchange.bytes_total.items()):
            tensor_bytes.add_metric((direction,), size)
        yield tensor_bytes
        transfers = CounterMetricFamily(
            "hypha_worker_tensor_transfers",
            "Tensor transfers by outcome: received, refused, sent, send_retries, served (pulls answered).",
            labels=("outcome",),
        )
        for outcome, count in sorted(self.exchange.stats.items()):
            transfers.add_metric((outcome,), count)
        yield transfers
        yield CounterMetricFamily(
            "hypha_worker_relay_frames_dropped",
            "Relay frames dropped: not a relay frame, or for no call this worker knows.",
            self.relay.ignored_frames if self.relay is not None else 0,
        )
