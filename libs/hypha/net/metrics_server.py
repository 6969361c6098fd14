"""``GET /metrics`` of a node: a ``prometheus_client`` registry, served over the network's mTLS.

Each role keeps its metric set on its own ``CollectorRegistry`` (never the
library's global one, so two nodes in one process, as in tests, never mix
figures). Figures another part already counts (the gateway hub's stats, the
tensor exchange's bytes) are read at scrape time by a custom collector
instead of being counted twice.

The scheduler serves its registry on its REST listener; gateways and workers
serve theirs here, on ``metrics_listen`` when it is set (off by default).
Decision (NOTE): the same mutual TLS as REST and gRPC, any role of the
network, rather than plain HTTP on loopback: figures from a node's market and
traffic stay inside the network, and Prometheus uses one certificate for
every target (``deploy/prometheus/prometheus.yml``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from hypha.errors import HyphaError
from hypha.net.https import request_identity, serve_app, server_ssl_context
from hypha.net.tls import TlsMaterial
from hypha.service import Service

log = logging.getLogger(__name__)

Refresh = Callable[[], Awaitable[None]]


def exposition(registry: CollectorRegistry) -> web.Response:
    """The registry in Prometheus' text format, as an aiohttp response."""
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class MetricsServer(Service):
    """HTTPS (mutual TLS) ``/metrics`` for one registry; ``start`` binds and returns the port."""

    def __init__(
        self, registry: CollectorRegistry, tls: TlsMaterial, listen: str, refresh: Refresh | None = None
    ) -> None:
        self.registry = registry
        self.tls = tls
        self.listen = listen
        #: Awaited before each scrape, for figures that need I/O to read.
        self.refresh = refresh
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            request_identity(request, self.tls)  # any role of the network
        except HyphaError as err:
            return web.Response(status=401, text=err.message)
        if self.refresh is not None:
            await self.refresh()
        return exposition(self.registry)

    async def start(self) -> int:
        if self._runner is not None:
            raise RuntimeError("metrics server already started")
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner, self.port = await serve_app(app, self.listen, server_ssl_context(self.tls))
        log.info("metrics on https://%s/metrics", self.address)
        return self.port

    async def stop(self) -> None:
        """Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
