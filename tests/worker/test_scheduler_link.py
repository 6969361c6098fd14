"""The worker's job-control calls to its scheduler, and the log forwarder's bounds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from hypha.errors import UnavailableError
from hypha.net.connector import PeerConnector
from hypha.net.server import NodeServer
from hypha.v1 import scheduler_pb2, scheduler_pb2_grpc
from hypha.worker.scheduler_link import GrpcSchedulerLink, LogForwarder
from tests.conftest import Pki
from tests.helpers import eventually
from tests.worker.fakes import FakeSchedulerLink


class FakeControl(scheduler_pb2_grpc.SchedulerControlServicer):
    def __init__(self) -> None:
        self.lines: list[scheduler_pb2.LogLine] = []
        self.statuses: list[scheduler_pb2.JobStatusReport] = []

    async def ReportProgress(
        self, request: scheduler_pb2.ProgressReport, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Directive:
        return scheduler_pb2.Directive(
            kind=scheduler_pb2.DIRECTIVE_KIND_SYNC_AFTER, batches=request.batches + 1, round=request.round
        )

    async def AppendLogs(
        self, request_iterator: AsyncIterator[scheduler_pb2.LogLine], context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LogsAck:
        count = 0
        async for line in request_iterator:
            self.lines.append(line)
            count += 1
        return scheduler_pb2.LogsAck(lines=count)

    async def ReportJobStatus(
        self, request: scheduler_pb2.JobStatusReport, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.JobStatusAck:
        self.statuses.append(request)
        return scheduler_pb2.JobStatusAck()


async def test_grpc_link_reaches_the_dispatching_scheduler(pki: Pki) -> None:
    # Prepare: a real scheduler-role server; the worker calls it with its own certificate
    control = FakeControl()
    scheduler_tls = pki.tls("scheduler")
    server = NodeServer(
        scheduler_tls,
        "127.0.0.1:0",
        [(scheduler_pb2_grpc.add_SchedulerControlServicer_to_server, control, "hypha.v1.SchedulerControl")],
    )
    await server.start()
    connector = PeerConnector(pki.tls("worker"), None)
    link = GrpcSchedulerLink(connector, scheduler_tls.identity.peer_id, [server.address])
    forwarder = LogForwarder(link, "job-1", worker_id="w1", attempt=2)
    try:
        # Execute
        directive = await link.progress(scheduler_pb2.ProgressReport(job_id="job-1", round=4, batches=9))
        forwarder.start()
        for i in range(50):
            forwarder.line("stdout", f"line {i}")
        await forwarder.close()
        await link.status(
            scheduler_pb2.JobStatusReport(
                job_id="job-1", state=scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED
            )
        )
    finally:
        await connector.close()
        await server.stop(0)

    # Assert
    assert (directive.kind, directive.batches, directive.round) == (
        scheduler_pb2.DIRECTIVE_KIND_SYNC_AFTER,
        10,
        4,
    )
    assert [line.line for line in control.lines] == [f"line {i}" for i in range(50)]
    assert {(line.job_id, line.worker_id, line.attempt) for line in control.lines} == {("job-1", "w1", 2)}
    assert control.statuses[0].state == scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED


class FlakyLink(FakeSchedulerLink):
    """Refuses log batches until told to accept them."""

    def __init__(self) -> None:
        super().__init__()
        self.accepting = False
        self.refused = 0

    async def logs(self, lines: Sequence[scheduler_pb2.LogLine]) -> None:
        if not self.accepting:
            self.refused += 1
            raise UnavailableError("scheduler away")
        await super().logs(lines)


async def test_log_forwarder_keeps_a_bounded_backlog_and_says_what_it_dropped() -> None:
    link = FlakyLink()
    forwarder = LogForwarder(link, "job-1", max_pending=10, batch_max=4)
    forwarder.start()
    for i in range(25):
        forwarder.line("stdout", f"line {i}")
    await eventually(lambda: link.refused >= 1, timeout=5)

    link.accepting = True
    forwarder.line("stdout", "after")
    await forwarder.close(timeout_s=10)

    delivered = link.lines()
    assert delivered[-1] == "after"
    assert any("dropped" in line for line in link.lines("system"))
    assert len(link.lines("stdout")) <= 10
    assert link.lines("stdout")[-2] == "line 24"  # the newest lines survive, the oldest go
