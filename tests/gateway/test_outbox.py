"""One outgoing stream's bounded queue: topic frames are offered and dropped when full (so a slow
reader only hurts itself), direct frames wait for room with a deadline, and closing ends the
stream's reader without leaving a writer waiting forever."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hypha.gateway.outbox import Outbox


async def collect(outbox: Outbox[str], timeout: float = 5.0) -> list[str]:
    """Every frame the stream would send, until the outbox ends it."""
    got: list[str] = []
    async with asyncio.timeout(timeout):
        async for frame in outbox.frames():
            got.append(frame)
    return got


async def test_offer_fills_to_the_bound_then_drops_and_counts() -> None:
    # Prepare
    outbox: Outbox[str] = Outbox(3, "node")

    # Execute
    accepted = [outbox.offer(f"f{i}") for i in range(5)]

    # Assert: the first three are queued in order, the rest dropped (and counted), none replaced.
    assert accepted == [True, True, True, False, False]
    assert outbox.full
    assert outbox.dropped == 2
    outbox.close()
    assert await collect(outbox) == ["f1", "f2"]  # the end marker took the oldest frame's place


async def test_drops_are_logged_once_per_interval_not_per_frame(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hypha.gateway.outbox")
    outbox: Outbox[str] = Outbox(1, "slow node")
    outbox.offer("kept")

    for i in range(100):
        outbox.offer(f"dropped {i}")

    warnings = [r for r in caplog.records if "queue full" in r.getMessage()]
    assert len(warnings) == 1 and "slow node" in warnings[0].getMessage()
    assert outbox.dropped == 100


async def test_frames_come_out_in_order_and_end_after_close() -> None:
    outbox: Outbox[str] = Outbox(8, "node")
    for i in range(4):
        assert outbox.offer(f"f{i}")
    assert await outbox.put("direct", timeout_s=1.0)

    outbox.close()

    # What was queued before the close (with room to spare) is still sent, then the stream ends.
    assert await collect(outbox) == ["f0", "f1", "f2", "f3", "direct"]


async def test_a_closed_outbox_refuses_everything_without_counting_drops() -> None:
    outbox: Outbox[str] = Outbox(2, "node")
    outbox.close()
    outbox.close()  # idempotent: one end marker, not two

    assert not outbox.offer("late")
    assert not await outbox.put("late", timeout_s=1.0)
    assert outbox.dropped == 0  # a peer leaving is not a drop
    assert await collect(outbox) == []


async def test_put_waits_for_room_and_succeeds_when_the_reader_catches_up() -> None:
    # Prepare: a full queue.
    outbox: Outbox[str] = Outbox(1, "node")
    assert outbox.offer("first")
    put = asyncio.create_task(outbox.put("direct", timeout_s=10.0))
    await asyncio.sleep(0)  # let the put start waiting
    assert not put.done()

    # Execute: the reader takes one frame.
    frames = outbox.frames()
    assert await anext(frames) == "first"

    # Assert: the waiting direct frame got in and follows.
    async with asyncio.timeout(5):
        assert await put
    assert await anext(frames) == "direct"
    outbox.close()
    async with asyncio.timeout(5):
        with pytest.raises(StopAsyncIteration):
            await anext(frames)


async def test_put_on_a_full_queue_gives_up_at_its_deadline() -> None:
    outbox: Outbox[str] = Outbox(1, "node")
    outbox.offer("first")

    async with asyncio.timeout(5):
        assert not await outbox.put("direct", timeout_s=0.05)

    assert outbox.dropped == 0  # a direct frame is reported as failed, never counted as a drop
    outbox.close()
    assert "direct" not in await collect(outbox)


async def test_a_put_waiting_when_the_outbox_closes_reports_failure() -> None:
    # Prepare: a full queue and a direct frame waiting for room.
    outbox: Outbox[str] = Outbox(2, "node")
    outbox.offer("a")
    outbox.offer("b")
    put = asyncio.create_task(outbox.put("direct", timeout_s=10.0))
    await asyncio.sleep(0)

    # Execute: the stream ends while it waits; the reader drains what is left.
    outbox.close()
    sent = await collect(outbox)

    # Assert: the sender learns its frame was not sent (it would otherwise report success), fast.
    async with asyncio.timeout(5):
        assert await put is False
    assert "direct" not in sent
