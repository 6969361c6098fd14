"""Workers appear by the name on their certificate wherever a person reads them, a late one too."""

from __future__ import annotations

import io

import grpc
import pytest
from rich.console import Console

from hypha.client.output import event_view
from hypha.client.worker_names import WorkerNames
from hypha.v1 import common_pb2, scheduler_pb2

pytestmark = pytest.mark.timeout(30)

PEER_A, PEER_B, PEER_C = "a" * 32, "b" * 32, "c" * 32


class _Stub:
    """The scheduler's ``ListWorkers``, answering the workers it knows at the time of each call."""

    def __init__(self) -> None:
        self.named: dict[str, str] = {PEER_A: "worker-1"}
        self.calls = 0
        self.fail = False

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, timeout: float
    ) -> scheduler_pb2.ListWorkersResponse:
        self.calls += 1
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
        return scheduler_pb2.ListWorkersResponse(
            workers=[
                scheduler_pb2.WorkerView(peer=common_pb2.PeerInfo(peer_id=peer, name=name))
                for peer, name in self.named.items()
            ]
        )


async def test_a_worker_that_appears_later_is_shown_by_its_name_too() -> None:
    stub = _Stub()
    names = WorkerNames(stub)  # type: ignore[arg-type]

    assert await names.learn([]) == {PEER_A: "worker-1"}
    await names.learn([PEER_A])
    assert stub.calls == 1  # a known worker costs no call

    stub.named[PEER_B] = "worker-3"  # its first offer came after the job started
    assert (await names.learn([PEER_A, PEER_B]))[PEER_B] == "worker-3"
    assert stub.calls == 2


async def test_an_unnamed_worker_is_asked_about_once_and_a_failed_call_keeps_the_names() -> None:
    stub = _Stub()
    names = WorkerNames(stub, {PEER_A: "worker0"})  # type: ignore[arg-type]
    await names.learn([PEER_C])
    await names.learn([PEER_C])
    assert stub.calls == 1 and PEER_C not in names.known
    assert names.known[PEER_A] == "worker0"  # the caller's names (certificates) stand

    stub.fail = True
    assert await names.learn([PEER_B]) == {PEER_A: "worker0"}


def test_hypha_watch_shows_workers_by_name() -> None:
    job = scheduler_pb2.Job(job_id="j1", round=2, rounds=4, loss=2.6, state=common_pb2.JOB_STATE_RUNNING)
    job.spec.diloco.dataset = "d"
    event = scheduler_pb2.JobEvent(
        job=job, workers=[common_pb2.WorkerMetrics(worker_id=PEER_A, samples_per_second=30.0)]
    )
    out = io.StringIO()
    Console(file=out, width=120).print(event_view(event, {PEER_A: "worker-1"}))

    assert "worker-1" in out.getvalue() and PEER_A[:8] not in out.getvalue()
