"""A node's gRPC server: mTLS required, guard, health, reflection, telemetry.

Lifecycle: ``start()`` binds and returns the bound port (bind ``:0`` and read
the port back; never pick a "free" port first), ``stop()`` is idempotent and
drains in-flight calls for the grace period, ``async with`` wraps both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from hypha.net.interceptors import ServerGuard
from hypha.net.options import DEFAULT_KEEPALIVE_S, DEFAULT_MAX_MESSAGE_BYTES, grpc_options
from hypha.net.telemetry import server_interceptors
from hypha.net.tls import TlsMaterial

log = logging.getLogger(__name__)

#: (register function from *_pb2_grpc, servicer, full service name)
ServiceBinding = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


class NodeServer:
    def __init__(
        self,
        tls: TlsMaterial,
        listen: str,
        services: list[ServiceBinding],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        grace_s: float = 5.0,
    ) -> None:
        self.tls = tls
        self.listen = listen
        self.grace_s = grace_s
        self.guard = ServerGuard(tls.revocation)
        self.health = health_aio.HealthServicer()
        self._services = services
        self._server = grpc.aio.server(
            interceptors=[*server_interceptors(), self.guard],
            options=grpc_options(max_message_bytes, keepalive_s),
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

    async def __aenter__(self) -> NodeServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
