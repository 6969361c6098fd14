"""A node's gRPC server: mTLS required, guard, health, reflection, telemetry.

Lifecycle: ``start()`` binds and returns the bound port (bind ``:0`` and read
the port back; never pick a "free" port first), ``stop()`` is idempotent and
drains in-flight calls for the grace period, ``async with`` wraps both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from hypha.net.interceptors import DEFAULT_RECHECK_S, ServerGuard
from hypha.net.options import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_RPCS_PER_PEER,
    grpc_options,
)
from hypha.net.telemetry import server_interceptors
from hypha.net.tls import TlsMaterial
from hypha.service import Service

log = logging.getLogger(__name__)

#: (register function from *_pb2_grpc, servicer, full service name)
ServiceBinding = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


class NodeServer(Service):
    def __init__(
        self,
        tls: TlsMaterial,
        listen: str,
        services: list[ServiceBinding],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        grace_s: float = 5.0,
        revocation_recheck_s: float = DEFAULT_RECHECK_S,
        max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
        max_rpcs_per_peer: int = DEFAULT_MAX_RPCS_PER_PEER,
    ) -> None:
        """``max_concurrent_rpcs`` bounds the calls running at once (grpcio answers the next one
        RESOURCE_EXHAUSTED itself); ``max_rpcs_per_peer`` bounds one caller's share (the guard)."""
        self.tls = tls
        self.listen = listen
        self.grace_s = grace_s
        self.guard = ServerGuard(
            tls.revocation, recheck_s=revocation_recheck_s, max_per_peer=max_rpcs_per_peer
        )
        self.health = health_aio.HealthServicer()
        self._services = services
        self._server = grpc.aio.server(
            interceptors=[*server_interceptors(), self.guard],
            options=grpc_options(max_message_bytes, keepalive_s),
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self._started = False
        self._stopped = False
        self.port = 0

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> int:
        if self._started:
            raise RuntimeError("server already started")
        self._started = True
        names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        for register, servicer, name in self._services:
            register(servicer, self._server)
            names.append(name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(names, self._server)
        self.port = self._server.add_secure_port(self.listen, self.tls.server_credentials())
        if self.port == 0:
            raise OSError(f"cannot bind {self.listen}")
        await self._server.start()
        for name in ["", *names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "listening on %s as %s (%s)",
            self.address,
            self.tls.identity.peer_id,
            self.tls.identity.role.value,
        )
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await self._server.stop(self.grace_s if grace_s is None else grace_s)

    async def wait(self) -> None:
        await self._server.wait_for_termination()
