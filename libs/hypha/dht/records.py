"""Signed provider records: the only thing the DHT carries (ARCHITECTURE §3, §4).

The DHT runs over unauthenticated UDP, so every storer and every reader checks
a record itself instead of trusting whoever handed it over: the certificate
chain must lead to a trusted CA, the leaf must be a ``data`` node whose peer id
is the record's provider, the ECDSA signature must cover the body, and the
record must be current. Nothing here does I/O; time comes from an injected
clock so tests and storers agree on what "expired" means.

Wire form (JSON, sorted keys, no spaces)::

    {"body": {...record fields, "v": 1}, "chain": [b64 DER leaf, b64 DER intermediate...],
     "sig": b64 ECDSA-SHA256 over canonical(body)}

``canonical(body)`` is the same compact sorted-key JSON of the body object as
received, so a verifier never has to reconstruct bytes it did not see.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

from hypha.errors import InvalidArgumentError, PermissionDeniedError
from hypha.pki.certs import verify_chain
from hypha.pki.crl import RevocationChecker
from hypha.pki.identity import Role, authority_key_id_of, peer_id_of, role_of

#: Largest encoded record. kademlia's RPC layer refuses requests over 8 KiB
#: (8137 bytes of value for a plain store); the provider RPCs carry a node id,
#: a key and the blob, so a record must stay well below that.
MAX_RECORD_BYTES = 6144
#: Longest lifetime a record may claim; a stolen record cannot outlive this.
MAX_LIFETIME_S = 24 * 3600.0
#: Tolerated clock difference between publisher and verifier.
DEFAULT_MAX_SKEW_S = 30.0
MAX_ADDRESSES = 8
MAX_CHAIN_CERTS = 4
MAX_DATASET_CHARS = 256
#: 2 added ``manifest_sha256``, the pin of the dataset's content.
RECORD_VERSION = 2
_BODY_FIELDS = frozenset(
    {
        "v",
        "dataset",
        "provider",
        "addresses",
        "slice_count",
        "seq",
        "issued_at",
        "expires_at",
        "manifest_sha256",
    }
)
_HEX = frozenset("0123456789abcdef")

Clock = Callable[[], float]


def canonical_json(value: Any) -> bytes:
    """The one byte form that is signed and sent: sorted keys, no spaces, ASCII only."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _check_address(address: object) -> str:
    if not isinstance(address, str) or not 3 <= len(address) <= 261:
        raise InvalidArgumentError(f"address must be a host:port string, got {address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"address must be host:port, got {address!r}")
    return address


def _check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number of unix seconds, got {value!r}")
    return float(value)


def _check_uint(name: str, value: object, limit: int = 2**63) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise InvalidArgumentError(f"{name} must be an integer in [0, {limit}), got {value!r}")
    return value


@dataclass(frozen=True)
class ProviderRecord:
    """One data node saying "I serve this dataset at these addresses until expires_at"."""

    dataset: str
    #: Peer id of the publisher; must equal ``peer_id_of`` its signing certificate.
    provider: str
    #: gRPC addresses (host:port) to try in order.
    addresses: tuple[str, ...]
    slice_count: int
    #: Higher replaces lower for the same (dataset, provider); see ``next_seq``.
    seq: int
    issued_at: float
    expires_at: float
    #: Hex sha256 of the dataset's manifest (``Manifest.digest``), which lists every slice's
    #: sha256: fetchers check the manifest they get against it, so a provider cannot serve other
    #: bytes under this name. Empty means unpinned (only a record built by hand; data nodes pin).
    manifest_sha256: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not 0 < len(self.dataset) <= MAX_DATASET_CHARS:
            raise InvalidArgumentError(f"dataset must be 1..{MAX_DATASET_CHARS} characters")
        if not isinstance(self.provider, str) or not 0 < len(self.provider) <= 128:
            raise InvalidArgumentError("provider must be a peer id")
        if not isinstance(self.addresses, tuple) or not 0 < len(self.addresses) <= MAX_ADDRESSES:
            raise InvalidArgumentError(f"a record needs 1..{MAX_ADDRESSES} addresses")
        for address in self.addresses:
            _check_address(address)
        _check_uint("slice_count", self.slice_count)
        _check_uint("seq", self.seq)
        issued = _check_time("issued_at", self.issued_at)
        expires = _check_time("expires_at", self.expires_at)
        if expires <= issued:
            raise InvalidArgumentError("expires_at must be after issued_at")
        pin = self.manifest_sha256
        if not isinstance(pin, str) or (pin and (len(pin) != 64 or not set(pin) <= _HEX)):
            raise InvalidArgumentError(
                f"manifest_sha256 must be empty or 64 lower-case hex digits, got {pin!r}"
            )

    @classmethod
    def issue(
        cls,
        dataset: str,
        provider: str,
        addresses: Sequence[str],
        slice_count: int,
        *,
        seq: int,
        now: float,
        lifetime_s: float,
        manifest_sha256: str = "",
    ) -> ProviderRecord:
        return cls(
            dataset, provider, tuple(addresses), slice_count, seq, now, now + lifetime_s, manifest_sha256
        )

    @property
    def lifetime_s(self) -> float:
        return self.expires_at - self.issued_at

    def is_expired(self, now: float, skew_s: float = 0.0) -> bool:
        return self.expires_at < now - skew_s

    def to_body(self) -> dict[str, Any]:
        return {
            "v": RECORD_VERSION,
            "dataset": self.dataset,
            "provider": self.provider,
            "addresses": list(self.addresses),
            "slice_count": self.slice_count,
            "seq": self.seq,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "manifest_sha256": self.manifest_sha256,
        }

    @classmethod
    def from_body(cls, body: object) -> ProviderRecord:
        """Strict parse of a received body: unknown fields and wrong types are refused."""
        if not isinstance(body, dict):
            raise InvalidArgumentError("record body must be an object")
        if set(body) != _BODY_FIELDS:
            raise InvalidArgumentError(
                f"record body fields must be {sorted(_BODY_FIELDS)}, got {sorted(body)}"
            )
        if body["v"] != RECORD_VERSION or isinstance(body["v"], bool):
            raise InvalidArgumentError(f"unsupported record version {body['v']!r}")
        addresses = body["addresses"]
        if not isinstance(addresses, list):
            raise InvalidArgumentError("addresses must be a list")
        return cls(
            dataset=body["dataset"],
            provider=body["provider"],
            addresses=tuple(addresses),
            slice_count=body["slice_count"],
            seq=body["seq"],
            issued_at=_check_time("issued_at", body["issued_at"]),
            expires_at=_check_time("expires_at", body["expires_at"]),
            manifest_sha256=body["manifest_sha256"],
        )


def next_seq(previous: int | None, now: float) -> int:
    """The sequence number of a new record: above ``previous`` and above any earlier run's.

    NOTE: seq derives from wall-clock milliseconds, not a counter starting at 1,
    so a data node that restarts (and forgot its last seq) still outranks the
    records its previous run left on storers.
    """
    return max((previous or 0) + 1, int(now * 1000))


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def sign_record(
    record: ProviderRecord, key: ec.EllipticCurvePrivateKey, chain: Sequence[x509.Certificate]
) -> bytes:
    """Encode and sign ``record`` with the node key; ``chain`` is leaf first, then intermediates.

    Refuses a key that does not match the leaf, a provider id that is not the
    leaf's, and an encoding over ``MAX_RECORD_BYTES``: those are local
    configuration mistakes that every verifier would reject anyway.
    """
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgumentError("provider records are signed with an ECDSA node key")
    if not chain:
        raise InvalidArgumentError("a certificate chain is needed to sign a record")
    leaf = chain[0]
    if _der_public(leaf.public_key()) != _der_public(key.public_key()):
        raise InvalidArgumentError("signing key does not match the leaf certificate")
    if record.provider != peer_id_of(leaf):
        raise InvalidArgumentError(f"record provider {record.provider} is not the signer {peer_id_of(leaf)}")
    body = record.to_body()
    signature = key.sign(canonical_json(body), ec.ECDSA(hashes.SHA256()))
    blob = canonical_json(
        {
            "body": body,
            "chain": [base64.b64encode(_der(cert)).decode("ascii") for cert in chain],
            "sig": base64.b64encode(signature).decode("ascii"),
        }
    )
    if len(blob) > MAX_RECORD_BYTES:
        raise InvalidArgumentError(f"record is {len(blob)} bytes; the limit is {MAX_RECORD_BYTES}")
    return blob


def _der_public(public: CertificatePublicKeyTypes) -> bytes:
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class _VerifiedChain:
    leaf: x509.Certificate
    peer_id: str
    role: Role
    #: The window in which every certificate of the verified path is valid.
    not_before: float
    not_after: float
    #: (issuer, serial, authority key id) of every certificate of the path, leaf first.
    names: tuple[tuple[x509.Name, int, bytes | None], ...] = ()


def _b64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InvalidArgumentError(f"{what} is not valid base64") from err


class RecordVerifier:
    """Accepts a record blob only if a trusted ``data`` node signed it and it is current.

    Storers call this before keeping a record and readers call it again on
    everything a storer returned. Both chain verification and whole-blob
    verification are cached (by digest), so a record seen again costs a hash
    and the time checks.
    """

    def __init__(
        self,
        trusted_cas: Sequence[x509.Certificate],
        *,
        clock: Clock = time.time,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        max_lifetime_s: float = MAX_LIFETIME_S,
        roles: frozenset[Role] = frozenset({Role.DATA}),
        cache_size: int = 4096,
        revocation: RevocationChecker | None = None,
    ) -> None:
        if not trusted_cas:
            raise InvalidArgumentError("a record verifier needs at least one trusted CA")
        self._trusted = list(trusted_cas)
        self.clock = clock
        self.max_skew_s = max_skew_s
        self.max_lifetime_s = max_lifetime_s
        self._roles = roles
        self._cache_size = cache_size
        #: Checked on every verify, cached or not: a CRL may list a signer after its record was kept.
        self._revocation = revocation
        self._chains: OrderedDict[bytes, _VerifiedChain] = OrderedDict()
        self._blobs: OrderedDict[bytes, tuple[ProviderRecord, _VerifiedChain]] = OrderedDict()

    def verify(self, blob: bytes) -> ProviderRecord:
        """The record in ``blob``; raises InvalidArgumentError or PermissionDeniedError saying why not."""
        if not isinstance(blob, bytes | bytearray):
            raise InvalidArgumentError(f"record must be bytes, got {type(blob).__name__}")
        if len(blob) > MAX_RECORD_BYTES:
            raise InvalidArgumentError(f"record is {len(blob)} bytes; the limit is {MAX_RECORD_BYTES}")
        now = self.clock()
        digest = hashlib.sha256(blob).digest()
        cached = self._blobs.get(digest)
        if cached is not None:
            self._blobs.move_to_end(digest)
            record, chain = cached
            self._check_times(record, chain, now)
            return record
        record, chain = self._verify_uncached(bytes(blob), now)
        self._remember(self._blobs, digest, (record, chain))
        return record

    def _verify_uncached(self, blob: bytes, now: float) -> tuple[ProviderRecord, _VerifiedChain]:
        try:
            envelope = json.loads(blob)
        except (ValueError, UnicodeDecodeError) as err:
            raise InvalidArgumentError("record is not JSON") from err
        if not isinstance(envelope, dict) or set(envelope) != {"body", "chain", "sig"}:
            raise InvalidArgumentError("record must be an object with body, chain and sig")
        body = envelope["body"]
        record = ProviderRecord.from_body(body)
        if record.lifetime_s > self.max_lifetime_s:
            raise InvalidArgumentError(
                f"record lifetime {record.lifetime_s:.0f}s exceeds the cap of {self.max_lifetime_s:.0f}s"
            )
        # Cheap checks first: an expired record is dropped before any crypto.
        self._check_record_times(record, now)
        ders = envelope["chain"]
        if not isinstance(ders, list) or not 0 < len(ders) <= MAX_CHAIN_CERTS:
            raise InvalidArgumentError(f"chain must list 1..{MAX_CHAIN_CERTS} certificates")
        chain = self._verify_chain([_b64(der, "chain certificate") for der in ders], now)
        self._check_chain_window(chain, now)  # a chain verified just now may still be revoked
        if record.provider != chain.peer_id:
            raise PermissionDeniedError(
                f"record names provider {record.provider} but is signed by {chain.peer_id}"
            )
        signature = _b64(envelope["sig"], "signature")
        public = chain.leaf.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise PermissionDeniedError("record signer does not hold an ECDSA key")
        try:
            public.verify(signature, canonical_json(body), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError) as err:
            raise PermissionDeniedError("record signature does not verify") from err
        return record, chain

    def _verify_chain(self, ders: list[bytes], now: float) -> _VerifiedChain:
        digest = hashlib.sha256(b"".join(hashlib.sha256(der).digest() for der in ders)).digest()
        cached = self._chains.get(digest)
        if cached is not None:
            self._chains.move_to_end(digest)
            self._check_chain_window(cached, now)
            return cached
        try:
            certs = [x509.load_der_x509_certificate(der) for der in ders]
        except ValueError as err:
            raise InvalidArgumentError("chain holds an unparseable certificate") from err
        try:
            path = verify_chain(certs, self._trusted, datetime.fromtimestamp(now, UTC))
        except ValueError as err:
            raise PermissionDeniedError(f"record chain does not lead to a trusted CA: {err}") from err
        leaf = path[0]
        role = role_of(leaf)  # raises PermissionDeniedError for a missing or unknown role
        if role not in self._roles:
            raise PermissionDeniedError(f"role {role} may not publish provider records")
        verified = _VerifiedChain(
            leaf=leaf,
            peer_id=peer_id_of(leaf),
            role=role,
            not_before=max(c.not_valid_before_utc.timestamp() for c in path),
            not_after=min(c.not_valid_after_utc.timestamp() for c in path),
            names=tuple((c.issuer, c.serial_number, authority_key_id_of(c)) for c in path),
        )
        self._remember(self._chains, digest, verified)
        return verified

    def _check_record_times(self, record: ProviderRecord, now: float) -> None:
        if record.is_expired(now, self.max_skew_s):
            raise PermissionDeniedError(f"record expired {now - record.expires_at:.1f}s ago")
        if record.issued_at > now + self.max_skew_s:
            raise PermissionDeniedError(f"record issued {record.issued_at - now:.1f}s in the future")

    def _check_chain_window(self, chain: _VerifiedChain, now: float) -> None:
        if not chain.not_before <= now <= chain.not_after:
            raise PermissionDeniedError("record certificate chain is not valid now")
        if self._revocation is not None:
            for issuer, serial, aki in chain.names:
                if self._revocation.is_revoked(issuer, serial, aki):
                    raise PermissionDeniedError("record signed under a revoked certificate")

    def _check_times(self, record: ProviderRecord, chain: _VerifiedChain, now: float) -> None:
        self._check_record_times(record, now)
        self._check_chain_window(chain, now)

    def _remember(self, cache: OrderedDict[bytes, Any], key: bytes, value: Any) -> None:
        cache[key] = value
        while len(cache) > self._cache_size:
            cache.popitem(last=False)
