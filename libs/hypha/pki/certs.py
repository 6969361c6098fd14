"""Issuing the private PKI: a root CA, organisation CAs under it, node certificates.

The shape (root -> org CA with path length 0 -> node leaf) lets each
organisation running nodes hold its own signing key while every node trusts
only the root. Used by ``hypha-certutil``, by ``hypha up`` and by tests.

Files written:

- ``root-ca-cert.pem`` / ``root-ca-key.pem`` (``make_root``)
- ``ORG-ca-cert.pem`` / ``ORG-ca-key.pem`` (``make_org``); the cert file holds
  only the intermediate.
- ``N-cert.pem`` (leaf followed by the issuing intermediates, root excluded,
  so a peer that trusts only the root can build the chain), ``N-key.pem`` and
  ``N-trust.pem`` (root first, then the intermediates: the bundle the node
  trusts, and the CAs whose CRLs it accepts).

Keys are ECDSA P-256 (grpcio's TLS fails with Ed25519 certificates), written
as unencrypted PKCS#8 PEM with mode 0600. Every file is written to a temporary
name and renamed, so a running node never reads half a certificate.

NOTE: finding the root for ``N-trust.pem`` when the issuing CA is an
intermediate: the CA cert file may itself hold a chain (intermediate first,
then its issuers); otherwise ``root-ca-cert.pem`` next to the CA cert file is
used. Each candidate must have signed the certificate below it. When no root
is found, ``make_node`` fails rather than write a trust bundle without a
self-signed anchor (TLS libraries would not accept it as a trust root).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hypha.fsutil import write_atomic
from hypha.pki.identity import Role

ROOT_CERT_FILE = "root-ca-cert.pem"
ROOT_KEY_FILE = "root-ca-key.pem"

#: Certificates start this much in the past so that a peer whose clock runs a
#: little behind accepts a certificate issued a moment ago.
CLOCK_SKEW = dt.timedelta(minutes=5)

# Node and org names become file names, a CN and a DNS SAN: keep them to what
# is safe in all three.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _check_name(kind: str, name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )


def load_cert_chain(path: Path | str) -> list[x509.Certificate]:
    """Every certificate of a PEM file, in file order; ValueError when there is none."""
    data = Path(path).read_bytes()
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as err:
        raise ValueError(f"{path}: not a readable PEM certificate file") from err
    if not certs:  # pragma: no cover - the loader already raises on no certificate
        raise ValueError(f"{path}: no certificate")
    return certs


def load_private_key(path: Path | str) -> ec.EllipticCurvePrivateKey:
    """An unencrypted PEM EC private key; ValueError for anything else."""
    data = Path(path).read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as err:  # encrypted key, and no password given
        raise ValueError(f"{path}: encrypted private keys are not supported") from err
    except ValueError as err:
        raise ValueError(f"{path}: not a readable PEM private key") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path}: expected an EC (ECDSA) private key, got {type(key).__name__}")
    return key


def generate_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def is_self_signed(cert: x509.Certificate) -> bool:
    if cert.issuer != cert.subject:
        return False
    try:
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _check_key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, what: str) -> None:
    if cert.public_key() != key.public_key():
        raise ValueError(f"the {what} key does not belong to the {what} certificate")


def _path_length(cert: x509.Certificate) -> int | None:
    """The CA's path length constraint; ValueError when the certificate is no CA."""
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise ValueError(f"{cert.subject.rfc4514_string()} is not a CA certificate")
    return bc.path_length


