"""In-process gateway meshes and node links for gateway tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from hypha.gateway.app import GatewayNode, build
from hypha.gateway.config import GatewaySettings
from hypha.net.link import NodeLink
from tests.conftest import Pki
from tests.helpers import eventually


def gateway_settings(pki: Pki, name: str, peers: list[str] | None = None, **gateway: Any) -> GatewaySettings:
    paths = pki.paths(name)
    return GatewaySettings(
        name=name,
        tls={"cert": paths.cert, "key": paths.key, "trust": paths.trust},
        net={"listen": "127.0.0.1:0"},
        gateway={
            "peers": peers or [],
            "dht_port": None,
            "reconnect_base_s": 0.05,
            "reconnect_cap_s": 0.5,
            **gateway,
        },
    )


class Mesh:
    def __init__(self, pki: Pki) -> None:
        self.pki = pki
        self.gateways: list[GatewayNode] = []
        self.links: list[NodeLink] = []

    async def add_gateway(self, name: str, peers: list[str] | None = None, **gateway: Any) -> GatewayNode:
        self.pki.issue("gateway", name)
        node = build(gateway_settings(self.pki, name, peers, **gateway), self.pki.tls(name))
        await node.start()
        self.gateways.append(node)
        return node

    async def full_mesh(self, count: int, **gateway: Any) -> list[GatewayNode]:
        nodes: list[GatewayNode] = []
        for i in range(count):
            nodes.append(await self.add_gateway(f"gw{i}", [g.address for g in nodes], **gateway))
        await eventually(
            lambda: all(
                {link.gateway_id for link in g.hub.links} >= {o.peer_id for o in nodes if o is not g}
                for g in nodes
            ),
            timeout=10,
            message="gateways linked",
        )
        return nodes

    async def add_link(self, role: str, name: str, gateways: list[str], **kwargs: Any) -> NodeLink:
        tls = self.pki.issue(role, name)
        link = NodeLink(tls, gateways, name=name, backoff_base_s=0.05, backoff_cap_s=0.5, **kwargs)
        await link.start()
        self.links.append(link)
        await link.wait_connected(10)
        return link

    async def close(self) -> None:
        for link in self.links:
            await link.stop()
        for node in self.gateways:
            await node.stop()


@pytest.fixture
async def mesh(pki: Pki) -> AsyncIterator[Mesh]:
    m = Mesh(pki)
    yield m
    await m.close()


async def until(predicate: Callable[[], Any | Awaitable[Any]], message: str, timeout: float = 10) -> Any:
    return await eventually(predicate, timeout=timeout, message=message)
