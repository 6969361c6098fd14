"""Mutual TLS, roles, revocation and the error mapping, on real sockets."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hypha.errors import NotFoundError
from hypha.net.auth import peer_identity
from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.net.tls import TlsMaterial
from hypha.pki import crl
from hypha.pki.certs import load_cert_chain
from hypha.pki.identity import peer_id_of
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import Pki
from tests.helpers import eventually


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    """Answers with what the server learned about its caller."""

    async def GetStatus(self, request: object, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStatus:
        peer = peer_identity(context)
        return worker_pb2.WorkerStatus(peer_id=peer.peer_id, name=peer.name)

    async def RenewLease(self, request: worker_pb2.RenewLeaseRequest, context: object) -> common_pb2.Lease:
        if request.lease_id == "missing":
            raise NotFoundError("no such lease: missing")
        if request.lease_id == "boom":
            raise RuntimeError("secret internal detail")
        return common_pb2.Lease(lease_id=request.lease_id)


@pytest.fixture
async def server(pki: Pki, tmp_path: Path) -> AsyncIterator[NodeServer]:
    crl_path = tmp_path / "crl.pem"
    srv = NodeServer(
        pki.tls("worker", crl=crl_path),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, EchoWorker(), "hypha.v1.Worker")],
    )
    await srv.start()
    yield srv
    await srv.stop(0)


async def call_status(tls: TlsMaterial, address: str) -> worker_pb2.WorkerStatus:
    async with secure_channel(tls, address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        )


async def test_trusted_peer_is_served_and_seen_with_its_certificate_peer_id(
    pki: Pki, server: NodeServer
) -> None:
    reply = await call_status(pki.tls("scheduler"), server.address)
    expected = peer_id_of(load_cert_chain(pki.paths("scheduler").cert)[0])
    assert reply.peer_id == expected
    assert reply.name == "scheduler"


async def test_certificate_from_foreign_ca_is_refused(foreign_pki: Pki, server: NodeServer) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_status(foreign_pki.tls("scheduler"), server.address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_caller_without_client_certificate_is_refused(pki: Pki, server: NodeServer) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki.paths("scheduler").trust.read_bytes())
    async with grpc.aio.secure_channel(server.address, creds) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await worker_pb2_grpc.WorkerStub(channel).GetStatus(
                worker_pb2.GetWorkerStatusRequest(), timeout=5
            )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_expired_certificate_is_refused(pki: Pki, server: NodeServer) -> None:
    now = dt.datetime.now(dt.UTC)
    expired = pki.issue(
        "scheduler",
        "expired-scheduler",
        not_before=now - dt.timedelta(days=10),
        not_after=now - dt.timedelta(days=1),
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_status(expired, server.address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_revoked_certificate_is_refused_once_the_crl_changes(
    pki: Pki, server: NodeServer, tmp_path: Path
) -> None:
    victim = pki.issue("scheduler", "soon-revoked")
    assert (await call_status(victim, server.address)).name == "soon-revoked"
    crl.revoke(pki.org_cert, pki.org_key, pki.paths("soon-revoked").cert, tmp_path / "crl.pem")

    async def refused() -> bool:
        try:
            await call_status(victim, server.address)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            return True
        return False

    await eventually(refused, timeout=10, message="revoked certificate refused")
    # Others are unaffected.
    assert (await call_status(pki.tls("scheduler"), server.address)).name == "scheduler"


async def test_wrong_role_gets_permission_denied(pki: Pki, server: NodeServer) -> None:
    async with secure_channel(pki.tls("worker"), server.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RenewLease(worker_pb2.RenewLeaseRequest(lease_id="l1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with secure_channel(pki.tls("scheduler"), server.address) as channel:
        lease = await worker_pb2_grpc.WorkerStub(channel).RenewLease(
            worker_pb2.RenewLeaseRequest(lease_id="l1")
        )
    assert lease.lease_id == "l1"


async def test_domain_errors_map_to_their_status_and_others_are_sanitized(
    pki: Pki, server: NodeServer
) -> None:
    async with secure_channel(pki.tls("scheduler"), server.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.RenewLease(worker_pb2.RenewLeaseRequest(lease_id="missing"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as boom:
            await stub.RenewLease(worker_pb2.RenewLeaseRequest(lease_id="boom"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
            await stub.ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id="x"), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "missing" in (missing.value.details() or "")
    assert boom.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (boom.value.details() or "")
    assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_oversized_message_is_rejected(pki: Pki, server: NodeServer) -> None:
    async with secure_channel(
        pki.tls("scheduler"), server.address, max_message_bytes=8 * 1024 * 1024
    ) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RenewLease(worker_pb2.RenewLeaseRequest(lease_id="x" * (3 * 1024 * 1024)), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_health_and_reflection_are_served(pki: Pki, server: NodeServer) -> None:
    async with secure_channel(pki.tls("client"), server.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in replies for s in r.list_services_response.service]
    assert "hypha.v1.Worker" in names
    assert "grpc.health.v1.Health" in names