def issuer_chain(ca_cert_path: Path | str) -> list[x509.Certificate]:
    """The issuing CA and every CA above it, up to and including the self-signed root.

    Candidates are the certificates of the CA cert file and ``root-ca-cert.pem``
    beside it (see the module NOTE); raises ValueError when no root is found.
    """
    in_file = load_cert_chain(ca_cert_path)
    candidates = list(in_file[1:])
    sibling_root = Path(ca_cert_path).parent / ROOT_CERT_FILE
    if sibling_root.is_file():
        candidates.extend(load_cert_chain(sibling_root))
    chain = [in_file[0]]
    while not is_self_signed(chain[-1]):
        parent = next(
            (c for c in candidates if c.subject == chain[-1].issuer and _issued_by(chain[-1], c)), None
        )
        if parent is None or parent in chain:
            raise ValueError(
                f"cannot find the root CA above {chain[-1].subject.rfc4514_string()}: append it to "
                f"{ca_cert_path} or put {ROOT_CERT_FILE} next to it"
            )
        chain.append(parent)
    return chain


def verify_chain(
    chain: Sequence[x509.Certificate],
    trusted: Sequence[x509.Certificate],
    at: dt.datetime | None = None,
) -> list[x509.Certificate]:
    """Verify a leaf (``chain[0]``, intermediates after it) up to one of ``trusted``.

    For material that did not arrive over TLS (signed DHT records): the same
    checks a TLS stack makes for a client certificate (signatures, validity
    at ``at``, CA constraints, clientAuth usage). Returns the verified path,
    leaf first; raises ValueError when it does not verify.
    """
    from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

    if not chain:
        raise ValueError("empty certificate chain")
    builder = PolicyBuilder().store(Store(list(trusted))).time(at or dt.datetime.now(dt.UTC))
    try:
        verified = builder.build_client_verifier().verify(chain[0], list(chain[1:]))
    except VerificationError as err:
        raise ValueError(f"certificate does not verify: {err}") from err
    return list(verified.chain)


def write_pem_certs(path: Path, certs: Iterable[x509.Certificate]) -> None:
    write_atomic(path, b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs), 0o644)


def write_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(path, pem, 0o600)


def _refuse_overwrite(paths: Sequence[Path], overwrite: bool) -> None:
    if overwrite:
        return
    for path in paths:
        if path.exists():
            raise FileExistsError(
                f"{path} already exists; replacing a CA would orphan every certificate it signed"
            )


def _validity(
    days: int, not_before: dt.datetime | None, not_after: dt.datetime | None
) -> tuple[dt.datetime, dt.datetime]:
    if days <= 0 and not_after is None:
        raise ValueError(f"days must be positive, got {days}")
    now = dt.datetime.now(dt.UTC)
    start = not_before if not_before is not None else now - CLOCK_SKEW
    end = not_after if not_after is not None else now + dt.timedelta(days=days)
    if end <= start:
        raise ValueError("certificate would expire before it becomes valid")
    return start, end


def _ca_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )


def make_root(
    out_dir: Path | str, name: str = "hypha-root", days: int = 3650, *, overwrite: bool = False
) -> tuple[Path, Path]:
    """Create a self-signed root CA; returns (cert path, key path).

    Refuses to replace an existing root unless ``overwrite``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / ROOT_CERT_FILE, out / ROOT_KEY_FILE
    _refuse_overwrite([cert_path, key_path], overwrite)
    key = generate_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(days, None, None)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private_key(key_path, key)
    write_pem_certs(cert_path, [cert])
    return cert_path, key_path


def _load_ca(
    ca_cert_path: Path | str, ca_key_path: Path | str
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert = load_cert_chain(ca_cert_path)[0]
    ca_key = load_private_key(ca_key_path)
    _check_key_matches(ca_cert, ca_key, "CA")
    return ca_cert, ca_key


def _issued_builder(
    ca_cert: x509.Certificate,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    start: dt.datetime,
    end: dt.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )


def make_org(
    ca_cert_path: Path | str,
    ca_key_path: Path | str,
    name: str,
    out_dir: Path | str,
    days: int = 1825,
    *,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """Create an organisation CA (path length 0: it signs nodes, never other CAs)."""
    _check_name("org", name)
    ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
    if _path_length(ca_cert) == 0:
        raise ValueError(f"{ca_cert_path} is an organisation CA (path length 0); sign orgs with the root CA")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / f"{name}-ca-cert.pem", out / f"{name}-ca-key.pem"
    _refuse_overwrite([cert_path, key_path], overwrite)
    key = generate_key()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    start, end = _validity(days, None, None)
    end = min(end, ca_cert.not_valid_after_utc)
    cert = (
        _issued_builder(ca_cert, subject, key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write_private_key(key_path, key)
    write_pem_certs(cert_path, [cert])
    return cert_path, key_path


#: The SANs ``make_node(loopback=True)`` (``hypha-certutil node --loopback``) adds.
LOOPBACK_SANS = ("localhost", "127.0.0.1")


def parse_san(value: str) -> x509.GeneralName:
    """An IP SAN when ``value`` is an IP address, else a DNS SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        pass
    if not value or any(c.isspace() for c in value) or not value.isascii():
        raise ValueError(f"invalid subject alternative name {value!r}")
    return x509.DNSName(value)


