"""Revocation: CRL files that grow, and a checker that follows them without a restart."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509

from hypha.pki import certs, crl
from hypha.pki.identity import identity_of_pem


@dataclass
class Ca:
    dir: Path
    root_cert: Path
    root_key: Path
    org_cert: Path
    org_key: Path

    def node(self, name: str, *, org: bool = True) -> x509.Certificate:
        ca_cert, ca_key = (self.org_cert, self.org_key) if org else (self.root_cert, self.root_key)
        cert, _, _ = certs.make_node(ca_cert, ca_key, "worker", name, self.dir)
        return certs.load_cert_chain(cert)[0]

    def cert_path(self, name: str) -> Path:
        return self.dir / f"{name}-cert.pem"

    def trusted(self) -> list[x509.Certificate]:
        return certs.load_cert_chain(self.root_cert) + certs.load_cert_chain(self.org_cert)


def make_ca(base: Path, org: str = "acme") -> Ca:
    base.mkdir(parents=True, exist_ok=True)
    root_cert, root_key = certs.make_root(base)
    org_cert, org_key = certs.make_org(root_cert, root_key, org, base)
    return Ca(base, root_cert, root_key, org_cert, org_key)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Ca:
    return make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Ca:
    """An unrelated PKI whose org CA has the same name as ``ca``'s."""
    return make_ca(tmp_path_factory.mktemp("other-ca"))


def crls_in(path: Path) -> list[x509.CertificateRevocationList]:
    data = path.read_bytes()
    return [x509.load_pem_x509_crl(block) for label, block in crl._pem_blocks(data) if label == "X509 CRL"]


def crl_number(c: x509.CertificateRevocationList) -> int:
    return c.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number


def test_revoke_creates_then_extends_the_crl(ca: Ca, tmp_path: Path) -> None:
    # Prepare
    first, second = ca.node("r1"), ca.node("r2")
    path = tmp_path / "crl.pem"

    # Execute
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("r1"), path, x509.ReasonFlags.key_compromise)
    [after_one] = crls_in(path)
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("r2"), path)
    [after_two] = crls_in(path)

    # Assert
    org = certs.load_cert_chain(ca.org_cert)[0]
    assert after_two.issuer == org.subject and after_two.is_signature_valid(org.public_key())  # type: ignore[arg-type]
    assert {e.serial_number for e in after_one} == {first.serial_number}
    assert {e.serial_number for e in after_two} == {first.serial_number, second.serial_number}
    assert crl_number(after_two) == crl_number(after_one) + 1
    assert after_two.last_update_utc >= after_one.last_update_utc
    assert after_two.next_update_utc is not None and after_two.next_update_utc > after_two.last_update_utc
    entry = after_two.get_revoked_certificate_by_serial_number(first.serial_number)
    assert entry is not None and entry.extensions.get_extension_for_class(x509.CRLReason).value.reason == (
        x509.ReasonFlags.key_compromise
    )


def test_revoking_twice_lists_the_serial_once(ca: Ca, tmp_path: Path) -> None:
    ca.node("twice")
    path = tmp_path / "crl.pem"
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("twice"), path)
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("twice"), path)
    [only] = crls_in(path)
    assert len(only) == 1


def test_revoke_refuses_a_certificate_of_another_ca(ca: Ca, other_ca: Ca, tmp_path: Path) -> None:
    other_ca.node("alien")
    with pytest.raises(ValueError, match="not signed by this CA"):
        # Same issuer name ("acme"), different key: the signature check catches it.
        crl.revoke(ca.org_cert, ca.org_key, other_ca.cert_path("alien"), tmp_path / "crl.pem")
    assert not (tmp_path / "crl.pem").exists()


def test_crls_of_other_issuers_in_the_file_are_kept_untouched(ca: Ca, tmp_path: Path) -> None:
    # Prepare: one file with the root's CRL and the org's CRL.
    path = tmp_path / "crl.pem"
    ca.node("by-root", org=False)
    crl.revoke(ca.root_cert, ca.root_key, ca.cert_path("by-root"), path)
    root_block = path.read_bytes()
    ca.node("by-org")

    # Execute
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("by-org"), path)
    crl.write_crl(ca.org_cert, ca.org_key, path)

    # Assert
    assert path.read_bytes().startswith(root_block), "the root's CRL block is kept byte for byte"
    issuers = [c.issuer for c in crls_in(path)]
    assert issuers == [
        certs.load_cert_chain(ca.root_cert)[0].subject,
        certs.load_cert_chain(ca.org_cert)[0].subject,
    ]


def test_write_crl_makes_an_empty_crl_then_refreshes_keeping_entries(ca: Ca, tmp_path: Path) -> None:
    path = tmp_path / "crl.pem"
    crl.write_crl(ca.org_cert, ca.org_key, path)
    [empty] = crls_in(path)
    assert len(empty) == 0
    ca.node("kept")
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("kept"), path)
    refreshed = crl.write_crl(ca.org_cert, ca.org_key, path)
    assert len(refreshed) == 1 and crl_number(refreshed) == crl_number(empty) + 2


