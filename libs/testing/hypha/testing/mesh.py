"""Gateways and node links started in-process, for mesh tests and the relay/pubsub benchmarks.

Gateways bind 127.0.0.1:0 and reconnect fast (50 ms base, 0.5 s cap), so a
test that kills a link sees it come back well within its deadline. Needs the
gateway role (``hypha-ml-gateway``), imported when the first gateway starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hypha.net.link import NodeLink
from hypha.testing.pki import Pki
from hypha.testing.polling import eventually

if TYPE_CHECKING:
    from hypha.gateway.app import GatewayNode
    from hypha.gateway.config import GatewaySettings


def gateway_settings(pki: Pki, name: str, peers: list[str] | None = None, **gateway: Any) -> GatewaySettings:
    """Settings of an in-process gateway ``name`` (its certificate in ``pki``), peering with ``peers``."""
    from hypha.gateway.config import GatewaySettings

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
    """Gateways and node links a test starts; ``close()`` stops them all (links first)."""

    def __init__(self, pki: Pki) -> None:
        self.pki = pki
        self.gateways: list[GatewayNode] = []
        self.links: list[NodeLink] = []

    async def add_gateway(self, name: str, peers: list[str] | None = None, **gateway: Any) -> GatewayNode:
        from hypha.gateway.app import build

        self.pki.issue("gateway", name)
        node = build(gateway_settings(self.pki, name, peers, **gateway), self.pki.tls(name))
        await node.start()
        self.gateways.append(node)
        return node

    async def full_mesh(self, count: int, **gateway: Any) -> list[GatewayNode]:
        """``count`` gateways, each peering with those before it; returns once all are linked."""
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
        """A node link with a new ``role`` certificate ``name``, connected to one of ``gateways``."""
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
