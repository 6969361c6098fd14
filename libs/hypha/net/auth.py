"""Who is calling: the authenticated peer, read from the TLS session.

The peer id and role come only from the certificate the peer proved it owns
during the handshake; no field of any message can change them.
"""

from __future__ import annotations

import grpc

from hypha.errors import UnauthenticatedError
from hypha.pki.identity import PeerIdentity, identity_of_pem


def peer_identity(context: grpc.aio.ServicerContext) -> PeerIdentity:
    """The caller of the current RPC; raises UnauthenticatedError without a certificate.

    For a call that came through the relay, the caller is the identity the
    gateway stamped from the caller's own TLS session.
    """
    relayed = getattr(context, "relay_identity", None)
    if relayed is not None:
        return relayed  # type: ignore[no-any-return,unused-ignore]
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert") if auth else None
    if not pems:
        raise UnauthenticatedError("no client certificate")
    try:
        return identity_of_pem(pems[0])
    except ValueError as err:
        raise UnauthenticatedError(f"unreadable client certificate: {err}") from err
