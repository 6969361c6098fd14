"""Who a certificate says its holder is: peer id, role and name.

A node never states its own id or role in a message; the receiving side reads
them from the certificate the peer proved it owns during the TLS handshake.
This module is that reading, and nothing else: no I/O, no gRPC.

- The **role** lives in the Subject's OrganizationalUnitName (exactly one OU,
  whose value is a ``Role``). An OU is visible to every TLS tool (``openssl
  x509 -text``, ``grpcurl``), which a custom extension would not be.
- The **peer id** is derived from the public key only, so renewing a
  certificate with the same key keeps the id (leases, slices and DHT records
  that name the peer stay valid across renewal).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes, PrivateKeyTypes
from cryptography.x509.oid import NameOID

from hypha.errors import InvalidArgumentError, PermissionDeniedError
from hypha.v1 import common_pb2


class Role(StrEnum):
    """What a node may do; enforced on every call by the server guard."""

    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    WORKER = "worker"
    DATA = "data"
    CLIENT = "client"
    ADMIN = "admin"


def role_to_proto(role: Role) -> common_pb2.Role:
    return common_pb2.Role.Value(f"ROLE_{Role(role).name}")  # type: ignore[return-value]


def role_from_proto(value: int) -> Role:
    """The domain role of a wire value; ROLE_UNSPECIFIED and unknown numbers are refused."""
    try:
        name = common_pb2.Role.Name(value)
    except ValueError as err:
        raise InvalidArgumentError(f"unknown role number {value}") from err
    member = name.removeprefix("ROLE_")
    if member not in Role.__members__:
        raise InvalidArgumentError(f"role not set ({name})")
    return Role[member]


def role_of(cert: x509.Certificate) -> Role:
    """The role a certificate grants; PermissionDeniedError when it grants none.

    Exactly one OU is required: a certificate listing two roles is ambiguous,
    and picking one of them would let a CA mistake widen a peer's rights.
    """
    units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(units) != 1:
        raise PermissionDeniedError(f"certificate must carry exactly one role OU, found {len(units)}")
    value = units[0].value
    value = value.decode() if isinstance(value, bytes) else value
    try:
        return Role(value)
    except ValueError as err:
        raise PermissionDeniedError(f"certificate role {value!r} is not a known role") from err


def peer_id_of_public_key(key: CertificatePublicKeyTypes | PrivateKeyTypes) -> str:
    """Lowercase unpadded base32 of the first 20 bytes of sha256(SubjectPublicKeyInfo DER).

    A private key is accepted too (its public half is used), so a node can
    compute its own id before it has a certificate.
    """
    # Public and private key classes share no base type, hence Any.
    obj: Any = key
    public = obj.public_key() if hasattr(obj, "private_bytes") else obj
    spki: bytes = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    # 20 bytes = 160 bits = exactly 32 base32 characters, so there is never padding.
    return base64.b32encode(hashlib.sha256(spki).digest()[:20]).decode("ascii").lower()


def peer_id_of(cert: x509.Certificate) -> str:
    return peer_id_of_public_key(cert.public_key())


def common_name_of(name: x509.Name) -> str:
    """The first CN of a name, or "" when it has none."""
    cns = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not cns:
        return ""
    value = cns[0].value
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class PeerIdentity:
    """An authenticated peer, as read from its certificate."""

    peer_id: str
    role: Role
    #: The Subject CN (the node name given to ``hypha-certutil node --name``).
    name: str
    #: Certificate serial; with ``issuer`` it is what a CRL names.
    serial: int
    issuer: x509.Name
    #: Key id of the issuing CA (AuthorityKeyIdentifier): which of several CAs
    #: sharing a name signed it, for the chain walk of revocation checks.
    authority_key_id: bytes | None = None

    @classmethod
    def of_certificate(cls, cert: x509.Certificate) -> PeerIdentity:
        return cls(
            peer_id=peer_id_of(cert),
            role=role_of(cert),
            name=common_name_of(cert.subject),
            serial=cert.serial_number,
            issuer=cert.issuer,
            authority_key_id=authority_key_id_of(cert),
        )


def authority_key_id_of(cert: x509.Certificate) -> bytes | None:
    try:
        return cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except x509.ExtensionNotFound:
        return None


@lru_cache(maxsize=4096)
def identity_of_pem(pem: bytes) -> PeerIdentity:
    """The identity of the first certificate in ``pem``.

    Called on every gRPC call with the peer's certificate, so results are
    cached by the PEM bytes: after the first call per peer it is a dict lookup.
    Raises ValueError for unparseable PEM and PermissionDeniedError for a
    certificate without a valid role (errors are not cached).
    """
    return PeerIdentity.of_certificate(x509.load_pem_x509_certificate(pem))
