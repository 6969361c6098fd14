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
from typing import Any, Protocol

from hypha.net.server import NodeServer, ServiceBinding
from hypha.net.telemetry import shutdown_tracing
from hypha.net.tls import TlsMaterial

log = logging.getLogger(__name__)


class Part(Protocol):
    """A long-lived background part of a node."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class Node:
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
    ) -> None:
        self.name = name
        self.tls = tls
        self.server = NodeServer(
            tls,
            listen,
            services,
            max_message_bytes=max_message_bytes,
            keepalive_s=keepalive_s,
            grace_s=grace_s,
        )
        self.parts: list[Part] = []
        self._external = list(external_addresses or [])
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
        """Where peers can call this node directly."""
        return self._external or [self.server.address]

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

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
