"""Certificate revocation: writing CRLs, and checking peers against them.

grpcio exposes no CRL hook, so the server guard asks a ``RevocationChecker``
about every caller's (issuer, serial). The checker re-reads the CRL file when
it changes, so revoking a certificate needs no restart.

File format: PEM, possibly several CRLs concatenated (one per issuing CA, so
one file can serve several organisations). ``revoke``/``write_crl`` replace
only the CRL of their own CA and keep every other block byte for byte. When
that CA is an intermediate, its certificate is stored in the file too, so a
node that trusts only the root (and its own org) can still verify the CRL of
another organisation: the checker accepts such a certificate as a CRL issuer
only when a trusted CA signed it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hypha.fsutil import write_atomic
from hypha.pki.certs import is_self_signed, load_cert_chain, load_private_key

log = logging.getLogger(__name__)

#: How long a freshly written CRL claims to be current (its nextUpdate).
DEFAULT_NEXT_UPDATE = dt.timedelta(days=30)

#: Longest CA chain walked above a certificate (root, org, sub-CA... and some room).
_MAX_CHAIN = 8

#: A file modified less than this long ago is also compared by content (see refresh()).
_RACY_WINDOW_NS = 2_000_000_000

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.DOTALL)


def _pem_blocks(data: bytes) -> list[tuple[str, bytes]]:
    """(label, block) for every PEM block; ValueError when bytes outside blocks are not whitespace.

    Stray bytes usually mean a file caught mid-write, which must not be read
    as "these are all the revocations".
    """
    blocks: list[tuple[str, bytes]] = []
    end = 0
    for match in _PEM_BLOCK.finditer(data):
        if data[end : match.start()].strip():
            raise ValueError("unexpected bytes between PEM blocks")
        blocks.append((match.group(1).decode("ascii"), match.group(0)))
        end = match.end()
    if data[end:].strip():
        raise ValueError("unexpected or truncated data after the last PEM block")
    return blocks


def _issuer_key(name: x509.Name | str) -> str:
    return name if isinstance(name, str) else name.rfc4514_string()


def _signed_by(crl: x509.CertificateRevocationList, ca: x509.Certificate) -> bool:
    key = ca.public_key()
    try:
        return crl.is_signature_valid(key)  # type: ignore[arg-type]
    except (TypeError, ValueError, InvalidSignature):
        return False


def _crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def _build_crl(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    previous: x509.CertificateRevocationList | None,
    new: x509.RevokedCertificate | None,
    now: dt.datetime,
    next_update: dt.timedelta,
) -> x509.CertificateRevocationList:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + next_update)
        .add_extension(
            x509.CRLNumber((_crl_number(previous) if previous is not None else 0) + 1), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    seen: set[int] = set()
    for entry in [*(previous if previous is not None else []), *([new] if new is not None else [])]:
        if entry.serial_number not in seen:  # revoking twice keeps the first date and reason
            seen.add(entry.serial_number)
            builder = builder.add_revoked_certificate(entry)
    return builder.sign(ca_key, hashes.SHA256())


def _update_crl_file(
    ca_cert_path: Path | str,
    ca_key_path: Path | str,
    crl_path: Path | str,
    new: Callable[[x509.Certificate, dt.datetime], x509.RevokedCertificate | None],
    next_update: dt.timedelta,
    also_carry: x509.Certificate | None = None,
) -> x509.CertificateRevocationList:
    ca_cert = load_cert_chain(ca_cert_path)[0]
    ca_key = load_private_key(ca_key_path)
    if ca_cert.public_key() != ca_key.public_key():
        raise ValueError("the CA key does not belong to the CA certificate")
    path = Path(crl_path)
    blocks = _pem_blocks(path.read_bytes()) if path.exists() else []
    previous: x509.CertificateRevocationList | None = None
    kept: list[bytes] = []
    for label, block in blocks:
        if label == "X509 CRL":
            crl = x509.load_pem_x509_crl(block)
            if crl.issuer == ca_cert.subject:
                if not _signed_by(crl, ca_cert):
                    raise ValueError(
                        f"{path} holds a CRL for {ca_cert.subject.rfc4514_string()} that this CA "
                        "did not sign; refusing to replace it"
                    )
                previous = crl
                continue
        elif label == "CERTIFICATE" and x509.load_pem_x509_certificate(block) == ca_cert:
            continue  # written again just below
        kept.append(block)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    entry = new(ca_cert, now)
    crl = _build_crl(ca_cert, ca_key, previous, entry, now, next_update)
    ours = crl.public_bytes(serialization.Encoding.PEM)
    if not is_self_signed(ca_cert):
        ours = ca_cert.public_bytes(serialization.Encoding.PEM) + ours
    if also_carry is not None:
        carried = also_carry.public_bytes(serialization.Encoding.PEM)
        if carried not in kept:
            kept.append(carried)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, b"".join([*kept, ours]), 0o644)
    return crl


def revoke(
    ca_cert_path: Path | str,
    ca_key_path: Path | str,
    cert_path: Path | str,
    crl_path: Path | str,
    reason: x509.ReasonFlags | None = None,
    *,
    next_update: dt.timedelta = DEFAULT_NEXT_UPDATE,
) -> None:
    """Add the leaf of ``cert_path`` to the CA's CRL in ``crl_path`` (created when absent).

    The CA must be the leaf's issuer. Existing entries are kept, the CRL
    number goes up by one and lastUpdate/nextUpdate restart from now.
    """
    leaf = load_cert_chain(cert_path)[0]

    def entry(ca_cert: x509.Certificate, now: dt.datetime) -> x509.RevokedCertificate:
        if leaf.issuer != ca_cert.subject:
            raise ValueError(
                f"{cert_path} was issued by {leaf.issuer.rfc4514_string()}, not by "
                f"{ca_cert.subject.rfc4514_string()}"
            )
        try:
            leaf.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature) as err:
            raise ValueError(f"{cert_path} was not signed by this CA") from err
        builder = x509.RevokedCertificateBuilder().serial_number(leaf.serial_number).revocation_date(now)
        if reason is not None:
            builder = builder.add_extension(x509.CRLReason(reason), critical=False)
        return builder.build()

    # A revoked CA's certificate travels in the file: a checker that does not
    # trust that CA directly (another organisation's) still learns its name and
    # key, and so which leaves the revocation takes down with it.
    carry = leaf if _is_ca(leaf) else None
    crl = _update_crl_file(ca_cert_path, ca_key_path, crl_path, entry, next_update, carry)
    log.info("revoked serial %x; CRL %s now lists %d certificate(s)", leaf.serial_number, crl_path, len(crl))


def write_crl(
    ca_cert_path: Path | str,
    ca_key_path: Path | str,
    crl_path: Path | str,
    *,
    next_update: dt.timedelta = DEFAULT_NEXT_UPDATE,
) -> x509.CertificateRevocationList:
    """Write the CA's CRL: empty when new, otherwise re-signed with fresh dates (before nextUpdate passes)."""
    return _update_crl_file(ca_cert_path, ca_key_path, crl_path, lambda _ca, _now: None, next_update)


