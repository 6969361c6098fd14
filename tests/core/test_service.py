"""The service base and the background-task owner: start/stop, async with, crashes logged, cancel."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hypha.service import BackgroundTasks, Resource, Service, cancel_and_wait
from hypha.testing.polling import eventually


class _Part(Service):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")

    async def stop(self) -> None:
        self.calls.append("stop")


class _Client(Resource):
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_async_with_starts_and_stops_a_service_even_on_error() -> None:
    part = _Part()
    with pytest.raises(RuntimeError):
        async with part as entered:
            assert entered is part and part.calls == ["start"]
            raise RuntimeError("boom")
    assert part.calls == ["start", "stop"]


async def test_async_with_closes_a_resource_without_starting_it() -> None:
    async with _Client() as client:
        assert not client.closed
    assert client.closed


async def test_a_crashed_background_task_is_logged_and_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    tasks = BackgroundTasks()

    async def crash() -> None:
        raise ValueError("bad frame")

    # Execute
    with caplog.at_level(logging.ERROR, logger="hypha.service"):
        task = tasks.spawn(crash(), "sender")
        await asyncio.wait([task], timeout=5)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn

    # Assert
    assert len(tasks) == 0
    assert any("sender" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_cancel_ends_every_task_and_waits_for_them() -> None:
    # Prepare
    tasks = BackgroundTasks()
    cleaned = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    running = [tasks.spawn(forever(), f"loop {i}") for i in range(3)]
    await asyncio.sleep(0)

    # Execute
    await tasks.cancel()

    # Assert: all cancelled, their cleanup ran before cancel() returned
    assert all(task.cancelled() for task in running)
    assert cleaned.is_set()


async def test_drain_lets_quick_tasks_finish_and_cancels_the_rest() -> None:
    # Prepare
    tasks = BackgroundTasks()

    async def quick() -> str:
        return "sent"

    quick_task = tasks.spawn(quick(), "quick")
    slow_task = tasks.spawn(asyncio.Event().wait(), "slow")

    # Execute
    async with asyncio.timeout(10):
        await tasks.drain(0.05)

    # Assert
    assert quick_task.result() == "sent"
    assert slow_task.cancelled()


async def test_cancel_and_wait_lets_a_cancellation_aimed_at_the_caller_through() -> None:
    # A ``stop()`` that is itself cancelled while its task cleans up must end cancelled, not
    # carry on as if nothing happened (what ``suppress(CancelledError)`` around the await does).
    started, release = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()

    task = asyncio.create_task(slow_to_stop())
    await started.wait()
    stopper = asyncio.create_task(cancel_and_wait(task, None))
    await eventually(lambda: task.cancelling() > 0, message="the task was cancelled")
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(stopper, 5)
    release.set()
    await asyncio.wait_for(asyncio.wait([task]), 5)
    assert task.cancelled()


async def test_cancel_and_wait_logs_an_earlier_crash_unless_expected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def crash(error: Exception) -> None:
        raise error

    broken = asyncio.create_task(crash(RuntimeError("boom")), name="broken")
    benign = asyncio.create_task(crash(ConnectionError("peer left")), name="benign")
    await asyncio.wait([broken, benign])
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait(broken, benign, expected=(ConnectionError,))
    assert [r.getMessage() for r in caplog.records] == ["task broken had failed"]
