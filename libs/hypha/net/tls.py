"""TLS material for a node: its certificate chain, key, trust bundle and CRL.

Everything a node says about itself on the network is proven by this
material; nothing else (ids, roles) is ever taken from a message body.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from cryptography import x509

from hypha.errors import ConfigError
from hypha.pki.certs import load_cert_chain
from hypha.pki.crl import RevocationChecker
from hypha.pki.identity import PeerIdentity, identity_of_pem


class TlsPaths(Protocol):
    """What a config's ``[tls]`` section provides."""

    @property
    def cert(self) -> Path: ...
    @property
    def key(self) -> Path: ...
    @property
    def trust(self) -> Path: ...
    @property
    def crl(self) -> Path | None: ...


@dataclass(frozen=True)
class PathsTls:
    """A plain ``TlsPaths`` for code that has file names but no config object."""

    cert: Path
    key: Path
    trust: Path
    crl: Path | None = None

    @classmethod
    def from_certs_dir(cls, certs_dir: Path, name: str, crl: Path | None = None) -> PathsTls:
        """The ``--certs DIR --name N`` convention: N-cert.pem, N-key.pem, N-trust.pem."""
        return cls(
            certs_dir / f"{name}-cert.pem",
            certs_dir / f"{name}-key.pem",
            certs_dir / f"{name}-trust.pem",
            crl,
        )


@dataclass
class TlsMaterial:
    """Loaded, validated TLS material; build once per process."""

    cert_chain_pem: bytes
    key_pem: bytes
    trust_pem: bytes
    identity: PeerIdentity
    trusted_cas: list[x509.Certificate]
    revocation: RevocationChecker = field(repr=False)
    #: Where the certificate and key were read from (for ``client_ssl_context``).
    cert_path: Path | None = None
    key_path: Path | None = None
    _client_context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def load(cls, paths: TlsPaths) -> TlsMaterial:
        for label, path in (("tls.cert", paths.cert), ("tls.key", paths.key), ("tls.trust", paths.trust)):
            if not Path(path).is_file():
                raise ConfigError(f"{label}: file not found: {path}")
        chain_pem = Path(paths.cert).read_bytes()
        key_pem = Path(paths.key).read_bytes()
        trust_pem = Path(paths.trust).read_bytes()
        try:
            leaf = load_cert_chain(Path(paths.cert))[0]
            trusted = load_cert_chain(Path(paths.trust))
        except (ValueError, IndexError) as err:
            raise ConfigError(f"tls: cannot read certificates: {err}") from err
        from cryptography.hazmat.primitives import serialization

        leaf_pem = leaf.public_bytes(serialization.Encoding.PEM)
        return cls(
            cert_chain_pem=chain_pem,
            key_pem=key_pem,
            trust_pem=trust_pem,
            identity=identity_of_pem(leaf_pem),
            trusted_cas=trusted,
            revocation=RevocationChecker(Path(paths.crl) if paths.crl else None, trusted),
            cert_path=Path(paths.cert),
            key_path=Path(paths.key),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        # Client certificates are required: an anonymous caller never reaches a handler.
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_chain_pem)],
            root_certificates=self.trust_pem,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.trust_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_chain_pem,
        )

    def client_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` client context with the same trust and client certificate as our gRPC channels.

        grpcio shows a client neither the server's certificate nor a verify
        hook, so ``hypha.net.channel.check_server`` makes one handshake of its
        own with this context to read the certificate and check it.
        """
        if self._client_context is None:
            # One per material (building it reads and parses the key: ~1.3 ms per dial).
            context = ssl.create_default_context(cadata=self.trust_pem.decode("ascii"))
            if self.cert_path is not None and self.key_path is not None:
                context.load_cert_chain(self.cert_path, self.key_path)
            context.set_alpn_protocols(["h2"])
            self._client_context = context
        return self._client_context
