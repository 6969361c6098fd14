"""Following a job's events across scheduler restarts.

A scheduler that is killed or upgraded resumes its jobs when it comes back
(``docs/fault-tolerance.md``), but the ``WatchJob`` stream a client holds ends
with ``UNAVAILABLE`` meanwhile. ``hypha watch`` and ``hypha demo`` should
outlive that the way the job does: re-open the stream with jittered backoff
for up to ``patience_s`` without an answer, and go on. The first event of a
re-opened stream is the job as it is now, so what a view shows stays right;
the events in between (a round's metrics) are not replayed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc

from hypha.net.backoff import Backoff
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

#: Final job states: the stream ends after one of these.
TERMINAL = frozenset(
    {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}
)
#: How long a watch waits for a scheduler that went away before it gives up.
RECONNECT_PATIENCE_S = 120.0


async def follow_job(
    stub: scheduler_pb2_grpc.SchedulerStub,
    job_id: str,
    *,
    patience_s: float = RECONNECT_PATIENCE_S,
    on_lost: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[scheduler_pb2.JobEvent]:
    """The job's events until it reaches a final state, re-opening the stream when the scheduler is
    unreachable; ``on_lost`` hears why, once per outage. Any other error (unknown job, not allowed)
    is raised."""
    pause = Backoff(0.2, 5.0)
    lost_since: float | None = None
    while True:
        try:
            async for event in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id)):
                lost_since = None
                pause.reset()
                yield event
                if event.job.state in TERMINAL:
                    return
            return
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.UNAVAILABLE:
                raise
            now = clock()
            if lost_since is None:  # said once per outage, not at every try
                lost_since = now
                if on_lost is not None:
                    on_lost(f"scheduler unreachable ({err.details() or err.code().name}); reconnecting")
            if now - lost_since >= patience_s:
                raise
            await asyncio.sleep(min(pause.next_delay(), lost_since + patience_s - now))


__all__ = ["RECONNECT_PATIENCE_S", "TERMINAL", "follow_job"]
