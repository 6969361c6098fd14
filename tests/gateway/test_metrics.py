"""A gateway's /metrics: the hub's real traffic, served over the network's mTLS (prometheus-client)."""

from __future__ import annotations

import ssl

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypha.gateway.hub import Hub, Session
from hypha.gateway.outbox import Outbox
from hypha.net.https import client_ssl_context
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import Role
from hypha.v1 import gateway_pb2
from tests.gateway.conftest import Mesh


async def scrape(url: str, tls: TlsMaterial | None, trust: TlsMaterial) -> dict[str, float]:
    """Every sample of a /metrics page, keyed ``name{label=value,...}``."""
    ctx = (
        client_ssl_context(tls)
        if tls is not None
        else ssl.create_default_context(cadata=trust.trust_pem.decode())
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url, ssl=ctx, server_hostname="localhost") as response:
            assert response.status == 200
            text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def test_gateway_metrics_show_relayed_bytes_and_attached_nodes_to_any_network_certificate(
    mesh: Mesh,
) -> None:
    gw = await mesh.add_gateway("gw-metrics", metrics_listen="127.0.0.1:0")
    assert gw.metrics is not None and gw.ready_info()["metrics"].endswith("/metrics")
    url = gw.ready_info()["metrics"]
    worker = await mesh.add_link("worker", "metrics-worker", [gw.address])
    scheduler = await mesh.add_link("scheduler", "metrics-scheduler", [gw.address])
    inbox = worker.direct("test")
    payload = b"x" * 1000

    await scheduler.send(worker.peer_id, payload, "test")
    got = await inbox.get(timeout=10)
    assert got.payload == payload

    prometheus = mesh.pki.issue("client", "prometheus")
    samples = await scrape(url, prometheus, prometheus)
    assert samples["hypha_gateway_relay_bytes_total{kind=direct}"] == len(payload)
    assert samples["hypha_gateway_attached_nodes"] == 2
    assert samples["hypha_gateway_queue_drops_total"] == 0
    assert samples["hypha_gateway_messages_total{outcome=delivered}"] >= 1

    # Without a client certificate the handshake fails: figures stay inside the network.
    with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
        await scrape(url, None, prometheus)


async def test_a_full_subscriber_queue_is_counted_as_drops() -> None:
    hub = Hub("gw")
    slow = Session("slow", Role.WORKER, Outbox(1, "slow"))
    publisher = Session("pub", Role.SCHEDULER, Outbox(8, "pub"))
    hub.attach(slow)
    hub.attach(publisher)
    hub.subscribe(slow, "topic")

    for i in range(3):
        hub.publish(publisher, gateway_pb2.Publish(topic="topic", payload=b"abc", message_id=str(i)))

    assert hub.stats.delivered == 1  # routing a topic frame is synchronous: no wait
    assert hub.stats.dropped == 2 and hub.stats.topic_bytes == 9
    hub.detach(slow)
    hub.publish(publisher, gateway_pb2.Publish(topic="topic", payload=b"abc", message_id="gone"))
    assert hub.stats.dropped == 2  # a closed queue is a node leaving, not a drop
