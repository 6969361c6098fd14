"""Relayed calls: same stubs, same results, same status codes as direct calls.

Most tests run over in-memory links (``fakelink``), which can drop, repeat and
reorder frames. The ``@contract`` ones run twice: over the fake and over real
node links through a real gateway, so the fake cannot drift from what it
stands for.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import NotFoundError, UnavailableError
from hypha.net.auth import peer_identity
from hypha.net.connector import PeerConnector
from hypha.net.link import NodeLink
from hypha.net.messages import RELAY_CHANNEL, Message
from hypha.net.relay import Relay, RelayChannel, RelayLimits
from hypha.net.relay_frames import SERVER_SIDE, FramesLostError, Sequencer, frame_message_id
from hypha.net.server import NodeServer
from hypha.pki.certs import load_cert_chain
from hypha.pki.identity import PeerIdentity, Role, peer_id_of
from hypha.testing.mesh import Mesh as GatewayMesh
from hypha.v1 import common_pb2, data_pb2, data_pb2_grpc, gateway_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import Pki
from tests.helpers import eventually
from tests.net.fakelink import FakeLink, FakeNetwork

MIB = 1024 * 1024
BLOB = bytes(range(256)) * (5 * MIB // 256 + 3)  # a little over 5 MiB: the last chunk is short


def caller(context: grpc.aio.ServicerContext) -> PeerIdentity:
    relayed: PeerIdentity | None = getattr(context, "relay_identity", None)
    return relayed if relayed is not None else peer_identity(context)


class RecordingWorker(worker_pb2_grpc.WorkerServicer):
    """A worker whose handlers show what the relay did to them."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.time_remaining: float | None = None

    async def GetStatus(self, request: object, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStatus:
        peer = caller(context)
        return worker_pb2.WorkerStatus(peer_id=peer.peer_id, name=peer.role.value, price=1.5)

    async def RenewLease(
        self, request: worker_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Lease:
        if request.lease_id == "missing":
            raise NotFoundError("no such lease: missing")
        if request.lease_id == "boom":
            raise RuntimeError("secret internal detail")
        if request.lease_id == "expired":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "lease expired")
        return common_pb2.Lease(lease_id=request.lease_id, worker_id=caller(context).peer_id)

    async def GetJobStatus(
        self, request: object, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerJobStatus:
        self.time_remaining = context.time_remaining()
        await self._block()
        raise AssertionError("unreachable")

    async def PushTensors(
        self, request_iterator: AsyncIterator[worker_pb2.TensorChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushTensorsResponse:
        digest = hashlib.sha256()
        offsets = []
        async for item in request_iterator:
            offsets.append(item.chunk.offset)
            digest.update(item.chunk.data)
        in_order = offsets == sorted(offsets)
        return worker_pb2.PushTensorsResponse(
            accepted=in_order, message=f"{digest.hexdigest()}:{len(offsets)}"
        )

    async def PullTensors(
        self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TensorChunk]:
        if request.kind == "huge":
            yield chunk_at(0, b"x" * (2 * MIB))
            return
        for offset in range(0, len(BLOB), MIB):
            yield chunk_at(offset, BLOB[offset : offset + MIB])
            if request.kind == "forever":
                await self._block()

    async def _block(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def chunk_at(offset: int, data: bytes) -> worker_pb2.TensorChunk:
    return worker_pb2.TensorChunk(
        job_id="j", kind="delta", chunk=common_pb2.Chunk(offset=offset, data=data, total_size=len(BLOB))
    )


async def push_chunks() -> AsyncIterator[worker_pb2.TensorChunk]:
    for offset in range(0, len(BLOB), MIB):
        yield chunk_at(offset, BLOB[offset : offset + MIB])


@dataclass
class Mesh:
    """A worker serving over the relay, and relays for a scheduler and another worker calling it."""

    network: FakeNetwork | None  # None over a real gateway
    servicer: RecordingWorker
    server: Relay
    server_link: FakeLink | NodeLink
    scheduler: Relay
    scheduler_link: FakeLink | NodeLink
    peer_worker: Relay
    gateways: GatewayMesh | None = None

    def stub(self, relay: Relay) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(relay.channel(self.server.peer_id))


async def make_mesh(limits: RelayLimits | None = None, scheduler_id: str = "scheduler-peer") -> Mesh:
    network = FakeNetwork()
    servicer = RecordingWorker()
    server_link = network.link("worker-peer", Role.WORKER)
    server = Relay(server_link, limits=limits, grace_s=0.0)
    server.serve([(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "hypha.v1.Worker")])
    scheduler_link = network.link(scheduler_id, Role.SCHEDULER)
    scheduler = Relay(scheduler_link, limits=limits)
    peer_worker = Relay(network.link("other-worker", Role.WORKER), limits=limits)
    for relay in (server, scheduler, peer_worker):
        await relay.start()
    return Mesh(network, servicer, server, server_link, scheduler, scheduler_link, peer_worker)


async def make_gateway_mesh(pki: Pki) -> Mesh:
    """The same three relays, on real node links attached to one real gateway."""
    gateways = GatewayMesh(pki)
    (gateway,) = await gateways.full_mesh(1)
    tag = uuid.uuid4().hex[:8]
    server_link = await gateways.add_link("worker", f"relay-server-{tag}", [gateway.address])
    scheduler_link = await gateways.add_link("scheduler", f"relay-scheduler-{tag}", [gateway.address])
    peer_link = await gateways.add_link("worker", f"relay-peer-{tag}", [gateway.address])
    servicer = RecordingWorker()
    server = Relay(server_link, grace_s=0.0)
    server.serve([(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "hypha.v1.Worker")])
    scheduler, peer_worker = Relay(scheduler_link), Relay(peer_link)
    for relay in (server, scheduler, peer_worker):
        await relay.start()
    return Mesh(None, servicer, server, server_link, scheduler, scheduler_link, peer_worker, gateways)


@pytest.fixture
async def mesh(request: pytest.FixtureRequest, pki: Pki) -> AsyncIterator[Mesh]:
    """Over in-memory links; over a real gateway too for ``@contract`` tests."""
    m = await make_gateway_mesh(pki) if getattr(request, "param", "fake") == "gateway" else await make_mesh()
    yield m
    for relay in (m.server, m.scheduler, m.peer_worker):
        await relay.stop()
    if m.gateways is not None:
        await m.gateways.close()


#: Runs the test over the fake links and over a real gateway.
contract = pytest.mark.parametrize("mesh", ["fake", "gateway"], indirect=True)


async def status_of(awaitable: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await awaitable  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


# ---- results ---------------------------------------------------------------------


async def test_relayed_unary_call_returns_the_same_response_as_a_direct_call(
    pki: Pki, tmp_path: Path
) -> None:
    # Prepare: the same servicer behind a real mTLS server and behind the relay, called as the scheduler.
    scheduler_id = peer_id_of(load_cert_chain(pki.paths("scheduler").cert)[0])
    m = await make_mesh(scheduler_id=scheduler_id)
    direct_server = NodeServer(
        pki.tls("worker"),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, m.servicer, "hypha.v1.Worker")],
    )
    await direct_server.start()
    try:
        # The in-memory mesh names its peers ("worker-peer"), so the direct server cannot be its id.
        connector = PeerConnector(pki.tls("scheduler"), None, check_peer_id=False)
        direct = await connector.channel("worker-peer", [direct_server.address])
        # Execute
        via_direct = await worker_pb2_grpc.WorkerStub(direct).GetStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        )
        via_relay = await m.stub(m.scheduler).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
        await connector.close()
    finally:
        await direct_server.stop(0)
        for relay in (m.server, m.scheduler, m.peer_worker):
            await relay.stop()
    # Assert: the relayed caller is seen with the gateway-stamped identity, like the TLS one.
    assert via_relay == via_direct
    assert via_relay.peer_id == scheduler_id and via_relay.name == "scheduler"


@contract
async def test_relayed_caller_identity_is_the_gateway_stamped_sender(mesh: Mesh) -> None:
    lease = await mesh.stub(mesh.scheduler).RenewLease(worker_pb2.RenewLeaseRequest(lease_id="l1"), timeout=5)
    assert lease.lease_id == "l1"
    assert lease.worker_id == mesh.scheduler.peer_id


@pytest.mark.parametrize("queue_messages", [1, 8])
async def test_server_streaming_of_several_mib_arrives_complete_and_in_order(queue_messages: int) -> None:
    m = await make_mesh(RelayLimits(queue_messages=queue_messages))
    try:
        call = m.stub(m.peer_worker).PullTensors(
            worker_pb2.PullTensorsRequest(job_id="j", kind="blob"), timeout=10
        )
        chunks = [item.chunk async for item in call]
    finally:
        for relay in (m.server, m.scheduler, m.peer_worker):
            await relay.stop()
    assert [c.offset for c in chunks] == list(range(0, len(BLOB), MIB))
    assert all(len(c.data) <= MIB for c in chunks)
    assert b"".join(c.data for c in chunks) == BLOB
    assert await call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("queue_messages", [1, 8])
async def test_client_streaming_delivers_every_chunk_in_order(queue_messages: int) -> None:
    m = await make_mesh(RelayLimits(queue_messages=queue_messages))
    try:
        reply = await m.stub(m.peer_worker).PushTensors(push_chunks(), timeout=10)
    finally:
        for relay in (m.server, m.scheduler, m.peer_worker):
            await relay.stop()
    assert reply.accepted
    assert reply.message == f"{hashlib.sha256(BLOB).hexdigest()}:6"


@contract
async def test_client_streaming_accepts_writes_without_an_iterator(mesh: Mesh) -> None:
    call = mesh.stub(mesh.peer_worker).PushTensors(timeout=5)
    async for item in push_chunks():
        await call.write(item)
    await call.done_writing()
    reply = await call
    assert reply.message == f"{hashlib.sha256(BLOB).hexdigest()}:6"


async def test_calls_survive_repeated_and_reordered_frames(mesh: Mesh) -> None:
    # Prepare: every frame arrives twice, and each message frame arrives after the frame that follows it.
    held: dict[str, Message] = {}

    def tamper(message: Message) -> list[Message]:
        previous = held.pop(message.from_peer, None)
        if previous is None and gateway_pb2.RelayFrame.FromString(message.payload).HasField("message"):
            held[message.from_peer] = message
            return []
        return [message, message] + ([previous, previous] if previous is not None else [])

    mesh.network.tamper = tamper
    # Execute
    reply = await mesh.stub(mesh.peer_worker).PushTensors(push_chunks(), timeout=10)
    pulled = [
        item.chunk.data
        async for item in mesh.stub(mesh.peer_worker).PullTensors(
            worker_pb2.PullTensorsRequest(kind="blob"), timeout=10
        )
    ]
    # Assert
    assert reply.message == f"{hashlib.sha256(BLOB).hexdigest()}:6"
    assert b"".join(pulled) == BLOB


# ---- errors keep their status codes ------------------------------------------------


@contract
async def test_hypha_error_keeps_its_status_and_message(mesh: Mesh) -> None:
    code, details = await status_of(
        mesh.stub(mesh.scheduler).RenewLease(worker_pb2.RenewLeaseRequest(lease_id="missing"), timeout=5)
    )
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "no such lease: missing")


@contract
async def test_unexpected_exception_becomes_a_sanitized_internal(mesh: Mesh) -> None:
    code, details = await status_of(
        mesh.stub(mesh.scheduler).RenewLease(worker_pb2.RenewLeaseRequest(lease_id="boom"), timeout=5)
    )
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in details


@contract
async def test_context_abort_reaches_the_caller(mesh: Mesh) -> None:
    code, details = await status_of(
        mesh.stub(mesh.scheduler).RenewLease(worker_pb2.RenewLeaseRequest(lease_id="expired"), timeout=5)
    )
    assert (code, details) == (grpc.StatusCode.FAILED_PRECONDITION, "lease expired")


@contract
async def test_wrong_role_is_permission_denied_before_the_handler_runs(mesh: Mesh) -> None:
    # RenewLease and DispatchJob are for schedulers, never for a worker.
    code, _ = await status_of(
        mesh.stub(mesh.peer_worker).RenewLease(worker_pb2.RenewLeaseRequest(lease_id="l1"), timeout=5)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = await status_of(
        mesh.stub(mesh.peer_worker).DispatchJob(worker_pb2.DispatchJobRequest(job_id="j1"), timeout=5)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED


@contract
async def test_method_the_node_does_not_serve_is_unimplemented(mesh: Mesh) -> None:
    stub = data_pb2_grpc.DataNodeStub(mesh.scheduler.channel(mesh.server.peer_id))
    code, _ = await status_of(stub.ListDatasets(data_pb2.ListDatasetsRequest(), timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED


async def test_calls_beyond_the_concurrency_bound_are_resource_exhausted() -> None:
    m = await make_mesh(RelayLimits(max_concurrent_calls=2))
    stub = m.stub(m.scheduler)
    try:
        blocked = [
            stub.GetJobStatus(worker_pb2.GetJobStatusRequest(job_id=str(i)), timeout=5) for i in range(2)
        ]
        await eventually(lambda: m.server.server.active_calls == 2, timeout=5)
        code, _ = await status_of(stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5))
        for call in blocked:
            call.cancel()
        await eventually(lambda: m.server.server.active_calls == 0, timeout=5)
        reply = await stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
    finally:
        for relay in (m.server, m.scheduler, m.peer_worker):
            await relay.stop()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reply.peer_id == "scheduler-peer"


async def test_oversized_request_is_refused_with_resource_exhausted(mesh: Mesh) -> None:
    async def too_big() -> AsyncIterator[worker_pb2.TensorChunk]:
        yield chunk_at(0, b"x" * (2 * MIB))

    code, _ = await status_of(mesh.stub(mesh.peer_worker).PushTensors(too_big(), timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not any(frame.message for _, frame in mesh.network.links["other-worker"].sent)


@contract
async def test_oversized_response_is_refused_with_resource_exhausted(mesh: Mesh) -> None:
    call = mesh.stub(mesh.peer_worker).PullTensors(worker_pb2.PullTensorsRequest(kind="huge"), timeout=5)
    code, _ = await status_of(call.read())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


@contract
async def test_a_call_to_a_peer_not_attached_fails_at_once_with_unavailable(mesh: Mesh) -> None:
    # The gateway answers PEER_UNKNOWN (the fake does too): the call ends now, not at its deadline.
    stub = worker_pb2_grpc.WorkerStub(mesh.scheduler.channel("absent-peer"))
    code, details = await status_of(stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=60))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "PEER_UNKNOWN" in details


async def test_link_down_fails_the_call_with_unavailable(mesh: Mesh) -> None:
    mesh.scheduler_link.down = True
    code, _ = await status_of(
        mesh.stub(mesh.scheduler).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
    )
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_a_served_call_whose_caller_is_gone_stops_when_the_gateway_says_so(mesh: Mesh) -> None:
    # Prepare: a stream being served, blocked after its first chunk.
    call = mesh.stub(mesh.peer_worker).PullTensors(worker_pb2.PullTensorsRequest(kind="forever"), timeout=30)
    assert (await call.read()).chunk.offset == 0
    (served,) = mesh.server.server._calls.values()
    # Execute: the gateway reports a response frame of it undeliverable (the caller left).
    error = gateway_pb2.GatewayError(
        code=gateway_pb2.ERROR_CODE_PEER_UNKNOWN, message_id=frame_message_id(SERVER_SIDE, served.serve_id, 1)
    )
    assert mesh.server.gateway_error(error)
    # Assert: the handler is cancelled now, not at the call's deadline.
    await asyncio.wait_for(mesh.servicer.cancelled.wait(), 5)
    await eventually(lambda: mesh.server.server.active_calls == 0, timeout=5)
    call.cancel()


@contract
async def test_lost_link_fails_calls_in_flight_at_once(mesh: Mesh) -> None:
    call = mesh.stub(mesh.scheduler).GetJobStatus(worker_pb2.GetJobStatusRequest(job_id="j"))
    await asyncio.wait_for(mesh.servicer.started.wait(), 5)
    mesh.scheduler.link_lost()
    code, _ = await status_of(call)
    assert code == grpc.StatusCode.UNAVAILABLE


# ---- deadlines and cancellation ----------------------------------------------------


@contract
async def test_deadline_exceeded_reaches_the_caller_and_cancels_the_handler(mesh: Mesh) -> None:
    code, _ = await status_of(
        mesh.stub(mesh.scheduler).GetJobStatus(worker_pb2.GetJobStatusRequest(job_id="j"), timeout=0.3)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(mesh.servicer.cancelled.wait(), 5)
    assert mesh.servicer.time_remaining is not None and 0 < mesh.servicer.time_remaining <= 0.3
    await eventually(lambda: mesh.server.server.active_calls == 0, timeout=5)
    assert mesh.scheduler.client.active_calls == 0


@contract
async def test_cancelling_a_stream_cancels_the_handler(mesh: Mesh) -> None:
    call = mesh.stub(mesh.peer_worker).PullTensors(worker_pb2.PullTensorsRequest(kind="forever"), timeout=10)
    first = await call.read()
    assert first.chunk.offset == 0
    assert call.cancel()
    await asyncio.wait_for(mesh.servicer.cancelled.wait(), 5)
    assert call.cancelled()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    await eventually(lambda: mesh.server.server.active_calls == 0, timeout=5)


async def test_cancelling_the_awaiting_task_cancels_the_handler(mesh: Mesh) -> None:
    stub = mesh.stub(mesh.scheduler)

    async def ask() -> worker_pb2.WorkerJobStatus:
        return await stub.GetJobStatus(worker_pb2.GetJobStatusRequest(job_id="j"), timeout=10)

    task = asyncio.create_task(ask())
    await asyncio.wait_for(mesh.servicer.started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(mesh.servicer.cancelled.wait(), 5)
    assert any(frame.cancel for _, frame in mesh.scheduler_link.sent)


@contract
async def test_stopping_the_serving_relay_ends_its_calls_with_unavailable(mesh: Mesh) -> None:
    call = mesh.stub(mesh.scheduler).GetJobStatus(worker_pb2.GetJobStatusRequest(job_id="j"), timeout=10)
    await asyncio.wait_for(mesh.servicer.started.wait(), 5)
    await mesh.server.stop(grace_s=0)
    code, _ = await status_of(call)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert mesh.servicer.cancelled.is_set()


@contract
async def test_calls_through_a_stopped_relay_fail_with_unavailable(mesh: Mesh) -> None:
    await mesh.scheduler.stop()
    code, _ = await status_of(
        mesh.stub(mesh.scheduler).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
    )
    assert code == grpc.StatusCode.UNAVAILABLE


# ---- what does not belong to a call -------------------------------------------------


async def test_frames_for_unknown_calls_are_ignored(mesh: Mesh) -> None:
    # Prepare: frames from the scheduler for calls nobody opened, plus junk.
    stray = [
        gateway_pb2.RelayFrame(call_id=uuid.uuid4().hex, seq=1, message=b"\x08\x01"),
        gateway_pb2.RelayFrame(call_id=uuid.uuid4().hex, seq=0, half_close=True),
        gateway_pb2.RelayFrame(call_id=uuid.uuid4().hex, seq=0, cancel=True),
        gateway_pb2.RelayFrame(
            call_id=uuid.uuid4().hex, seq=0, status=gateway_pb2.RelayStatus(code=grpc.StatusCode.OK.value[0])
        ),
    ]
    # Execute
    for frame in stray:
        await mesh.scheduler_link.send("worker-peer", frame.SerializeToString(), RELAY_CHANNEL)
    await mesh.scheduler_link.send("worker-peer", b"\xff\xfe not a frame", RELAY_CHANNEL)
    # Assert: all dropped, nothing answered, and the node still serves.
    await eventually(lambda: mesh.server.ignored_frames == len(stray) + 1, timeout=5)
    assert mesh.server_link.sent == []
    reply = await mesh.stub(mesh.scheduler).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
    assert reply.peer_id == "scheduler-peer"


async def test_responses_from_another_peer_do_not_reach_a_call(mesh: Mesh) -> None:
    # The other worker forges a status for the scheduler's call to the serving worker.
    call = mesh.stub(mesh.scheduler).GetJobStatus(worker_pb2.GetJobStatusRequest(job_id="j"), timeout=10)
    await asyncio.wait_for(mesh.servicer.started.wait(), 5)
    call_id = next(frame.call_id for _, frame in mesh.scheduler_link.sent if frame.open)
    forged = gateway_pb2.RelayFrame(
        call_id=call_id, seq=0, status=gateway_pb2.RelayStatus(code=grpc.StatusCode.OK.value[0])
    )
    await mesh.network.links["other-worker"].send("scheduler-peer", forged.SerializeToString(), RELAY_CHANNEL)
    await eventually(lambda: mesh.scheduler.ignored_frames == 1, timeout=5)
    assert not call.done()
    call.cancel()


@contract
async def test_relay_channel_stands_in_for_a_grpc_channel(mesh: Mesh) -> None:
    target = mesh.server.peer_id
    channel = mesh.scheduler.channel(target)
    assert mesh.scheduler.channel(target) is channel
    await channel.channel_ready()
    assert channel.get_state() == grpc.ChannelConnectivity.READY
    async with channel:
        pass
    with pytest.raises(grpc.aio.UsageError):
        worker_pb2_grpc.WorkerStub(channel).GetStatus(worker_pb2.GetWorkerStatusRequest())
    assert mesh.scheduler.channel(target) is not channel


# ---- ordering ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_sequencer_delivers_each_frame_once_in_order(data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 30))
    arrivals = data.draw(st.permutations(list(range(count))))
    repeats = data.draw(st.lists(st.integers(0, count - 1), max_size=10))
    sequencer = Sequencer(window=64)
    delivered: list[int] = []
    for seq in [*arrivals, *repeats]:
        delivered += [f.seq for f in sequencer.accept(gateway_pb2.RelayFrame(call_id="c", seq=seq))]
    assert delivered == list(range(count))


def test_sequencer_reports_a_gap_wider_than_its_window() -> None:
    sequencer = Sequencer(window=4)
    with pytest.raises(FramesLostError):
        sequencer.accept(gateway_pb2.RelayFrame(call_id="c", seq=10))


# ---- the connector --------------------------------------------------------------------


@pytest.fixture
async def direct_server(pki: Pki) -> AsyncIterator[NodeServer]:
    server = NodeServer(
        pki.tls("worker"),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, RecordingWorker(), "hypha.v1.Worker")],
    )
    await server.start()
    yield server
    await server.stop(0)


async def test_connector_prefers_a_reachable_direct_address(
    pki: Pki, mesh: Mesh, direct_server: NodeServer
) -> None:
    connector = PeerConnector(
        pki.tls("scheduler"), mesh.scheduler, connect_timeout_s=2.0, check_peer_id=False
    )
    channel = await connector.channel("worker-peer", ["127.0.0.1:1", direct_server.address])
    assert not isinstance(channel, RelayChannel)
    assert connector.is_direct("worker-peer")
    assert await connector.channel("worker-peer", [direct_server.address]) is channel
    await connector.close()


async def test_connector_falls_back_to_the_relay_when_no_address_answers(pki: Pki, mesh: Mesh) -> None:
    connector = PeerConnector(pki.tls("scheduler"), mesh.scheduler, connect_timeout_s=0.5)
    channel = await connector.channel("worker-peer", ["127.0.0.1:1"])
    assert isinstance(channel, RelayChannel)
    reply = await worker_pb2_grpc.WorkerStub(channel).GetStatus(
        worker_pb2.GetWorkerStatusRequest(), timeout=5
    )
    assert reply.peer_id == "scheduler-peer"
    await connector.close()


async def test_connector_without_relay_reports_an_unreachable_peer(pki: Pki) -> None:
    connector = PeerConnector(pki.tls("scheduler"), None, connect_timeout_s=0.5)
    with pytest.raises(UnavailableError):
        await connector.channel("worker-peer", ["127.0.0.1:1"])


async def test_connector_redecides_after_the_direct_peer_goes_away(pki: Pki, mesh: Mesh) -> None:
    server = NodeServer(
        pki.tls("worker"),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, RecordingWorker(), "hypha.v1.Worker")],
    )
    await server.start()
    connector = PeerConnector(
        pki.tls("scheduler"), mesh.scheduler, connect_timeout_s=0.5, check_peer_id=False
    )
    direct = await connector.channel("worker-peer", [server.address])
    await server.stop(0)
    code, _ = await status_of(
        worker_pb2_grpc.WorkerStub(direct).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=2)
    )
    assert code == grpc.StatusCode.UNAVAILABLE
    channel = await connector.channel("worker-peer", [server.address])
    assert isinstance(channel, RelayChannel)
    await connector.close()


async def test_a_relayed_peer_is_reached_directly_again_soon_after_it_is_back(pki: Pki, mesh: Mesh) -> None:
    # Prepare: the peer's address is down (a partition), so it is reached through the relay.
    worker = [(worker_pb2_grpc.add_WorkerServicer_to_server, RecordingWorker(), "hypha.v1.Worker")]
    first = NodeServer(pki.tls("worker"), "127.0.0.1:0", worker)
    await first.start()
    address = first.address
    await first.stop(0)
    connector = PeerConnector(
        pki.tls("scheduler"), mesh.scheduler, connect_timeout_s=0.5, relay_probe_s=0.2, check_peer_id=False
    )
    assert isinstance(await connector.channel("worker-peer", [address]), RelayChannel)
    # Execute: the peer is back at its address; callers keep asking for its channel.
    back = NodeServer(pki.tls("worker"), address, worker)
    await back.start()
    try:

        async def path() -> bool:
            # A lookup never waits for a dial: the relay stands until the probe found the peer.
            async with asyncio.timeout(0.1):
                return not isinstance(await connector.channel("worker-peer", [address]), RelayChannel)

        # Assert: the direct path is taken again within the probe's first tries.
        await eventually(path, timeout=5, message="the direct path again")
        assert connector.is_direct("worker-peer")
        reply = await worker_pb2_grpc.WorkerStub(await connector.channel("worker-peer", [address])).GetStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        )
        # The caller is seen by its certificate, not by the relay's stamp: the call went direct.
        assert reply.peer_id == peer_id_of(load_cert_chain(pki.paths("scheduler").cert)[0])
    finally:
        await connector.close()
        await back.stop(0)


async def test_a_relay_choice_made_without_addresses_is_probed_once_a_caller_names_one(
    pki: Pki, mesh: Mesh, direct_server: NodeServer
) -> None:
    connector = PeerConnector(
        pki.tls("scheduler"), mesh.scheduler, connect_timeout_s=0.5, relay_probe_s=0.2, check_peer_id=False
    )
    assert isinstance(await connector.channel("worker-peer", []), RelayChannel)
    assert isinstance(await connector.channel("worker-peer", [direct_server.address]), RelayChannel)

    async def direct() -> bool:
        return not isinstance(await connector.channel("worker-peer", [direct_server.address]), RelayChannel)

    await eventually(direct, timeout=5, message="the named address probed and taken")
    await connector.close()


# ---- bounds --------------------------------------------------------------------


async def test_one_caller_cannot_take_every_relay_slot() -> None:
    # Prepare: eight slots in all, two per caller; a worker holds two streams open.
    m = await make_mesh(RelayLimits(max_concurrent_calls=8, max_calls_per_peer=2))
    worker_stub, scheduler_stub = m.stub(m.peer_worker), m.stub(m.scheduler)
    try:
        held = [
            worker_stub.PullTensors(worker_pb2.PullTensorsRequest(kind="forever"), timeout=10)
            for _ in range(2)
        ]
        for call in held:
            await call.read()
        # Execute: a third call of the same worker, and one of another peer.
        third = worker_stub.PullTensors(worker_pb2.PullTensorsRequest(kind="forever"), timeout=10)
        code, details = await status_of(third.read())
        reply = await scheduler_stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
        for call in held:
            call.cancel()
    finally:
        for relay in (m.server, m.scheduler, m.peer_worker):
            await relay.stop()
    # Assert
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "net.relay_max_calls_per_peer" in details
    assert reply.peer_id == "scheduler-peer"
    assert m.server.server.refusals == {"peer_busy": 1}


@pytest.mark.parametrize("timeout", [None, 60.0])
async def test_a_relayed_call_never_runs_past_the_servers_cap(timeout: float | None) -> None:
    # Prepare: the serving node caps relayed calls at 0.3 s; the caller sets no deadline, or a longer one.
    m = await make_mesh(RelayLimits(max_call_s=0.3))
    try:
        # Execute
        async with asyncio.timeout(5):
            code, _ = await status_of(
                m.stub(m.scheduler).GetJobStatus(worker_pb2.GetJobStatusRequest(job_id="j"), timeout=timeout)
            )
        await asyncio.wait_for(m.servicer.cancelled.wait(), 5)
    finally:
        for relay in (m.server, m.scheduler, m.peer_worker):
            await relay.stop()
    # Assert: the server's deadline ended it, and the handler saw that deadline.
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert m.servicer.time_remaining is not None and 0 < m.servicer.time_remaining <= 0.3
