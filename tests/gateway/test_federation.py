"""A gateway's outgoing federation links, driven on their own: a ``Federation`` with a bare ``Hub``
dials a real gateway over mTLS. The link is named by the peer's certificate, refused to anything
that is not a gateway or is this gateway, and brought back when it drops.

(A peer whose presence claims another gateway's id: ``tests/security/test_peer_pinning.py``.)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from hypha.gateway.config import GatewaySection
from hypha.gateway.federation import Federation
from hypha.gateway.hub import Hub, Session
from hypha.gateway.outbox import Outbox
from hypha.net.options import DEFAULT_MAX_MESSAGE_BYTES
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import Role
from hypha.v1 import gateway_pb2
from tests.conftest import Pki
from tests.gateway.conftest import Mesh, until


@dataclass
class Dialler:
    """A federation and its hub, as one gateway process holds them (no server of its own)."""

    hub: Hub
    federation: Federation


@pytest.fixture
async def diallers() -> AsyncIterator[list[Dialler]]:
    started: list[Dialler] = []
    yield started
    for d in started:
        await d.federation.stop()
        await d.hub.stop()


async def dial(diallers: list[Dialler], tls: TlsMaterial, *peers: str, gateway_id: str = "") -> Dialler:
    """Start a federation to ``peers`` with fast reconnects (50 ms, capped at 0.5 s)."""
    hub = Hub(gateway_id or tls.identity.peer_id)
    config = GatewaySection(peers=list(peers), reconnect_base_s=0.05, reconnect_cap_s=0.5, dht_port=None)
    dialler = Dialler(hub, Federation(hub, tls, config, DEFAULT_MAX_MESSAGE_BYTES))
    diallers.append(dialler)
    await dialler.federation.start()
    return dialler


async def test_the_link_is_named_by_the_peers_certificate_and_carries_both_ways(
    mesh: Mesh, diallers: list[Dialler]
) -> None:
    # Prepare: a real gateway with a subscriber attached; a local node on the dialling hub.
    remote = await mesh.add_gateway("fed-remote")
    listener = await mesh.add_link("worker", "fed-listener", [remote.address])
    inbox = listener.subscribe("t")
    await until(lambda: "t" in remote.hub.topics, "subscribed at the remote gateway")
    tls = mesh.pki.issue("gateway", "fed-dialler")
    local_hub_session = Session("local-node", Role.SCHEDULER, Outbox(16, "local-node"))

    # Execute
    dialler = await dial(diallers, tls, remote.address)
    dialler.hub.attach(local_hub_session)
    await until(lambda: dialler.hub.links, "linked")

    # Assert: each side names the other by its certificate, and learns who is attached there.
    assert [link.gateway_id for link in dialler.hub.links] == [remote.peer_id]
    await until(
        lambda: [link.gateway_id for link in remote.hub.links] == [tls.identity.peer_id], "linked back"
    )
    assert listener.peer_id in dialler.hub.remote[remote.peer_id]
    await until(lambda: "local-node" in remote.hub.remote.get(tls.identity.peer_id, {}), "presence sent")

    # A publish on the dialling hub crosses the link to the remote subscriber, sender stamped.
    dialler.hub.publish(local_hub_session, gateway_pb2.Publish(topic="t", payload=b"over the link"))
    message = await inbox.get(timeout=10)
    assert (message.payload, message.from_peer) == (b"over the link", "local-node")


async def test_a_server_that_is_not_a_gateway_is_refused_and_retried(
    pki: Pki, diallers: list[Dialler], caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a worker's server where a gateway was expected.
    caplog.set_level(logging.WARNING, logger="hypha.gateway.federation")
    async with NodeServer(pki.tls("worker"), "127.0.0.1:0", []) as server:
        # Execute
        dialler = await dial(diallers, pki.issue("gateway", "fed-picky"), server.address)

        # Assert: refused before any frame is sent, and tried again after a backoff, never linked.
        await until(lambda: caplog.text.count("refused") >= 2, "refused twice")
        assert "is a worker, expected gateway" in caplog.text
        assert dialler.hub.links == [] and dialler.hub.remote == {}


async def test_a_peer_address_that_is_this_gateway_is_never_linked(
    mesh: Mesh, diallers: list[Dialler], caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a gateway whose peer list names its own address (a copied config), and a worker's
    # server that is refused on every try: its retries show that time passed for the other.
    caplog.set_level(logging.WARNING, logger="hypha.gateway.federation")
    remote = await mesh.add_gateway("fed-self")
    async with NodeServer(mesh.pki.tls("worker"), "127.0.0.1:0", []) as server:
        # Execute: dial both with the gateway's own certificate.
        dialler = await dial(diallers, mesh.pki.tls("fed-self"), remote.address, server.address)

        # Assert: noticed once, then parked (no retry loop against itself), never linked.
        await until(lambda: caplog.text.count("refused") >= 4, "the worker refused four times")
        assert caplog.text.count("is this gateway") == 1
        assert dialler.hub.links == [] and remote.hub.links == []


async def test_a_dropped_link_is_dialled_again(mesh: Mesh, diallers: list[Dialler]) -> None:
    # Prepare: a linked pair.
    remote = await mesh.add_gateway("fed-flaky")
    dialler = await dial(diallers, mesh.pki.issue("gateway", "fed-redial"), remote.address)
    await until(lambda: dialler.hub.links and remote.hub.links, "linked")
    (first,) = dialler.hub.links

    # Execute: the remote gateway ends the link (as when it sheds the stream).
    remote.hub.remove_link(remote.hub.links[0])

    # Assert: the dialler notices, drops the old link and opens a new one.
    await until(
        lambda: len(dialler.hub.links) == 1 and dialler.hub.links[0] is not first, "link re-established"
    )
    assert first.outbox.closed
    assert dialler.hub.links[0].serial > first.serial
    await until(lambda: len(remote.hub.links) == 1, "linked back at the remote")


async def test_stop_takes_the_link_down_on_both_sides(mesh: Mesh, diallers: list[Dialler]) -> None:
    remote = await mesh.add_gateway("fed-stop")
    dialler = await dial(diallers, mesh.pki.issue("gateway", "fed-stopper"), remote.address)
    await until(lambda: dialler.hub.links and remote.hub.links, "linked")
    link = dialler.hub.links[0]

    await dialler.federation.stop()

    # Assert: the stream ends at once; gRPC's request task then lets go of the link on each side.
    assert link.outbox.closed
    await until(lambda: dialler.hub.links == [], "the dialler let go of the link")
    await until(lambda: remote.hub.links == [] and remote.hub.remote == {}, "the remote saw the link end")
