"""A trainer's reports: progress as it trains, sent while the next batch trains; each round's metrics.

A trainer reports its progress and the scheduler answers with a directive.
Waiting for that answer before the next batch put a bridge round trip (and,
behind it, the scheduler's gRPC round trip) on every step: 1-5 ms of a
20-100 ms step on a small machine (docs/performance.md). So the report goes
out as the next batch starts and its answer is read after that batch.

Reports are spaced too: the round's first batch is reported, then a batch
at most every ``report_interval_s`` (``DEFAULT_REPORT_INTERVAL_S``), and the
round's last one. A report per batch cost a 20 ms step 1.5-2 ms even off the
critical path (the bridge call's work shares the trainer's GIL and the
machine's cores with the step), and a scheduler serving many fast workers one
call per batch each. The scheduler's planner counts the batches a worker runs
between two of its reports (``hypha.scheduler.diloco.round_planner``), so a plan still
reaches every worker before its sync point.

What that changes, and why it is safe:
- ``sync_after K`` counts from the batch that was reported, so the trainer
  subtracts the batches it ran since then (``Answer.countdown``): the sync
  lands on the same batch as before, however late the answer came, as long
  as it came before that batch.
- ``sync_now`` and ``done`` take effect one batch, or one report interval,
  later than they would have. The scheduler knows: the report says
  ``next_batch_started`` and its planner counts that batch as in flight
  (``hypha.scheduler.diloco.round_planner``), so a planned round ends where it was planned;
  only an unplanned ``sync_now`` (the others already synced) costs the wait.
- One report is in flight at a time; while it is unanswered the next batch's
  report is skipped, and the one after carries the newer cumulative figures.

An unreachable scheduler is not fatal: a progress report counts as
``continue``, and a round's metrics are best effort.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from hypha.directives import DirectiveKind
from hypha.errors import UnavailableError
from hypha.worker.executors.bridge_api import Bridge, raise_if_bridge_gone

logger = logging.getLogger(__name__)

#: Least seconds between two progress reports of a round (``TrainerOptions.report_interval_s``).
DEFAULT_REPORT_INTERVAL_S = 0.25


@dataclass
class RoundStats:
    """What this worker did in the current round (reset at each sync)."""

    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    train_seconds: float = 0.0
    last_batch_seconds: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.batches if self.batches else math.nan


async def report_progress(
    bridge: Bridge, round_number: int, stats: RoundStats, batch_size: int, *, ahead: bool = False
) -> tuple[DirectiveKind, int]:
    """Report the round's progress; the scheduler's directive and its batch count.

    ``ahead``: the next batch starts as this report leaves (the pipe below).
    An unreachable scheduler is not fatal: training continues and the next
    report asks again.
    """
    try:
        directive = await bridge.progress(
            round=round_number,
            batches=stats.batches,
            samples=stats.samples,
            loss=finite(stats.mean_loss),
            batch_seconds=stats.last_batch_seconds,
            batch_size=batch_size,
            next_batch_started=ahead,
        )
    except UnavailableError as exc:
        raise_if_bridge_gone(exc)
        logger.warning("progress report failed: %s; continuing", exc.message)
        return DirectiveKind.CONTINUE, 0
    return DirectiveKind.parse(directive.kind), max(0, int(directive.batches))


async def report_metrics(
    bridge: Bridge,
    round_number: int,
    stats: RoundStats,
    idle_s: float,
    delta_bytes: int,
    *,
    extra: Mapping[str, float] | None = None,
) -> None:
    """Send a round's metrics, with the time training stood still at its sync, its Δ's size and
    ``extra`` figures."""
    values = {
        "loss": finite(stats.mean_loss),
        "batches": float(stats.batches),
        "samples": float(stats.samples),
        "samples_per_second": stats.samples / stats.train_seconds if stats.train_seconds else 0.0,
        "sync_idle_seconds": idle_s,
        "delta_bytes": float(delta_bytes),
        **(extra or {}),
    }
    try:
        await bridge.metrics(round_number, values)
    except UnavailableError as exc:  # figures are best effort; training goes on
        raise_if_bridge_gone(exc)
        logger.warning("metrics of round %d not delivered: %s", round_number, exc.message)


def finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


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
    """At most one progress report in flight; its answer is picked up between batches.

    Within a round, a report leaves at most every ``interval_s`` (module docstring); the
    round's first batch is always reported, so the scheduler learns when the round began and
    how fast this worker is as soon as it can.
    """

    def __init__(self, interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._sent_at = -math.inf
        self._inflight: asyncio.Task[Answer] | None = None

    @staticmethod
    async def _one(report: Report, batches: int) -> Answer:
        kind, more = await report()
        return Answer(kind, more, batches)

    def send(self, batches: int, report: Report) -> bool:
        """Start ``report`` (sent after ``batches`` batches of the round) unless one is unanswered
        or, past the round's first batch, the last one left less than ``interval_s`` ago;
        whether it started."""
        if self._inflight is not None:
            return False
        now = self._clock()
        if batches > 1 and now - self._sent_at < self.interval_s:
            return False
        self._sent_at = now
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