def test_checker_follows_the_file_without_being_recreated(ca: Ca, tmp_path: Path) -> None:
    # Prepare: a checker started before any CRL exists.
    path = tmp_path / "crl.pem"
    victim, bystander = ca.node("victim"), ca.node("bystander")
    checker = crl.RevocationChecker(path, ca.trusted())
    assert not checker.is_revoked(victim.issuer, victim.serial_number)

    # Execute / Assert: each change is seen on the next call.
    crl.write_crl(ca.org_cert, ca.org_key, path)
    assert not checker.is_revoked(victim.issuer, victim.serial_number)
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("victim"), path)
    assert checker.is_revoked(victim.issuer, victim.serial_number)
    assert checker.is_revoked(victim.issuer.rfc4514_string(), victim.serial_number)
    assert not checker.is_revoked(bystander.issuer, bystander.serial_number)
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("bystander"), path)
    assert checker.is_revoked(bystander.issuer, bystander.serial_number)


def test_checker_accepts_the_identity_the_guard_passes(ca: Ca, tmp_path: Path) -> None:
    path = tmp_path / "crl.pem"
    ca.node("guarded")
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("guarded"), path)
    peer = identity_of_pem(ca.cert_path("guarded").read_bytes())
    assert crl.RevocationChecker(path, ca.trusted()).is_revoked(peer.issuer, peer.serial)


def test_checker_with_no_file_revokes_nothing(ca: Ca) -> None:
    leaf = ca.node("free")
    assert not crl.RevocationChecker(None, ca.trusted()).is_revoked(leaf.issuer, leaf.serial_number)


def test_crl_signed_by_a_foreign_ca_is_ignored(
    ca: Ca, other_ca: Ca, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the other PKI's "acme" revokes a serial; our checker trusts only our PKI.
    path = tmp_path / "crl.pem"
    alien = other_ca.node("impostor")
    crl.revoke(other_ca.org_cert, other_ca.org_key, other_ca.cert_path("impostor"), path)
    checker = crl.RevocationChecker(path, ca.trusted())

    # Execute
    with caplog.at_level(logging.WARNING, logger="hypha.pki.crl"):
        revoked = checker.is_revoked(alien.issuer, alien.serial_number)

    # Assert: same issuer name, but the signature is not from our acme.
    assert alien.issuer == certs.load_cert_chain(ca.org_cert)[0].subject
    assert not revoked
    assert "ignoring a CRL" in caplog.text
    assert crl.RevocationChecker(path, other_ca.trusted()).is_revoked(alien.issuer, alien.serial_number)


def test_crl_of_a_sibling_org_verifies_through_the_ca_cert_stored_with_it(
    ca: Ca, other_ca: Ca, tmp_path: Path
) -> None:
    # Prepare: org "beta" under the same root; our node trusts root + acme only.
    beta_cert, beta_key = certs.make_org(ca.root_cert, ca.root_key, "beta", ca.dir)
    cert, _, _ = certs.make_node(beta_cert, beta_key, "worker", "beta-w", ca.dir)
    leaf = certs.load_cert_chain(cert)[0]
    path = tmp_path / "crl.pem"

    # Execute
    crl.revoke(beta_cert, beta_key, cert, path)

    # Assert
    assert crl.RevocationChecker(path, ca.trusted()).is_revoked(leaf.issuer, leaf.serial_number)
    # A stored CA certificate counts only when a trusted CA signed it.
    assert not crl.RevocationChecker(path, other_ca.trusted()).is_revoked(leaf.issuer, leaf.serial_number)


def test_checker_keeps_the_last_good_set_while_the_file_is_mid_write(ca: Ca, tmp_path: Path) -> None:
    path = tmp_path / "crl.pem"
    leaf = ca.node("mid")
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("mid"), path)
    checker = crl.RevocationChecker(path, ca.trusted())
    assert checker.is_revoked(leaf.issuer, leaf.serial_number)
    good = path.read_bytes()

    path.write_bytes(good[: len(good) // 2])  # a writer caught half way
    assert checker.is_revoked(leaf.issuer, leaf.serial_number)
    path.write_bytes(b"")  # a writer that truncated first
    assert checker.is_revoked(leaf.issuer, leaf.serial_number)
    path.unlink()  # a file that vanished for a moment
    assert checker.is_revoked(leaf.issuer, leaf.serial_number)

    crl.write_crl(ca.org_cert, ca.org_key, tmp_path / "fresh.pem")
    os.replace(tmp_path / "fresh.pem", path)  # a complete new CRL that lists nothing
    assert not checker.is_revoked(leaf.issuer, leaf.serial_number)


def test_checker_stats_at_most_every_recheck_interval(ca: Ca, tmp_path: Path) -> None:
    # Prepare: a fake clock.
    path = tmp_path / "crl.pem"
    leaf = ca.node("slow")
    now = [100.0]
    checker = crl.RevocationChecker(path, ca.trusted(), recheck_s=5.0, clock=lambda: now[0])
    assert not checker.is_revoked(leaf.issuer, leaf.serial_number)

    # Execute / Assert
    crl.revoke(ca.org_cert, ca.org_key, ca.cert_path("slow"), path)
    now[0] += 4.9
    assert not checker.is_revoked(leaf.issuer, leaf.serial_number), "not re-checked within recheck_s"
    now[0] += 0.2
    assert checker.is_revoked(leaf.issuer, leaf.serial_number)
