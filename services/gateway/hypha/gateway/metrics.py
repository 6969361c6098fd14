"""The gateway's Prometheus metrics (``hypha_gateway_*``), read from the hub at scrape time.

The hub already counts what it routes (``HubStats``); this collector only
reports those counters and the hub's current sessions and links, so nothing
is counted twice. Served by ``hypha.net.metrics_server`` on
``gateway.metrics_listen`` (off by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hypha.gateway.hub import Hub


class GatewayMetrics(Collector):
    """The hub's figures on a registry of their own."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.hub.stats
        messages = CounterMetricFamily(
            "hypha_gateway_messages",
            "Frames the hub handled, by outcome: published by an attached node, delivered to a node, "
            "forwarded to a peer gateway, duplicate (dropped), direct_failed, hop_limited.",
            labels=("outcome",),
        )
        for outcome in ("published", "delivered", "forwarded", "duplicates", "direct_failed", "hop_limited"):
            messages.add_metric((outcome,), getattr(stats, outcome))
        yield messages
        relay = CounterMetricFamily(
            "hypha_gateway_relay_bytes",
            "Payload bytes routed, by kind: direct (node-to-node messages, the relay) and topic.",
            labels=("kind",),
        )
        relay.add_metric(("direct",), stats.direct_bytes)
        relay.add_metric(("topic",), stats.topic_bytes)
        yield relay
        yield CounterMetricFamily(
            "hypha_gateway_queue_drops",
            "Topic frames dropped because a node's or peer gateway's queue was full.",
            stats.dropped,
        )
        yield GaugeMetricFamily("hypha_gateway_attached_nodes", "Nodes attached now.", len(self.hub.sessions))
        yield GaugeMetricFamily(
            "hypha_gateway_federation_links", "Links to peer gateways up now.", len(self.hub.links)
        )