class RevocationChecker:
    """Answers "is (issuer, serial) revoked?" from a CRL file that may change at any time.

    - The file is re-read when its (mtime, ctime, size, inode) changes, and
      compared by content while it is under two seconds old; the stat happens
      at most every ``recheck_s`` seconds (0: on every call).
    - Each CRL must verify against a trusted CA with the matching subject (or
      a CA certificate in the file that a trusted CA signed); others are
      ignored and logged.
    - No file at start means nothing is revoked. A file that cannot be parsed
      or is empty (caught mid-write) keeps the last good set. A file that
      disappears after it was read also keeps the last good set: revocations
      never lapse because a file went missing for a moment.

    Reads are lock-free (the revoked set is swapped whole); reloads take a
    lock, so concurrent callers never parse the same change twice.
    """

    def __init__(
        self,
        crl_path: Path | str | None,
        trusted: Iterable[x509.Certificate],
        *,
        recheck_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = Path(crl_path) if crl_path is not None else None
        self._trusted = [c for c in trusted if _is_ca(c)]
        self._recheck_s = recheck_s
        self._clock = clock
        self._lock = threading.Lock()
        self._revoked: dict[str, frozenset[int]] = {}
        #: Every CA certificate known: trusted ones and those a trusted CA vouches for in the file.
        self._cas: list[x509.Certificate] = list(self._trusted)
        #: What the chain walk needs of each CA, computed once per load: a signature check
        #: (is it self-signed?) per CA per lookup made a re-check of 1,000 open streams
        #: cost most of a gateway's CPU.
        self._ca_facts = [_CaFacts.of(c) for c in self._cas]
        #: (issuer, serial, aki) -> revoked, for the current load only.
        self._memo: dict[tuple[str, int, bytes | None], bool] = {}
        #: Bumped on every load that changed what is revoked: watchers re-check only then.
        self.generation = 0
        self._seen: tuple[int, int, int, int] | None = None
        #: The bytes last read (parsed or not), to skip re-parsing an unchanged file.
        self._raw: bytes | None = None
        self._loaded_once = False
        self._next_check = float("-inf")

    @property
    def path(self) -> Path | None:
        return self._path

    def is_revoked(self, issuer: x509.Name | str, serial: int, authority_key_id: bytes | None = None) -> bool:
        """Whether the certificate ``serial`` of ``issuer`` (a Name or its RFC 4514 string) is revoked,
        or any CA above it is: revoking an organisation's CA takes down every certificate it issued.

        ``authority_key_id`` (the certificate's AKI) picks the issuing CA among
        CAs that share a name (a CA re-issued with a new key); without it every
        known CA of that name counts.
        """
        self.refresh()
        key = (_issuer_key(issuer), serial, authority_key_id)
        memo = self._memo
        found = memo.get(key)
        if found is None:
            found = self._chain_revoked(*key, depth=0)
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            memo[key] = found
        return found

    def _chain_revoked(self, issuer: str, serial: int, aki: bytes | None, depth: int) -> bool:
        serials = self._revoked.get(issuer)
        if serials is not None and serial in serials:
            return True
        if depth >= _MAX_CHAIN:
            return False
        for ca in self._ca_facts:
            if ca.subject != issuer or ca.self_signed:
                continue
            if aki is not None and ca.ski not in (None, aki):
                continue
            if self._chain_revoked(ca.issuer, ca.serial, ca.aki, depth + 1):
                return True
        return False

    def revoked(self) -> dict[str, frozenset[int]]:
        """The current revoked serials per issuer (RFC 4514 string), after a refresh."""
        self.refresh()
        return dict(self._revoked)

    def refresh(self) -> None:
        """Re-read the file if it changed (subject to ``recheck_s``)."""
        if self._path is None:
            return
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self._recheck_s
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            if self._loaded_once and self._seen is not None:
                log.warning(
                    "CRL %s disappeared; keeping the %d revocation(s) read before",
                    self._path,
                    sum(len(s) for s in self._revoked.values()),
                )
            self._seen = None
            return
        except OSError as err:
            log.warning("cannot stat CRL %s: %s; keeping the last good set", self._path, err)
            return
        key = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        # NOTE: two writes within one filesystem timestamp tick, of equal size,
        # onto a recycled inode look identical to stat ("racy" timestamps, as
        # git calls them). While the file is that young, compare its bytes too.
        racy = time.time_ns() - st.st_mtime_ns < _RACY_WINDOW_NS
        if key == self._seen and not racy:
            return
        with self._lock:
            if key == self._seen and not racy:
                return
            self._reload(key)

    def _reload(self, key: tuple[int, int, int, int]) -> None:
        assert self._path is not None
        # NOTE: the key is recorded even when parsing fails, so a broken file is
        # parsed (and logged) once per change, not on every call.
        self._seen = key
        try:
            data = self._path.read_bytes()
        except OSError as err:
            log.warning("cannot read CRL %s (%s); keeping the last good set", self._path, err)
            return
        if data == self._raw:
            return
        self._raw = data
        try:
            blocks = _pem_blocks(data)
            if not blocks:
                # An empty file is what a writer that truncates first leaves behind.
                raise ValueError("empty file or no PEM block")
            crls = [x509.load_pem_x509_crl(b) for label, b in blocks if label == "X509 CRL"]
            extra = [x509.load_pem_x509_certificate(b) for label, b in blocks if label == "CERTIFICATE"]
        except ValueError as err:
            log.warning("cannot read CRL %s (%s); keeping the last good set", self._path, err)
            return
        issuers = self._trusted + [c for c in extra if self._vouched(c)]
        revoked: dict[str, set[int]] = {}
        for crl in crls:
            signer = next((ca for ca in issuers if ca.subject == crl.issuer and _signed_by(crl, ca)), None)
            if signer is None:
                log.warning(
                    "ignoring a CRL in %s: issuer %s is not a trusted CA or the signature is invalid",
                    self._path,
                    crl.issuer.rfc4514_string(),
                )
                continue
            if crl.next_update_utc is not None and crl.next_update_utc < dt.datetime.now(dt.UTC):
                log.warning(
                    "CRL of %s in %s is past its nextUpdate; still applying it",
                    crl.issuer.rfc4514_string(),
                    self._path,
                )
            revoked.setdefault(_issuer_key(crl.issuer), set()).update(e.serial_number for e in crl)
        # Swapped together, then the memo dropped: a reader sees the old set or the new one.
        self._cas = issuers
        self._ca_facts = [_CaFacts.of(c) for c in issuers]
        self._revoked = {issuer: frozenset(serials) for issuer, serials in revoked.items()}
        self._memo = {}
        self.generation += 1
        self._loaded_once = True
        log.info(
            "loaded CRL %s: %d revoked certificate(s) from %d issuer(s)",
            self._path,
            sum(len(s) for s in revoked.values()),
            len(revoked),
        )

    def _vouched(self, cert: x509.Certificate) -> bool:
        """A CA certificate carried in the CRL file counts only when a trusted CA signed it."""
        if not _is_ca(cert):
            return False
        for ca in self._trusted:
            if ca.subject == cert.issuer:
                try:
                    cert.verify_directly_issued_by(ca)
                except (ValueError, TypeError, InvalidSignature):
                    continue
                return True
        return False


#: Lookups remembered per CRL load (peers seen); past it the memo starts over.
_MEMO_MAX = 100_000


@dataclass(frozen=True)
class _CaFacts:
    """A CA certificate as the chain walk reads it."""

    subject: str
    issuer: str
    serial: int
    ski: bytes | None
    aki: bytes | None
    self_signed: bool

    @classmethod
    def of(cls, cert: x509.Certificate) -> _CaFacts:
        return cls(
            _issuer_key(cert.subject),
            _issuer_key(cert.issuer),
            cert.serial_number,
            _subject_key_id(cert),
            _authority_key_id(cert),
            is_self_signed(cert),
        )


def _subject_key_id(cert: x509.Certificate) -> bytes | None:
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    except x509.ExtensionNotFound:
        return None


def _authority_key_id(cert: x509.Certificate) -> bytes | None:
    try:
        return cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except x509.ExtensionNotFound:
        return None


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False
