"""Progress reports that travel while the next batch trains.

A trainer reports after every batch and the scheduler answers with a
directive. Waiting for that answer before the next batch put a bridge round
trip (and, behind it, the scheduler's gRPC round trip) on every step: 1-5 ms
of a 20-100 ms step on a small machine (docs/performance.md). So the report
goes out as the next batch starts and its answer is read after that batch.

What that changes, and why it is safe:
- ``sync_after K`` counts from the batch that was reported, so the trainer
  subtracts the batches it ran since then (``Answer.countdown``): the sync
  lands on the same batch as before, however late the answer came, as long
  as it came before that batch.
- ``sync_now`` and ``done`` take effect one batch later than they would have.
  The scheduler knows: the report says ``next_batch_started`` and its planner
  counts that batch as in flight (``hypha.scheduler.rounds``), so a planned
  round ends where it was planned; only an unplanned ``sync_now`` (the others
  already synced) costs one batch.
- One report is in flight at a time; while it is unanswered the next batch's
  report is skipped, and the one after carries the newer cumulative figures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hypha.directives import DirectiveKind


@dataclass(frozen=True)
class Answer:
    """The scheduler's directive for a report sent after ``reported`` batches of the round."""

    kind: DirectiveKind
    batches: int
    reported: int

    def countdown(self, done: int) -> int | None:
        """Batches left before the sync once ``done`` batches ran; None when no sync is asked for."""
        if self.kind is DirectiveKind.SYNC_NOW:
            return 0
        if self.kind is DirectiveKind.SYNC_AFTER:
            return max(0, self.batches - (done - self.reported))
        return None


#: One report's call: the directive's kind and batch count.
Report = Callable[[], Awaitable[tuple[DirectiveKind, int]]]


class ReportPipe:
    """At most one progress report in flight; its answer is picked up between batches."""

    def __init__(self) -> None:
        self._inflight: asyncio.Task[Answer] | None = None

    @staticmethod
    async def _one(report: Report, batches: int) -> Answer:
        kind, more = await report()
        return Answer(kind, more, batches)

    def send(self, batches: int, report: Report) -> bool:
        """Start ``report`` (sent after ``batches`` batches) unless one is unanswered; whether it started."""
        if self._inflight is not None:
            return False
        self._inflight = asyncio.create_task(self._one(report, batches), name="progress-report")
        return True

    def answer(self) -> Answer | None:
        """The answer to the report in flight if it has come (its failure is raised here)."""
        task = self._inflight
        if task is None or not task.done():
            return None
        self._inflight = None
        return task.result()

    async def settle(self) -> Answer | None:
        """Wait for the report in flight, if any: before a sync or the end, nothing is left running."""
        task, self._inflight = self._inflight, None
        return None if task is None else await task

    def cancel(self) -> None:
        if self._inflight is not None:
            self._inflight.cancel()
            self._inflight = None
