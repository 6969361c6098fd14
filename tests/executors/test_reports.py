"""Progress reports that travel while the next batch trains (``executors/reports.py``), directly."""

from __future__ import annotations

import asyncio

import pytest

from hypha.directives import DirectiveKind
from hypha.errors import PermissionDeniedError
from hypha.worker.executors.reports import Answer, ReportPipe

K = DirectiveKind


@pytest.mark.parametrize(
    ("answer", "done", "left"),
    [
        (Answer(K.SYNC_AFTER, 4, reported=1), 1, 4),  # read at once: the count as given
        (Answer(K.SYNC_AFTER, 4, reported=1), 3, 2),  # read two batches later: two fewer
        (Answer(K.SYNC_AFTER, 1, reported=1), 3, 0),  # read after its sync point: sync now
        (Answer(K.SYNC_NOW, 0, reported=5), 6, 0),
        (Answer(K.CONTINUE, 0, reported=5), 6, None),
        (Answer(K.DONE, 0, reported=5), 6, None),  # the trainer stops on DONE itself
    ],
)
def test_a_sync_after_count_runs_from_the_reported_batch(answer: Answer, done: int, left: int | None) -> None:
    assert answer.countdown(done) == left


async def test_one_report_in_flight_and_its_answer_or_failure_comes_between_batches() -> None:
    pipe = ReportPipe()
    release = asyncio.Event()
    sent: list[int] = []

    async def report(batches: int) -> tuple[DirectiveKind, int]:
        sent.append(batches)
        await release.wait()
        return K.SYNC_AFTER, 3

    assert pipe.send(1, lambda: report(1))
    assert not pipe.send(2, lambda: report(2))  # still out: this one is skipped
    assert pipe.answer() is None  # not answered yet
    release.set()
    assert await pipe.settle() == Answer(K.SYNC_AFTER, 3, reported=1)
    assert sent == [1]

    refusing = asyncio.Event()

    async def refused() -> tuple[DirectiveKind, int]:
        refusing.set()  # the report's task ends in this same step, before the test resumes
        raise PermissionDeniedError("not your job")

    assert pipe.send(4, refused)
    await refusing.wait()
    with pytest.raises(PermissionDeniedError):
        pipe.answer()
    assert pipe.answer() is None and await pipe.settle() is None  # nothing left in flight


async def test_within_a_round_reports_leave_at_most_every_interval_and_the_first_batch_always() -> None:
    now = [100.0]
    pipe = ReportPipe(interval_s=0.25, clock=lambda: now[0])
    sent: list[int] = []

    async def report(batches: int) -> tuple[DirectiveKind, int]:
        sent.append(batches)
        return K.CONTINUE, 0

    async def batch(batches: int, seconds: float) -> bool:
        now[0] += seconds
        started = pipe.send(batches, lambda: report(batches))
        await pipe.settle()  # answered at once: only the interval holds a report back
        return started

    # Batches of 0.1 s: the first, then one every 0.25 s or more since the last that left.
    assert [await batch(n, 0.1) for n in range(1, 8)] == [True, False, False, True, False, False, True]
    # A new round's first batch goes out however recent the last report is.
    assert await batch(1, 0.01)
    assert not await batch(2, 0.1)
    assert sent == [1, 4, 7, 1]
