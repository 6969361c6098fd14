"""Relayed calls are checked against the callee's CRL like direct ones (issue 16, item 3),
when they open and again while they stay open.

The gateway stamps each sender's certificate (serial, issuer, issuer key id)
from its TLS session on what it delivers; the callee's relay checks that
certificate and the CAs above it. The gateway here has no CRL, so only the
callee can refuse: the test shows the check happens where the call is served.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from hypha.net.relay import Relay
from hypha.net.server import NodeServer
from hypha.pki import crl
from hypha.testing.mesh import Mesh
from hypha.testing.pki import Pki
from hypha.v1 import worker_pb2, worker_pb2_grpc
from tests.net.test_mtls import call_status
from tests.net.test_relay import RecordingWorker, status_of


@pytest.fixture
async def mesh(pki: Pki) -> AsyncIterator[Mesh]:
    gateways = Mesh(pki)
    await gateways.full_mesh(1)
    yield gateways
    await gateways.close()


async def test_a_revoked_callers_relayed_call_is_unauthenticated_like_its_direct_call(
    pki: Pki, mesh: Mesh, tmp_path: Path
) -> None:
    # Prepare: one worker servicer behind a direct mTLS server and behind the relay, both with a CRL.
    crl_path = tmp_path / "crl.pem"
    worker_tls = pki.tls("worker", crl=crl_path)
    servicer = RecordingWorker()
    bindings = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "hypha.v1.Worker")]
    direct = NodeServer(worker_tls, "127.0.0.1:0", bindings)
    await direct.start()
    gateway = mesh.gateways[0].address
    tag = uuid.uuid4().hex[:8]
    server_link = await mesh.add_link("worker", f"served-{tag}", [gateway])
    caller_name = f"caller-{tag}"
    caller_link = await mesh.add_link("scheduler", caller_name, [gateway])
    served = Relay(server_link, grace_s=0.0, revocation=worker_tls.revocation)
    served.serve(bindings)
    calling = Relay(caller_link)
    await served.start()
    await calling.start()
    stub = worker_pb2_grpc.WorkerStub(calling.channel(server_link.peer_id))
    try:
        before = await stub.RenewLease(worker_pb2.RenewLeaseRequest(lease_id="l1"), timeout=5)

        # Execute: the caller's organisation revokes its certificate.
        crl.revoke(pki.org_cert, pki.org_key, pki.paths(caller_name).cert, crl_path)
        with pytest.raises(grpc.aio.AioRpcError) as direct_err:
            await call_status(pki.tls(caller_name), direct.address)
        relayed = await status_of(stub.RenewLease(worker_pb2.RenewLeaseRequest(lease_id="l2"), timeout=5))
        bystander = await call_status(pki.tls("scheduler"), direct.address)
    finally:
        await calling.stop()
        await served.stop()
        await direct.stop(0)

    # Assert: served before; refused on both paths after, the handler never reached for l2.
    assert before.worker_id == caller_link.peer_id
    assert direct_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert relayed == (grpc.StatusCode.UNAUTHENTICATED, "certificate revoked")
    assert served.server.refusals == {"revoked": 1}
    assert bystander.peer_id


@pytest.mark.timeout(60)
async def test_an_open_relayed_stream_ends_unauthenticated_when_its_caller_is_revoked(
    pki: Pki, mesh: Mesh, tmp_path: Path
) -> None:
    # Prepare: a worker serving over the relay with a CRL, re-checking open calls every 50 ms;
    # two schedulers each hold a long tensor pull open (first chunk received, the rest never comes).
    crl_path = tmp_path / "crl.pem"
    worker_tls = pki.tls("worker", crl=crl_path)
    bindings = [(worker_pb2_grpc.add_WorkerServicer_to_server, RecordingWorker(), "hypha.v1.Worker")]
    gateway = mesh.gateways[0].address
    tag = uuid.uuid4().hex[:8]
    server_link = await mesh.add_link("worker", f"served-{tag}", [gateway])
    revoked_name = f"revoked-{tag}"
    revoked_link = await mesh.add_link("scheduler", revoked_name, [gateway])
    bystander_link = await mesh.add_link("scheduler", f"bystander-{tag}", [gateway])
    served = Relay(server_link, grace_s=0.0, revocation=worker_tls.revocation, revocation_recheck_s=0.05)
    served.serve(bindings)
    callers = [Relay(revoked_link), Relay(bystander_link)]
    for relay in (served, *callers):
        await relay.start()
    revoked_stub, bystander_stub = (
        worker_pb2_grpc.WorkerStub(relay.channel(server_link.peer_id)) for relay in callers
    )
    pull = worker_pb2.PullTensorsRequest(job_id="j", kind="forever")
    revoked_call = revoked_stub.PullTensors(pull, timeout=30)
    bystander_call = bystander_stub.PullTensors(pull, timeout=30)
    try:
        first = [await asyncio.wait_for(call.read(), 10) for call in (revoked_call, bystander_call)]
        open_before = served.server.active_calls

        # Execute: the revoked caller's organisation revokes its certificate while both calls are open.
        crl.revoke(pki.org_cert, pki.org_key, pki.paths(revoked_name).cert, crl_path)
        ended = await status_of(asyncio.wait_for(revoked_call.read(), 10))
        bystander_done = bystander_call.done()
        open_after = served.server.active_calls
        # A new call from the revoked caller is refused the same way.
        reopened = await status_of(revoked_stub.PullTensors(pull, timeout=5).read())
    finally:
        bystander_call.cancel()
        for relay in (*callers, served):
            await relay.stop()

    # Assert: both streams were open; the revoked one ended as a new call from it is refused, and
    # the other caller's stream is untouched.
    assert [chunk.chunk.offset for chunk in first] == [0, 0]
    assert open_before == 2
    assert ended == (grpc.StatusCode.UNAUTHENTICATED, "certificate revoked while the call was open")
    assert reopened == (grpc.StatusCode.UNAUTHENTICATED, "certificate revoked")
    assert not bystander_done
    assert open_after == 1
    assert served.server.refusals == {"revoked_open_call": 1, "revoked": 1}


async def test_the_gateway_stamps_the_senders_certificate_not_its_claims(pki: Pki, mesh: Mesh) -> None:
    # Prepare
    gateway = mesh.gateways[0].address
    tag = uuid.uuid4().hex[:8]
    receiver = await mesh.add_link("worker", f"rx-{tag}", [gateway])
    sender = await mesh.add_link("scheduler", f"tx-{tag}", [gateway])
    inbox = receiver.direct("stamp-test")

    # Execute
    await sender.send(receiver.peer_id, b"hello", "stamp-test")
    message = await asyncio.wait_for(anext(aiter(inbox)), 5)

    # Assert: the certificate the sender proved in TLS, as its CRL entry would name it.
    identity = pki.tls(f"tx-{tag}").identity
    assert message.from_peer == sender.peer_id
    assert message.from_serial == identity.serial
    assert message.from_issuer == identity.issuer.rfc4514_string()
    assert message.from_issuer_key_id == identity.authority_key_id
