"""Issuing the PKI: chains that verify, the constraints each level carries, identities."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from hypha.errors import InvalidArgumentError, PermissionDeniedError
from hypha.pki import certs
from hypha.pki.identity import (
    Role,
    identity_of_pem,
    peer_id_of,
    peer_id_of_public_key,
    role_from_proto,
    role_of,
    role_to_proto,
)
from hypha.v1 import common_pb2


@dataclass
class Ca:
    root_cert: Path
    root_key: Path
    org_cert: Path
    org_key: Path


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Ca:
    base = tmp_path_factory.mktemp("ca")
    root_cert, root_key = certs.make_root(base)
    org_cert, org_key = certs.make_org(root_cert, root_key, "acme", base)
    return Ca(root_cert, root_key, org_cert, org_key)


def leaf_of(path: Path) -> x509.Certificate:
    return certs.load_cert_chain(path)[0]


def test_node_under_org_verifies_as_client_and_server_against_the_root_alone(ca: Ca, tmp_path: Path) -> None:
    # Prepare
    cert, _, trust = certs.make_node(ca.org_cert, ca.org_key, Role.WORKER, "w1", tmp_path, sans=["10.1.2.3"])
    chain = certs.load_cert_chain(cert)
    root = certs.load_cert_chain(ca.root_cert)
    store = Store(root)

    # Execute
    client = PolicyBuilder().store(store).build_client_verifier().verify(chain[0], chain[1:])
    server = (
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("w1")).verify(chain[0], chain[1:])
    )
    by_ip = (
        PolicyBuilder()
        .store(store)
        .build_server_verifier(x509.IPAddress(ipaddress.ip_address("10.1.2.3")))
        .verify(chain[0], chain[1:])
    )

    # Assert
    assert [c.subject for c in client.chain] == [chain[0].subject, chain[1].subject, root[0].subject]
    assert server[-1] == root[0] and by_ip[-1] == root[0]
    assert len(chain) == 2, "cert file = leaf + org CA, root excluded"
    assert certs.load_cert_chain(trust) == [root[0], chain[1]], "trust = root then intermediates"


def test_node_without_its_intermediate_does_not_verify(ca: Ca, tmp_path: Path) -> None:
    cert, _, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w2", tmp_path)
    store = Store(certs.load_cert_chain(ca.root_cert))
    with pytest.raises(VerificationError):
        PolicyBuilder().store(store).build_client_verifier().verify(leaf_of(cert), [])


def test_node_of_another_root_does_not_verify(ca: Ca, tmp_path: Path) -> None:
    other_root, other_key = certs.make_root(tmp_path / "other")
    cert, _, _ = certs.make_node(other_root, other_key, "worker", "stranger", tmp_path)
    with pytest.raises(ValueError, match="does not verify"):
        certs.verify_chain(certs.load_cert_chain(cert), certs.load_cert_chain(ca.root_cert))


def test_verify_chain_refuses_an_expired_node(ca: Ca, tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    cert, _, trust = certs.make_node(
        ca.org_cert,
        ca.org_key,
        "scheduler",
        "old",
        tmp_path,
        not_before=now - dt.timedelta(days=10),
        not_after=now - dt.timedelta(days=1),
    )
    assert leaf_of(cert).not_valid_after_utc < now
    with pytest.raises(ValueError, match="does not verify"):
        certs.verify_chain(certs.load_cert_chain(cert), certs.load_cert_chain(trust))


def test_org_ca_has_path_length_zero_and_cannot_sign_another_ca(ca: Ca, tmp_path: Path) -> None:
    org = leaf_of(ca.org_cert)
    constraints = org.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = org.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    assert len(certs.load_cert_chain(ca.org_cert)) == 1, "org cert file holds only the intermediate"
    with pytest.raises(ValueError, match="path length 0"):
        certs.make_org(ca.org_cert, ca.org_key, "sub", tmp_path)


def test_root_is_a_self_signed_ca(ca: Ca) -> None:
    root = leaf_of(ca.root_cert)
    assert certs.is_self_signed(root)
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "hypha-root"


def test_node_cert_carries_both_ekus_role_ou_org_and_sans(ca: Ca, tmp_path: Path) -> None:
    cert, _, _ = certs.make_node(
        ca.org_cert, ca.org_key, "gateway", "gw-1", tmp_path, sans=["gw.example.org", "192.168.7.1", "::1"]
    )
    leaf = leaf_of(cert)

    ekus = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(ekus) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert [a.value for a in leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)] == [
        "gateway"
    ]
    assert leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "acme"
    assert role_of(leaf) is Role.GATEWAY
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["gw-1", "gw.example.org"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("192.168.7.1"),
        ipaddress.ip_address("::1"),
    ]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_agreement and not usage.key_cert_sign


def test_node_signed_by_root_directly_has_no_org_and_trusts_the_root(ca: Ca, tmp_path: Path) -> None:
    cert, _, trust = certs.make_node(ca.root_cert, ca.root_key, "admin", "ops", tmp_path)
    assert len(certs.load_cert_chain(cert)) == 1
    assert certs.load_cert_chain(trust) == certs.load_cert_chain(ca.root_cert)
    assert not leaf_of(cert).subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)


def test_leaf_does_not_outlive_its_ca(ca: Ca, tmp_path: Path) -> None:
    cert, _, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "long", tmp_path, days=100_000)
    assert leaf_of(cert).not_valid_after_utc <= leaf_of(ca.org_cert).not_valid_after_utc


def test_private_keys_are_unencrypted_pkcs8_readable_only_by_owner(ca: Ca, tmp_path: Path) -> None:
    _, key, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w3", tmp_path)
    for path in (key, ca.org_key, ca.root_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----"), path


def test_peer_id_is_stable_when_reissued_with_the_same_key_and_differs_for_a_new_key(
    ca: Ca, tmp_path: Path
) -> None:
    first, key, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w4", tmp_path)
    first_leaf = leaf_of(first)
    renewed_dir = tmp_path / "renewed"
    renewed, _, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w4", renewed_dir, key_path=key)
    fresh, _, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w4", tmp_path / "fresh")

    assert leaf_of(renewed).serial_number != first_leaf.serial_number
    assert peer_id_of(leaf_of(renewed)) == peer_id_of(first_leaf)
    assert peer_id_of(leaf_of(fresh)) != peer_id_of(first_leaf)
    assert peer_id_of_public_key(certs.load_private_key(key)) == peer_id_of(first_leaf)


def test_renewal_in_place_keeps_the_key_file(ca: Ca, tmp_path: Path) -> None:
    _, key, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w5", tmp_path)
    before = key.read_bytes()
    again, _, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w5", tmp_path, key_path=key)
    assert key.read_bytes() == before
    assert peer_id_of(leaf_of(again)) == peer_id_of_public_key(certs.load_private_key(key))


def test_peer_id_is_32_lowercase_base32_characters(ca: Ca, tmp_path: Path) -> None:
    cert, _, _ = certs.make_node(ca.org_cert, ca.org_key, "data", "d1", tmp_path)
    peer_id = peer_id_of(leaf_of(cert))
    assert len(peer_id) == 32
    assert set(peer_id) <= set("abcdefghijklmnopqrstuvwxyz234567")


def test_identity_of_pem_reads_every_field_and_is_cached(ca: Ca, tmp_path: Path) -> None:
    cert, _, _ = certs.make_node(ca.org_cert, ca.org_key, "scheduler", "sched", tmp_path)
    pem = cert.read_bytes()
    leaf = leaf_of(cert)

    identity = identity_of_pem(pem)
    hits_before = identity_of_pem.cache_info().hits
    again = identity_of_pem(pem)

    assert identity.role is Role.SCHEDULER and identity.name == "sched"
    assert identity.peer_id == peer_id_of(leaf) and identity.serial == leaf.serial_number
    assert identity.issuer == leaf_of(ca.org_cert).subject
    assert again is identity and identity_of_pem.cache_info().hits == hits_before + 1


def test_identity_of_garbage_pem_raises_value_error() -> None:
    with pytest.raises(ValueError):
        identity_of_pem(b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")


def test_certificate_without_a_role_is_permission_denied(ca: Ca) -> None:
    with pytest.raises(PermissionDeniedError):
        role_of(leaf_of(ca.org_cert))
    with pytest.raises(PermissionDeniedError):
        identity_of_pem(ca.root_cert.read_bytes())


@pytest.mark.parametrize("role", list(Role))
def test_roles_round_trip_through_the_wire_enum(role: Role) -> None:
    value = role_to_proto(role)
    assert value == common_pb2.Role.Value(f"ROLE_{role.value.upper()}")
    assert role_from_proto(value) is role


@pytest.mark.parametrize("value", [common_pb2.ROLE_UNSPECIFIED, 99])
def test_unset_or_unknown_wire_role_is_invalid(value: int) -> None:
    with pytest.raises(InvalidArgumentError):
        role_from_proto(value)


def test_trust_root_is_found_next_to_the_org_ca_or_inside_its_file(ca: Ca, tmp_path: Path) -> None:
    # Prepare: an org CA cert copied away from root-ca-cert.pem.
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    org_only = lonely / "acme-ca-cert.pem"
    org_only.write_bytes(ca.org_cert.read_bytes())
    with_root = tmp_path / "bundle-ca-cert.pem"
    with_root.write_bytes(ca.org_cert.read_bytes() + ca.root_cert.read_bytes())

    # Execute / Assert
    with pytest.raises(ValueError, match="cannot find the root CA"):
        certs.make_node(org_only, ca.org_key, "worker", "w6", tmp_path)
    _, _, trust = certs.make_node(with_root, ca.org_key, "worker", "w6", tmp_path)
    assert certs.load_cert_chain(trust)[0] == leaf_of(ca.root_cert)


def test_wrong_ca_key_is_refused(ca: Ca, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not belong"):
        certs.make_node(ca.org_cert, ca.root_key, "worker", "w7", tmp_path)


def test_leaf_cannot_issue(ca: Ca, tmp_path: Path) -> None:
    cert, key, _ = certs.make_node(ca.org_cert, ca.org_key, "worker", "w8", tmp_path)
    with pytest.raises(ValueError, match="not a CA"):
        certs.make_node(cert, key, "worker", "w9", tmp_path)


@pytest.mark.parametrize("name", ["", "../escape", "a b", "-dash", "x" * 64])
def test_unsafe_node_names_are_refused(ca: Ca, tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid node name"):
        certs.make_node(ca.org_cert, ca.org_key, "worker", name, tmp_path)


def test_unknown_role_is_refused(ca: Ca, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown role"):
        certs.make_node(ca.org_cert, ca.org_key, "emperor", "e1", tmp_path)


def test_existing_root_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    cert, _ = certs.make_root(tmp_path)
    before = cert.read_bytes()
    with pytest.raises(FileExistsError):
        certs.make_root(tmp_path)
    assert cert.read_bytes() == before
    certs.make_root(tmp_path, overwrite=True)
    assert cert.read_bytes() != before
