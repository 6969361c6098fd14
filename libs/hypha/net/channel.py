"""Client channels to other nodes: mTLS with this node's certificate, and
``check_server``: is the server at an address the peer we meant, in good standing?"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from cryptography import x509

from hypha.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from hypha.net.options import DEFAULT_KEEPALIVE_S, DEFAULT_MAX_MESSAGE_BYTES, grpc_options
from hypha.net.telemetry import client_interceptors
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import PeerIdentity, Role


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


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UnavailableError(f"not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


async def server_identity(
    tls: TlsMaterial, address: str, *, server_name: str | None = None, timeout_s: float = 5.0
) -> PeerIdentity:
    """The identity in the certificate the server at ``address`` presents (chain and name verified)."""
    host, port = _host_port(address)
    context = tls.client_ssl_context()
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=server_name or host
            )
    except (OSError, TimeoutError) as err:
        raise UnavailableError(f"TLS handshake with {address} failed: {err}") from err
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError, asyncio.TimeoutError):
            async with asyncio.timeout(1):
                await writer.wait_closed()
    if not der:
        raise UnauthenticatedError(f"{address} presented no certificate")
    try:
        return PeerIdentity.of_certificate(x509.load_der_x509_certificate(der))
    except ValueError as err:
        raise UnauthenticatedError(f"{address} presented an unreadable certificate: {err}") from err


async def check_server(
    tls: TlsMaterial,
    address: str,
    *,
    peer_id: str | None = None,
    roles: frozenset[Role] | None = None,
    server_name: str | None = None,
    timeout_s: float = 5.0,
) -> PeerIdentity:
    """The server's identity, once it is known not revoked (the whole chain, our CRL) and,
    when given, the ``peer_id`` we dialled with one of ``roles``.

    Raises UnauthenticatedError (revoked), PermissionDeniedError (someone else
    answered) or UnavailableError (no handshake). This is a handshake of its
    own, before the gRPC channel's: a server swapping certificates between the
    two would need a second valid, unrevoked certificate for the same address.
    """
    peer = await server_identity(tls, address, server_name=server_name, timeout_s=timeout_s)
    if tls.revocation.is_revoked(peer.issuer, peer.serial, peer.authority_key_id):
        raise UnauthenticatedError(f"{address} presents a revoked certificate ({peer.name or peer.peer_id})")
    if peer_id is not None and peer.peer_id != peer_id:
        raise PermissionDeniedError(f"{address} is {peer.peer_id}, not the peer {peer_id} we dialled")
    if roles is not None and peer.role not in roles:
        raise PermissionDeniedError(f"{address} is a {peer.role.value}, expected {', '.join(sorted(roles))}")
    return peer
