"""Signed provider records: what a verifier accepts, what it refuses and why, and how storers order them."""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import umsgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.dht import records
from hypha.dht.provider_table import ProviderTable, PutOutcome
from hypha.dht.records import (
    MAX_ADDRESSES,
    MAX_DATASET_CHARS,
    MAX_RECORD_BYTES,
    ProviderRecord,
    RecordVerifier,
    canonical_json,
    next_seq,
    sign_record,
)
from hypha.errors import InvalidArgumentError, PermissionDeniedError
from hypha.pki import certs
from hypha.pki.identity import peer_id_of
from tests.conftest import Pki


@dataclass(frozen=True)
class Identity:
    """A node key and its chain (leaf first, then the org CA), as a data node would load them."""

    key: ec.EllipticCurvePrivateKey
    chain: list[x509.Certificate]

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.chain[0])


def issue_identity(pki: Pki, role: str, name: str, out_dir: Path, **kwargs: object) -> Identity:
    cert, key, _ = certs.make_node(pki.org_cert, pki.org_key, role, name, out_dir, **kwargs)  # type: ignore[arg-type]
    return Identity(certs.load_private_key(key), certs.load_cert_chain(cert))


def trusted_roots(pki: Pki) -> list[x509.Certificate]:
    return certs.load_cert_chain(pki.root_cert)


def make_record(
    ident: Identity, *, now: float, seq: int = 1, lifetime_s: float = 60.0, **fields: object
) -> ProviderRecord:
    record = ProviderRecord.issue(
        "mnist", ident.peer_id, ["10.0.0.5:7000"], 12, seq=seq, now=now, lifetime_s=lifetime_s
    )
    return replace(record, **fields)  # type: ignore[arg-type]