def node_paths(out_dir: Path | str, name: str) -> tuple[Path, Path, Path]:
    """(cert, key, trust) paths of node ``name``: the ``--certs DIR --name N`` convention."""
    out = Path(out_dir)
    return out / f"{name}-cert.pem", out / f"{name}-key.pem", out / f"{name}-trust.pem"


def make_node(
    ca_cert_path: Path | str,
    ca_key_path: Path | str,
    role: Role | str,
    name: str,
    out_dir: Path | str,
    sans: Iterable[str] = (),
    days: int = 365,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    key_path: Path | str | None = None,
    loopback: bool = False,
) -> tuple[Path, Path, Path]:
    """Issue a node certificate; returns (cert path, key path, trust path).

    The SANs are ``name`` and ``sans``, nothing else: peers check the address
    they dial against them, so a production certificate names only where the
    node is really reached. ``loopback`` adds ``localhost`` and ``127.0.0.1``,
    for nodes dialled on this machine (a local cluster, tests); elsewhere they
    would only make every node's certificate pass the name check of whatever
    answers on the dialler's own loopback. (A container's health probe dials
    127.0.0.1 but checks the node's name: ``probe --server-name``.)

    ``key_path`` reuses an existing key (renewal keeps the peer id); otherwise
    a fresh key is generated. ``not_before``/``not_after`` override the
    validity window (tests use them for expired certificates); by default the
    leaf never outlives its CA.
    """
    _check_name("node", name)
    try:
        role = Role(role)
    except ValueError as err:
        raise ValueError(f"unknown role {role!r}; choose from {', '.join(r.value for r in Role)}") from err
    ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
    _path_length(ca_cert)  # refuses a leaf as issuer
    chain = issuer_chain(ca_cert_path)
    key = load_private_key(key_path) if key_path is not None else generate_key()
    names: list[x509.GeneralName] = []
    for value in (name, *(LOOPBACK_SANS if loopback else ()), *sans):
        general = parse_san(value)
        if general not in names:
            names.append(general)
    attributes = [
        x509.NameAttribute(NameOID.COMMON_NAME, name),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
    ]
    orgs = ca_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    if orgs and not is_self_signed(ca_cert):
        attributes.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, str(orgs[0].value)))
    start, end = _validity(days, not_before, not_after)
    if not_after is None:
        end = min(end, ca_cert.not_valid_after_utc)
    cert = (
        _issued_builder(ca_cert, x509.Name(attributes), key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, out_key_path, trust_path = node_paths(out, name)
    if key_path is None or Path(key_path).resolve() != out_key_path.resolve():
        write_private_key(out_key_path, key)
    intermediates = [c for c in chain if not is_self_signed(c)]
    roots = [c for c in chain if is_self_signed(c)]
    write_pem_certs(cert_path, [cert, *intermediates])
    write_pem_certs(trust_path, [*roots, *reversed(intermediates)])
    return cert_path, out_key_path, trust_path
