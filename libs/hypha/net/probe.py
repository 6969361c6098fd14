"""Health probe over mTLS: what ``hypha-<role> probe`` and test fixtures use."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hypha.net.channel import secure_channel
from hypha.net.tls import TlsMaterial


async def probe(
    tls: TlsMaterial,
    address: str,
    *,
    timeout_s: float = 5.0,
    service: str = "",
    server_name: str | None = None,
) -> tuple[bool, str]:
    """(healthy, one-line reason). Never raises for network or TLS failures.

    ``server_name`` is the name checked in the server's certificate instead of
    ``address``'s host (as ``secure_channel`` takes it).
    """
    async with secure_channel(tls, address, server_name=server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            details = (err.details() or "").splitlines()[0] if err.details() else ""
            return False, f"{err.code().name}: {details}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, status
