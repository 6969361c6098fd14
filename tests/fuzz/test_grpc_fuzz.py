"""Every RPC of every service gets random messages and garbage bytes over real mTLS.

Pass: each call ends within its deadline with a status from ``ALLOWED``
(never UNKNOWN or INTERNAL, which is what an unhandled exception becomes),
and the server answers an ordinary call afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypha.pki.identity import Role
from hypha.v1 import (
    data_pb2,
    data_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.fuzz.cluster import FuzzCluster
from tests.fuzz.protos import Rpc, every_rpc, garbage, messages

C = grpc.StatusCode
#: Statuses a fuzzed call may end with: a refusal with a reason, or success.
ALLOWED = {
    C.OK,
    C.INVALID_ARGUMENT,
    C.NOT_FOUND,
    C.ALREADY_EXISTS,
    C.FAILED_PRECONDITION,
    C.OUT_OF_RANGE,
    C.PERMISSION_DENIED,
    C.UNAUTHENTICATED,
    C.RESOURCE_EXHAUSTED,
    C.UNAVAILABLE,
    # A method the descriptor lists and the servicer does not offer (grpc's Health.List).
    C.UNIMPLEMENTED,
}
#: Streams may legitimately stay open (a watch on a live job): our deadline or cancel ends them.
ALLOWED_STREAMING = ALLOWED | {C.DEADLINE_EXCEEDED, C.CANCELLED}
#: Replies read from a server stream before it is cancelled.
MAX_REPLIES = 1
#: A stream may legitimately wait (its deadline ends it); a unary call must answer, even on a busy CI box.
STREAM_DEADLINE_S = 3.0
UNARY_DEADLINE_S = 15.0
RPCS = every_rpc()
FUZZ = settings(
    max_examples=int(os.environ.get("HYPHA_FUZZ_EXAMPLES", "15")),
    deadline=None,
    derandomize=os.environ.get("HYPHA_FUZZ_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _identity(data: bytes) -> bytes:
    return data


def call_raw(cluster: FuzzCluster, rpc: Rpc, bodies: list[bytes], role: Role | None = None) -> C:
    """Send ``bodies`` (encoded requests) to ``rpc``; the final status."""
    channel = cluster.channel(rpc.service, role or rpc.caller)
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(rpc.streams_in, rpc.streams_out)]
    stub: Callable[..., Any] = kind(rpc.path, request_serializer=_identity, response_deserializer=_identity)
    request: Any = iter(bodies) if rpc.streams_in else (bodies[0] if bodies else b"")
    try:
        if rpc.streams_out:
            replies: Any = stub(request, timeout=STREAM_DEADLINE_S)
            for count, _ in enumerate(replies, 1):
                if count >= MAX_REPLIES:
                    replies.cancel()
                    return C.CANCELLED
            return C.OK
        stub(request, timeout=UNARY_DEADLINE_S)
        return C.OK
    except grpc.RpcError as err:
        code: C = err.code()
        assert code in (ALLOWED_STREAMING if rpc.streams_out else ALLOWED), f"{rpc}: {code} {err.details()}"
        return code


def assert_still_serving(cluster: FuzzCluster, rpc: Rpc) -> None:
    """The server of ``rpc`` answers health and one ordinary call of its own service."""
    channel = cluster.channel(rpc.service, rpc.caller)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    admin = cluster.channel(rpc.service, Role.ADMIN)
    ordinary: dict[str, Callable[[], object]] = {
        "hypha.v1.Gateway": lambda: gateway_pb2_grpc.GatewayStub(admin).ListPeers(
            gateway_pb2.ListPeersRequest(), timeout=5
        ),
        "hypha.v1.Scheduler": lambda: scheduler_pb2_grpc.SchedulerStub(admin).ListJobs(
            scheduler_pb2.ListJobsRequest(), timeout=5
        ),
        "hypha.v1.SchedulerControl": lambda: scheduler_pb2_grpc.SchedulerStub(admin).ListJobs(
            scheduler_pb2.ListJobsRequest(), timeout=5
        ),
        "hypha.v1.Worker": lambda: worker_pb2_grpc.WorkerStub(admin).GetStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        ),
        "hypha.v1.DataNode": lambda: data_pb2_grpc.DataNodeStub(admin).ListDatasets(
            data_pb2.ListDatasetsRequest(), timeout=5
        ),
    }
    if rpc.service in ordinary:  # the standard services: the health check above is theirs
        ordinary[rpc.service]()


@pytest.fixture
def fuzzed(cluster: FuzzCluster, request: pytest.FixtureRequest) -> Iterator[Rpc]:
    rpc: Rpc = request.param
    yield rpc
    assert_still_serving(cluster, rpc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fuzzed", RPCS, ids=str, indirect=True)
def test_random_messages_get_a_meaningful_status(cluster: FuzzCluster, fuzzed: Rpc) -> None:
    rpc = fuzzed
    strategy = st.lists(messages(rpc.method.input_type), min_size=1, max_size=3 if rpc.streams_in else 1)

    @FUZZ
    @given(strategy)
    def one(requests: list[Any]) -> None:
        call_raw(cluster, rpc, [m.SerializeToString() for m in requests])

    one()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fuzzed", RPCS, ids=str, indirect=True)
def test_garbage_bytes_get_a_meaningful_status(cluster: FuzzCluster, fuzzed: Rpc) -> None:
    rpc = fuzzed

    @FUZZ
    @given(st.lists(garbage, min_size=1, max_size=3 if rpc.streams_in else 1))
    def one(bodies: list[bytes]) -> None:
        call_raw(cluster, rpc, bodies)

    one()


def _refused_somewhere(rpc: Rpc) -> bool:
    from hypha.net.policy import allowed_roles

    return any(r not in allowed_roles(rpc.path) for r in Role)


#: Methods some role may not call (health and reflection are open to every role).
GUARDED = [rpc for rpc in RPCS if _refused_somewhere(rpc)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fuzzed", GUARDED, ids=str, indirect=True)
def test_a_role_the_policy_refuses_gets_permission_denied_whatever_it_sends(
    cluster: FuzzCluster, fuzzed: Rpc
) -> None:
    from hypha.net.policy import allowed_roles

    refused = [r for r in Role if r not in allowed_roles(fuzzed.path)]
    assert refused
    for role in refused:
        for body in (b"", b"\xff\xff\xff"):
            assert call_raw(cluster, fuzzed, [body], role) == C.PERMISSION_DENIED, (fuzzed, role, body)
