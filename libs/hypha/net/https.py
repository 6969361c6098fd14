"""HTTPS with the network's mutual TLS, for the aiohttp servers nodes run beside gRPC.

The scheduler's REST API and every node's ``/metrics`` accept exactly what the
gRPC servers accept: a client certificate chaining to the trust bundle and not
revoked (same CRL checker). One identity model for every transport means one
way to issue, revoke and audit access; anonymous connections fail in the
handshake, before any handler runs.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path

from aiohttp import web

from hypha.errors import UnauthenticatedError
from hypha.net.tls import TlsMaterial
from hypha.pki.identity import PeerIdentity, identity_of_pem


def _load_chain(ctx: ssl.SSLContext, tls: TlsMaterial) -> None:
    """``ssl`` reads certificates and keys only from files: write them to a private
    temporary directory just long enough to load them."""
    with tempfile.TemporaryDirectory(prefix="hypha-tls-") as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(tls.cert_chain_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(tls.key_pem)
        ctx.load_cert_chain(cert, key)


def server_ssl_context(tls: TlsMaterial) -> ssl.SSLContext:
    """TLS for an HTTPS server: our certificate, and a client certificate required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=tls.trust_pem.decode("ascii"))
    _load_chain(ctx, tls)
    return ctx


def client_ssl_context(tls: TlsMaterial) -> ssl.SSLContext:
    """TLS for an HTTPS client (tests, scripts): verify the server by the trust bundle, present our cert."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=tls.trust_pem.decode("ascii"))
    _load_chain(ctx, tls)
    return ctx


def request_identity(request: web.Request, tls: TlsMaterial) -> PeerIdentity:
    """The caller of an HTTPS request, from its client certificate; revoked ones are refused."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise UnauthenticatedError("no client certificate")
    try:
        peer = identity_of_pem(ssl.DER_cert_to_PEM_cert(der).encode("ascii"))
    except ValueError as err:
        raise UnauthenticatedError(f"unreadable client certificate: {err}") from err
    if tls.revocation.is_revoked(peer.issuer, peer.serial, peer.authority_key_id):
        raise UnauthenticatedError("certificate revoked")
    return peer


async def serve_app(
    app: web.Application, listen: str, ssl_context: ssl.SSLContext | None, *, default_host: str = "0.0.0.0"
) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``listen`` (``HOST:PORT``, port 0 for a free one); (runner, bound port).

    One way for every aiohttp server a node runs (REST, ``/metrics``, the status
    page), so they agree on address parsing, signals (the node handles them) and
    logging (no access log). ``runner.cleanup()`` stops it.
    """
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(
            runner, host.strip("[]") or default_host, int(port), ssl_context=ssl_context
        ).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
