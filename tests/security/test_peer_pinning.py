"""Peers are who we dialled (issue 16): a direct address is used only when its certificate is the
peer id asked for, and a federation peer's gateway id comes from TLS, not from its presence."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from hypha.errors import UnavailableError
from hypha.net.connector import PeerConnector
from hypha.net.server import NodeServer
from hypha.pki.identity import Role
from hypha.testing.mesh import Mesh
from hypha.testing.polling import eventually
from tests.conftest import Pki


@pytest.fixture
async def worker_server(pki: Pki) -> AsyncIterator[NodeServer]:
    server = NodeServer(pki.tls("worker"), "127.0.0.1:0", [])
    async with server:
        yield server


async def test_an_address_that_answers_as_another_peer_is_not_dialled(
    pki: Pki, worker_server: NodeServer
) -> None:
    # Someone advertised the worker's address under another peer's id (a presence, DHT record or
    # offer can name any address); with no relay the peer is unreachable rather than impersonated.
    connector = PeerConnector(pki.tls("scheduler"), None, connect_timeout_s=2.0)
    other = pki.tls("data").identity.peer_id
    try:
        with pytest.raises(UnavailableError, match="unreachable"):
            await connector.channel(other, [worker_server.address])
        assert connector.is_direct(other) is None
    finally:
        await connector.close()


async def test_the_peer_dialled_is_reached_directly_and_a_wrong_role_is_not(
    pki: Pki, worker_server: NodeServer
) -> None:
    worker_id = pki.tls("worker").identity.peer_id
    connector = PeerConnector(pki.tls("scheduler"), None, connect_timeout_s=2.0)
    try:
        await connector.channel(worker_id, [worker_server.address], roles=frozenset({Role.WORKER}))
        assert connector.is_direct(worker_id) is True
        await connector.invalidate(worker_id)
        with pytest.raises(UnavailableError):
            await connector.channel(worker_id, [worker_server.address], roles=frozenset({Role.SCHEDULER}))
    finally:
        await connector.close()


async def test_a_federation_peer_claiming_another_gateways_id_is_not_linked(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    mesh = Mesh(pki)
    try:
        honest = await mesh.add_gateway("pin-honest")
        liar = await mesh.add_gateway("pin-liar")
        liar.hub.gateway_id = honest.peer_id  # its presence now claims the honest gateway's id
        caplog.set_level(logging.WARNING, logger="hypha.gateway.federation")

        dialler = await mesh.add_gateway("pin-dialler", [liar.address])

        await eventually(
            lambda: "presence claims" in caplog.text, message="the lying peer refused", timeout=10
        )
        assert f"is {liar.peer_id} but its presence claims {honest.peer_id}" in caplog.text
        assert dialler.hub.links == []
        assert honest.peer_id not in dialler.hub.remote
    finally:
        await mesh.close()
