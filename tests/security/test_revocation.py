"""Revocation on every path: the whole chain, open streams, servers checked by clients, DHT records."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hypha.errors import PermissionDeniedError, UnauthenticatedError
from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.pki import certs, crl
from hypha.pki.identity import peer_id_of
from hypha.testing.pki import Pki
from hypha.v1 import worker_pb2_grpc
from tests.net.test_mtls import EchoWorker, call_status


@pytest.fixture
def crl_path(tmp_path: Path) -> Path:
    return tmp_path / "crl.pem"


@pytest.fixture
async def server(pki: Pki, crl_path: Path) -> AsyncIterator[NodeServer]:
    srv = NodeServer(
        pki.tls("worker", crl=crl_path),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, EchoWorker(), "hypha.v1.Worker")],
        revocation_recheck_s=0.05,
    )
    await srv.start()
    yield srv
    await srv.stop(0)


def second_org(pki: Pki, base: Path, name: str = "beta") -> tuple[Path, Path, TlsMaterial]:
    """Another organisation under the same root, and a scheduler certificate it issued."""
    base.mkdir(parents=True, exist_ok=True)
    shutil.copy(pki.root_cert, base / pki.root_cert.name)
    org_cert, org_key = certs.make_org(pki.root_cert, pki.root_key, name, base)
    certs.make_node(org_cert, org_key, "scheduler", f"{name}-sched", base)
    return org_cert, org_key, TlsMaterial.load(PathsTls.from_certs_dir(base, f"{name}-sched"))


async def test_revoking_an_org_ca_refuses_every_certificate_it_issued(
    pki: Pki, server: NodeServer, crl_path: Path, tmp_path: Path
) -> None:
    # Prepare: a scheduler of organisation beta is served while beta's CA is good.
    beta_cert, _, beta_sched = second_org(pki, tmp_path / "beta")
    await call_status(beta_sched, server.address)

    # Execute: the root revokes beta's CA (not the scheduler's own certificate).
    crl.revoke(pki.root_cert, pki.root_key, beta_cert, crl_path)

    # Assert: beta's scheduler is refused; acme's scheduler is not.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_status(beta_sched, server.address)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await call_status(pki.tls("scheduler"), server.address)


async def test_a_revoked_org_ca_is_recognised_by_nodes_that_do_not_trust_it_directly(
    pki: Pki, tmp_path: Path, crl_path: Path
) -> None:
    # Prepare: an acme node trusts root + acme only; beta's CA certificate is not among them.
    beta_cert, _, beta_sched = second_org(pki, tmp_path / "beta")
    checker = crl.RevocationChecker(crl_path, certs.load_cert_chain(pki.paths("worker").trust))
    peer = beta_sched.identity
    assert not checker.is_revoked(peer.issuer, peer.serial, peer.authority_key_id)

    # Execute
    crl.revoke(pki.root_cert, pki.root_key, beta_cert, crl_path)

    # Assert: the CRL file carries beta's certificate, so the chain walk finds it.
    assert checker.is_revoked(peer.issuer, peer.serial, peer.authority_key_id)


async def test_a_ca_reissued_under_the_same_name_is_not_revoked_with_the_old_one(
    pki: Pki, tmp_path: Path, crl_path: Path
) -> None:
    old_cert, _, old_sched = second_org(pki, tmp_path / "old", "gamma")
    _, _, new_sched = second_org(pki, tmp_path / "new", "gamma")  # same name, new key
    checker = crl.RevocationChecker(crl_path, certs.load_cert_chain(pki.paths("worker").trust))

    crl.revoke(pki.root_cert, pki.root_key, old_cert, crl_path)

    old, new = old_sched.identity, new_sched.identity
    assert checker.is_revoked(old.issuer, old.serial, old.authority_key_id)
    assert not checker.is_revoked(new.issuer, new.serial, new.authority_key_id)


async def test_an_open_stream_is_closed_when_its_peer_is_revoked(
    pki: Pki, server: NodeServer, crl_path: Path
) -> None:
    # Prepare: a client watches the server's health (a stream that stays open).
    client = pki.issue("client", "watcher")
    async with secure_channel(client, server.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        first = await stream.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING

        # Execute: revoke the watcher's certificate while the stream is open.
        crl.revoke(pki.org_cert, pki.org_key, pki.paths("watcher").cert, crl_path)

        # Assert: the server ends the stream with UNAUTHENTICATED, well before the deadline.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with asyncio.timeout(5):
                while True:
                    await stream.read()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.guard.refused.get("revoked_open_stream") == 1


async def test_streams_of_peers_still_in_good_standing_stay_open(
    pki: Pki, server: NodeServer, crl_path: Path
) -> None:
    pki.issue("client", "bystander")
    crl.revoke(pki.org_cert, pki.org_key, pki.paths("bystander").cert, crl_path)
    async with secure_channel(pki.tls("client"), server.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=0.5)
        assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
    # Our own deadline ended it, not the server (many re-checks happened in 0.5 s).
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "revoked_open_stream" not in server.guard.refused


def test_a_dht_record_signed_by_a_revoked_data_node_is_dropped_even_when_seen_before(
    pki: Pki, tmp_path: Path, crl_path: Path
) -> None:
    from hypha.dht.records import ProviderRecord, RecordVerifier, sign_record

    # Prepare: a data node's signed record, verified once (so it sits in the verifier's cache).
    cert, key, _ = certs.make_node(pki.org_cert, pki.org_key, "data", "d-revoked", tmp_path)
    chain = certs.load_cert_chain(cert)
    now = time.time()
    record = ProviderRecord.issue(
        "mnist", peer_id_of(chain[0]), ["10.0.0.5:7000"], 3, seq=1, now=now, lifetime_s=60.0
    )
    blob = sign_record(record, certs.load_private_key(key), chain)
    checker = crl.RevocationChecker(crl_path, certs.load_cert_chain(pki.root_cert))
    verifier = RecordVerifier(certs.load_cert_chain(pki.root_cert), revocation=checker)
    assert verifier.verify(blob).provider == record.provider

    # Execute
    crl.revoke(pki.org_cert, pki.org_key, cert, crl_path)

    # Assert: refused from the cache and by a fresh verifier alike.
    with pytest.raises(PermissionDeniedError, match="revoked"):
        verifier.verify(blob)
    fresh = RecordVerifier(certs.load_cert_chain(pki.root_cert), revocation=checker)
    with pytest.raises(PermissionDeniedError, match="revoked"):
        fresh.verify(blob)


def test_a_dht_record_under_a_revoked_org_ca_is_dropped(pki: Pki, tmp_path: Path, crl_path: Path) -> None:
    from hypha.dht.records import ProviderRecord, RecordVerifier, sign_record

    beta_cert, beta_key, _ = second_org(pki, tmp_path / "beta", "delta")
    cert, key, _ = certs.make_node(beta_cert, beta_key, "data", "d-beta", tmp_path / "beta")
    chain = certs.load_cert_chain(cert)
    record = ProviderRecord.issue(
        "mnist", peer_id_of(chain[0]), ["10.0.0.5:7000"], 3, seq=1, now=time.time(), lifetime_s=60.0
    )
    blob = sign_record(record, certs.load_private_key(key), chain)
    roots = certs.load_cert_chain(pki.root_cert)
    verifier = RecordVerifier(roots, revocation=crl.RevocationChecker(crl_path, roots))
    verifier.verify(blob)

    crl.revoke(pki.root_cert, pki.root_key, beta_cert, crl_path)

    with pytest.raises(PermissionDeniedError, match="revoked"):
        verifier.verify(blob)


async def test_a_node_never_dials_a_server_whose_certificate_is_revoked(pki: Pki, tmp_path: Path) -> None:
    from hypha.errors import UnavailableError
    from hypha.net.channel import check_server
    from hypha.net.connector import PeerConnector

    # Prepare: a worker serving with a certificate that our CRL then lists.
    rogue = pki.issue("worker", "rogue-worker")
    srv = NodeServer(
        rogue,
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, EchoWorker(), "hypha.v1.Worker")],
    )
    crl_path = tmp_path / "client-crl.pem"
    scheduler = pki.tls("scheduler", crl=crl_path)
    async with srv:
        assert (await check_server(scheduler, srv.address)).name == "rogue-worker"

        # Execute
        crl.revoke(pki.org_cert, pki.org_key, pki.paths("rogue-worker").cert, crl_path)

        # Assert: the check refuses it, and so does the connector (no relay: unreachable).
        with pytest.raises(UnauthenticatedError, match="revoked"):
            await check_server(scheduler, srv.address)
        connector = PeerConnector(scheduler, None, connect_timeout_s=2.0)
        with pytest.raises(UnavailableError):
            await connector.channel(rogue.identity.peer_id, [srv.address])
        await connector.close()


async def test_the_server_check_can_insist_on_the_peer_and_role_dialled(pki: Pki) -> None:
    from hypha.net.channel import check_server
    from hypha.pki.identity import Role

    srv = NodeServer(pki.tls("worker"), "127.0.0.1:0", [])
    async with srv:
        worker = await check_server(pki.tls("scheduler"), srv.address, roles=frozenset({Role.WORKER}))
        with pytest.raises(PermissionDeniedError):
            await check_server(pki.tls("scheduler"), srv.address, peer_id="someone-else")
        with pytest.raises(PermissionDeniedError):
            await check_server(pki.tls("client"), srv.address, roles=frozenset({Role.SCHEDULER}))
    assert worker.peer_id == pki.tls("worker").identity.peer_id