def forge(body: dict[str, object], ident: Identity) -> bytes:
    """Sign an arbitrary body with ``ident``, skipping sign_record's own safety checks."""
    signature = ident.key.sign(canonical_json(body), ec.ECDSA(hashes.SHA256()))
    return canonical_json(
        {
            "body": body,
            "chain": [
                base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode() for c in ident.chain
            ],
            "sig": base64.b64encode(signature).decode(),
        }
    )


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def idents(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    out = tmp_path_factory.mktemp("dht-records-certs")
    return {
        "data": issue_identity(pki, "data", "rec-data", out),
        "data2": issue_identity(pki, "data", "rec-data2", out),
        "worker": issue_identity(pki, "worker", "rec-worker", out),
    }


@pytest.fixture
def verifier(pki: Pki) -> RecordVerifier:
    return RecordVerifier(trusted_roots(pki), max_skew_s=5.0)


def test_signed_record_verifies_back_to_the_same_record(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    # Prepare
    record = make_record(idents["data"], now=time.time())

    # Execute
    blob = sign_record(record, idents["data"].key, idents["data"].chain)

    # Assert
    assert verifier.verify(blob) == record
    assert len(blob) < MAX_RECORD_BYTES


def test_tampered_body_is_rejected(idents: dict[str, Identity], verifier: RecordVerifier) -> None:
    blob = sign_record(make_record(idents["data"], now=time.time()), idents["data"].key, idents["data"].chain)
    envelope = json.loads(blob)
    envelope["body"]["addresses"] = ["6.6.6.6:7000"]

    with pytest.raises(PermissionDeniedError, match="signature"):
        verifier.verify(canonical_json(envelope))


def test_manifest_pin_is_signed_and_cannot_be_swapped(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    record = make_record(idents["data"], now=time.time(), manifest_sha256="a" * 64)
    blob = sign_record(record, idents["data"].key, idents["data"].chain)
    envelope = json.loads(blob)
    envelope["body"]["manifest_sha256"] = "b" * 64

    assert verifier.verify(blob).manifest_sha256 == "a" * 64
    with pytest.raises(PermissionDeniedError, match="signature"):
        verifier.verify(canonical_json(envelope))


def test_swapped_signature_is_rejected(idents: dict[str, Identity], verifier: RecordVerifier) -> None:
    now = time.time()
    one = json.loads(
        sign_record(make_record(idents["data"], now=now), idents["data"].key, idents["data"].chain)
    )
    two = json.loads(
        sign_record(make_record(idents["data"], now=now, seq=2), idents["data"].key, idents["data"].chain)
    )
    one["sig"] = two["sig"]

    with pytest.raises(PermissionDeniedError, match="signature"):
        verifier.verify(canonical_json(one))


def test_expired_record_is_rejected(idents: dict[str, Identity], pki: Pki) -> None:
    clock = FakeClock(time.time())
    verifier = RecordVerifier(trusted_roots(pki), clock=clock, max_skew_s=5.0)
    blob = sign_record(
        make_record(idents["data"], now=clock.now, lifetime_s=60), idents["data"].key, idents["data"].chain
    )
    assert verifier.verify(blob)

    clock.now += 60 + 5 + 1  # past expiry plus the skew allowance

    with pytest.raises(PermissionDeniedError, match="expired"):
        verifier.verify(blob)  # the cached copy is re-checked against the clock too


def test_record_issued_in_the_future_is_rejected(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    record = make_record(idents["data"], now=time.time() + 600)

    with pytest.raises(PermissionDeniedError, match="future"):
        verifier.verify(sign_record(record, idents["data"].key, idents["data"].chain))


def test_lifetime_over_the_cap_is_rejected(idents: dict[str, Identity], pki: Pki) -> None:
    verifier = RecordVerifier(trusted_roots(pki), max_lifetime_s=3600)
    record = make_record(idents["data"], now=time.time(), lifetime_s=3601)

    with pytest.raises(InvalidArgumentError, match="lifetime"):
        verifier.verify(sign_record(record, idents["data"].key, idents["data"].chain))


def test_record_signed_under_a_foreign_ca_is_rejected(
    foreign_pki: Pki, verifier: RecordVerifier, tmp_path: Path
) -> None:
    stranger = issue_identity(foreign_pki, "data", "stranger", tmp_path)
    blob = sign_record(make_record(stranger, now=time.time()), stranger.key, stranger.chain)

    with pytest.raises(PermissionDeniedError, match="trusted CA"):
        verifier.verify(blob)


def test_foreign_leaf_with_our_intermediate_is_rejected(
    foreign_pki: Pki, idents: dict[str, Identity], verifier: RecordVerifier, tmp_path: Path
) -> None:
    stranger = issue_identity(foreign_pki, "data", "stranger2", tmp_path)
    # Presenting our org CA as the "intermediate" does not make a foreign leaf trusted.
    chain = [stranger.chain[0], idents["data"].chain[1]]
    blob = sign_record(make_record(stranger, now=time.time()), stranger.key, chain)

    with pytest.raises(PermissionDeniedError, match="trusted CA"):
        verifier.verify(blob)


def test_record_from_a_non_data_role_is_rejected(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    worker = idents["worker"]
    blob = sign_record(make_record(worker, now=time.time()), worker.key, worker.chain)

    with pytest.raises(PermissionDeniedError, match="role worker"):
        verifier.verify(blob)


def test_record_naming_another_provider_is_rejected(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    # data signs a record that claims data2 provides the dataset.
    body = make_record(idents["data"], now=time.time(), provider=idents["data2"].peer_id).to_body()

    with pytest.raises(PermissionDeniedError, match="signed by"):
        verifier.verify(forge(body, idents["data"]))


def test_sign_record_refuses_a_mismatched_key_or_provider(idents: dict[str, Identity]) -> None:
    record = make_record(idents["data"], now=time.time())

    with pytest.raises(InvalidArgumentError, match="does not match"):
        sign_record(record, idents["data2"].key, idents["data"].chain)
    with pytest.raises(InvalidArgumentError, match="not the signer"):
        sign_record(record, idents["data2"].key, idents["data2"].chain)


def test_expired_certificate_is_rejected(pki: Pki, verifier: RecordVerifier, tmp_path: Path) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    old = issue_identity(
        pki, "data", "retired", tmp_path, not_before=past, not_after=past + dt.timedelta(days=1)
    )
    blob = sign_record(make_record(old, now=time.time()), old.key, old.chain)

    with pytest.raises(PermissionDeniedError, match="trusted CA"):
        verifier.verify(blob)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"not json",
        b"[]",
        b'{"body": {}, "chain": [], "sig": ""}',
        b'{"body": {"v": 1}, "chain": ["AA=="], "sig": "AA==", "extra": 1}',
        "ünïcode".encode("latin-1"),
    ],
    ids=["empty", "not-json", "array", "empty-body", "extra-field", "bad-encoding"],
)
def test_malformed_blob_is_rejected(blob: bytes, verifier: RecordVerifier) -> None:
    with pytest.raises(InvalidArgumentError):
        verifier.verify(blob)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq", -1),
        ("seq", "7"),
        ("slice_count", True),
        ("addresses", []),
        ("addresses", ["no-port"]),
        ("expires_at", "soon"),
        ("v", 1),  # version 1 had no manifest pin
        ("v", 3),
        ("manifest_sha256", "not-hex"),
    ],
)
def test_body_with_a_wrong_field_is_rejected(
    field: str, value: object, idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    body = make_record(idents["data"], now=time.time()).to_body()
    body[field] = value

    with pytest.raises(InvalidArgumentError):
        verifier.verify(forge(body, idents["data"]))


def test_bad_base64_in_chain_or_signature_is_rejected(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    envelope = json.loads(
        sign_record(make_record(idents["data"], now=time.time()), idents["data"].key, idents["data"].chain)
    )
    envelope["sig"] = "***"

    with pytest.raises(InvalidArgumentError, match="base64"):
        verifier.verify(canonical_json(envelope))


def test_largest_legal_record_fits_one_dht_request(
    idents: dict[str, Identity], verifier: RecordVerifier
) -> None:
    # Prepare: every field at its maximum.
    host = "h" * 250
    record = make_record(
        idents["data"],
        now=time.time(),
        dataset="d" * MAX_DATASET_CHARS,
        addresses=tuple(f"{host}{i}:65535" for i in range(MAX_ADDRESSES)),
        slice_count=2**63 - 1,
        seq=2**63 - 1,
    )

    # Execute
    blob = sign_record(record, idents["data"].key, idents["data"].chain)

    # Assert: under our cap, and the add_provider request stays under rpcudp's 8 KiB limit.
    assert len(blob) <= MAX_RECORD_BYTES
    assert len(umsgpack.packb(["add_provider", (b"\x00" * 20, b"\x00" * 20, blob)])) <= 8192
    assert verifier.verify(blob) == record


def test_oversized_record_is_refused_by_signer_and_verifier(
    pki: Pki, verifier: RecordVerifier, tmp_path: Path
) -> None:
    bulky = issue_identity(
        pki, "data", "bulky", tmp_path, sans=[f"host-{i:03d}-{'x' * 50}.example" for i in range(80)]
    )
    record = make_record(bulky, now=time.time())

    with pytest.raises(InvalidArgumentError, match="limit"):
        sign_record(record, bulky.key, bulky.chain)
    with pytest.raises(InvalidArgumentError, match="limit"):
        verifier.verify(b" " * (MAX_RECORD_BYTES + 1))


def test_repeated_chain_is_verified_once(
    idents: dict[str, Identity], verifier: RecordVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = records.verify_chain

    def counting(*args: Any, **kwargs: Any) -> list[x509.Certificate]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "verify_chain", counting)
    now = time.time()

    for seq in range(1, 6):
        verifier.verify(
            sign_record(
                make_record(idents["data"], now=now, seq=seq), idents["data"].key, idents["data"].chain
            )
        )

    assert len(calls) == 1


def test_storer_keeps_the_higher_seq_and_refuses_a_replay(idents: dict[str, Identity]) -> None:
    # Prepare
    clock = FakeClock()
    table = ProviderTable(clock=clock)
    key = b"k" * 20
    old = make_record(idents["data"], now=clock.now, seq=3)
    new = make_record(idents["data"], now=clock.now, seq=7)

    # Execute / Assert
    assert table.put(key, old, b"old") is PutOutcome.STORED
    assert table.put(key, new, b"new") is PutOutcome.REPLACED
    assert table.put(key, old, b"old") is PutOutcome.STALE
    assert table.put(key, new, b"new") is PutOutcome.UNCHANGED
    assert table.get(key) == [(new, b"new")]


def test_storer_drops_expired_records(idents: dict[str, Identity]) -> None:
    clock = FakeClock()
    table = ProviderTable(clock=clock)
    key = b"k" * 20
    table.put(key, make_record(idents["data"], now=clock.now, lifetime_s=10), b"a")
    table.put(key, make_record(idents["data2"], now=clock.now, lifetime_s=100), b"b")

    clock.now += 50

    assert [blob for _, blob in table.get(key)] == [b"b"]
    assert (
        table.put(key, make_record(idents["data"], now=clock.now - 60, lifetime_s=10), b"c")
        is PutOutcome.EXPIRED
    )


def test_storer_bounds_providers_per_key(idents: dict[str, Identity]) -> None:
    clock = FakeClock()
    table = ProviderTable(max_per_key=2, clock=clock)
    key = b"k" * 20
    base = make_record(idents["data"], now=clock.now)
    short, mid, long_ = (
        replace(base, provider=f"p{i}", expires_at=clock.now + life)
        for i, life in ((1, 10), (2, 20), (3, 30))
    )
    table.put(key, short, b"1")
    table.put(key, mid, b"2")

    # A longer-lived newcomer evicts the record that dies first; a shorter-lived one is refused.
    assert table.put(key, long_, b"3") is PutOutcome.STORED
    assert table.put(key, replace(short, provider="p4"), b"4") is PutOutcome.FULL
    assert sorted(blob for _, blob in table.get(key)) == [b"2", b"3"]


def test_storer_bounds_records_per_provider(idents: dict[str, Identity]) -> None:
    # Prepare: one certificate may hold two records; another provider is unaffected.
    clock = FakeClock()
    table = ProviderTable(max_per_provider=2, clock=clock)
    mine = make_record(idents["data"], now=clock.now, lifetime_s=10)
    other = make_record(idents["data2"], now=clock.now)

    # Execute / Assert: a third dataset of the same provider is over its quota, a newer seq is not.
    assert table.put(b"a" * 20, mine, b"1") is PutOutcome.STORED
    assert table.put(b"b" * 20, mine, b"2") is PutOutcome.STORED
    assert table.put(b"c" * 20, mine, b"3") is PutOutcome.OVER_QUOTA
    assert table.put(b"a" * 20, replace(mine, seq=2), b"1b") is PutOutcome.REPLACED
    assert table.put(b"c" * 20, other, b"4") is PutOutcome.STORED
    assert table.records_of(mine.provider) == 2 and len(table) == 3

    # Expired records free the quota again.
    clock.now += 60
    assert table.put(b"c" * 20, make_record(idents["data"], now=clock.now), b"5") is PutOutcome.STORED


def test_storer_bounds_the_bytes_it_keeps(idents: dict[str, Identity]) -> None:
    clock = FakeClock()
    table = ProviderTable(max_bytes=10, clock=clock)
    first = make_record(idents["data"], now=clock.now, lifetime_s=10)
    second = make_record(idents["data2"], now=clock.now)

    assert table.put(b"a" * 20, first, b"x" * 6) is PutOutcome.STORED
    assert table.put(b"b" * 20, second, b"y" * 6) is PutOutcome.FULL
    assert table.put(b"a" * 20, replace(first, seq=2), b"x" * 11) is PutOutcome.FULL
    assert table.stored_bytes == 6
    clock.now += 60  # the first expires: its bytes are free again
    assert table.put(b"b" * 20, second, b"y" * 6) is PutOutcome.STORED
    assert table.stored_bytes == 6


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=20))
def test_storer_ends_with_the_highest_seq_whatever_the_order(seqs: list[int]) -> None:
    clock = FakeClock()
    table = ProviderTable(clock=clock)
    base = ProviderRecord.issue("d", "peer", ["h:1"], 1, seq=0, now=clock.now, lifetime_s=60)

    for seq in seqs:
        table.put(b"k" * 20, replace(base, seq=seq), str(seq).encode())

    assert [r.seq for r, _ in table.get(b"k" * 20)] == [max(seqs)]


def test_next_seq_outranks_a_previous_run() -> None:
    # A restarted publisher (no memory of seq) still beats what it published a second earlier.
    before = next_seq(None, 1000.0)
    assert next_seq(None, 1001.0) > before
    assert next_seq(before, 1000.0) == before + 1
