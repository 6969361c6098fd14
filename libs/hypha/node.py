"""The lifecycle every role's process shares.

A role builds a ``Node`` from its settings: the gRPC server with its
servicers plus any background parts (gateway link, arbiter, ...). Shutdown
order is written once here: stop intake (health NOT_SERVING, server drains
for the grace period), stop background parts in reverse start order, flush
telemetry last.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol, Self

from hypha.net.addresses import InterfaceFinder, advertised_addresses, host_addresses
from hypha.net.options import DEFAULT_MAX_CONCURRENT_RPCS, DEFAULT_MAX_RPCS_PER_PEER
from hypha.net.server import NodeServer, ServiceBinding
from hypha.net.telemetry import shutdown_tracing
from hypha.net.tls import TlsMaterial
from hypha.service import Service

if TYPE_CHECKING:
    from hypha.config.common import NodeSettings

log = logging.getLogger(__name__)


class Part(Protocol):
    """A long-lived background part of a node (usually a ``hypha.service.Service``)."""

    async def start(self) -> object: ...
    async def stop(self) -> None: ...


class Node(Service):
    def __init__(
        self,
        name: str,
        tls: TlsMaterial,
        listen: str,
        services: list[ServiceBinding],
        *,
        max_message_bytes: int,
        keepalive_s: float,
        grace_s: float = 5.0,
        external_addresses: list[str] | None = None,
        max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
        max_rpcs_per_peer: int = DEFAULT_MAX_RPCS_PER_PEER,
        find_interfaces: InterfaceFinder = host_addresses,
    ) -> None:
        """``find_interfaces`` lists this host's addresses, for a wildcard listener's
        ``addresses`` (``hypha.net.addresses``; tests pass their own)."""
        self.name = name
        self.tls = tls
        self.server = NodeServer(
            tls,
            listen,
            services,
            max_message_bytes=max_message_bytes,
            keepalive_s=keepalive_s,
            grace_s=grace_s,
            max_concurrent_rpcs=max_concurrent_rpcs,
            max_rpcs_per_peer=max_rpcs_per_peer,
        )
        self.parts: list[Part] = []
        self._external = list(external_addresses or [])
        self._find_interfaces = find_interfaces
        #: ``addresses`` once the port is bound (looking up the host's interfaces once).
        self._advertised: list[str] | None = None
        self._stopped = asyncio.Event()
        self._stopping = False

    @property
    def peer_id(self) -> str:
        return self.tls.identity.peer_id

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def addresses(self) -> list[str]:
        """Where peers can call this node directly: ``net.external_addresses`` if set, else the
        bound address, or for a wildcard listener this host's non-loopback addresses (``address``
        stays the loopback one: it is what a supervisor on this host dials)."""
        if self._advertised is not None:
            return list(self._advertised)
        advertised = advertised_addresses(
            self.server.listen, self.server.port, self._external, find_interfaces=self._find_interfaces
        )
        if self.server.port:  # bound: the answer no longer changes
            self._advertised = advertised
        return advertised

    def ready_info(self) -> dict[str, Any]:
        """What the ready line (and ready file) tells supervisors about this node."""
        return {
            "event": "ready",
            "name": self.name,
            "role": self.tls.identity.role.value,
            "peer_id": self.peer_id,
            "address": self.address,
            "port": self.server.port,
        }

    @classmethod
    def from_settings(
        cls, settings: NodeSettings, tls: TlsMaterial, services: list[ServiceBinding], *, grace_s: float
    ) -> Self:
        """The node a role's settings describe: its name, listener and ``[net]`` limits."""
        net = settings.net
        return cls(
            settings.name,
            tls,
            net.listen,
            services,
            max_message_bytes=net.max_message_bytes,
            keepalive_s=net.keepalive_s,
            max_concurrent_rpcs=net.max_concurrent_rpcs,
            max_rpcs_per_peer=net.max_rpcs_per_peer,
            grace_s=grace_s,
            external_addresses=net.external_addresses,
        )

    def add_part(self, part: Part) -> None:
        self.parts.append(part)

    async def start(self) -> None:
        await self.server.start()
        started: list[Part] = []
        try:
            for part in self.parts:
                await part.start()
                started.append(part)
        except BaseException:
            for part in reversed(started):
                await part.stop()
            await self.server.stop(0)
            raise

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            await self.server.health.enter_graceful_shutdown()
            for part in reversed(self.parts):
                try:
                    await part.stop()
                except Exception:
                    log.exception("error stopping %s", type(part).__name__)
            await self.server.stop()
            shutdown_tracing()
        finally:
            self._stopped.set()
