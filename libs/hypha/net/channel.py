"""Client channels to other nodes: mTLS with this node's certificate."""

from __future__ import annotations

import grpc

from hypha.net.options import DEFAULT_KEEPALIVE_S, DEFAULT_MAX_MESSAGE_BYTES, grpc_options
from hypha.net.telemetry import client_interceptors
from hypha.net.tls import TlsMaterial


def secure_channel(
    tls: TlsMaterial,
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """A channel to ``address``; ``server_name`` overrides the name checked in the server cert."""
    options: list[tuple[str, int | str]] = list(grpc_options(max_message_bytes, keepalive_s))
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=options, interceptors=client_interceptors()
    )
