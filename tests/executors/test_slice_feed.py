"""SliceFeed: the next slice is fetched while a batch trains, used slices are told in order in the
background, and an unreachable scheduler only means "no data for now"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from hypha.bridge_client.client import SliceInfo
from hypha.datasets.prepare import write_dataset
from hypha.errors import FailedPreconditionError, UnavailableError
from hypha.worker.executors.batches import BatchStream
from hypha.worker.executors.slice_feed import SliceFeed
from tests.helpers import eventually

ROWS = 6  # per slice


class SliceBridge:
    """The two bridge calls a feed makes, recorded; ``next_slice`` waits on ``gate`` when set.

    Like the scheduler, it assigns a worker at most two slices not yet reported used, and
    answers "none for now" beyond that (``most_held`` records the most it ever saw held).
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.handed = 0
        self.calls: list[str] = []
        self.used: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        self.fail_next: BaseException | None = None
        self.used_fails: BaseException | None = None
        self.most_held = 0

    async def next_slice(self) -> SliceInfo | None:
        self.calls.append("next_slice")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        if self.gate is not None:
            await self.gate.wait()
        held = self.handed - sum(map(len, self.used))
        self.most_held = max(self.most_held, held)
        if self.handed >= len(self.paths) or held >= 2:
            return None
        self.handed += 1
        return SliceInfo(self.handed - 1, 0, self.paths[self.handed - 1])

    async def slices_used(self, indices: list[int]) -> None:
        self.calls.append(f"used {indices}")
        await asyncio.sleep(0)  # answers on a later turn of the loop, as an HTTP call does
        if self.used_fails is not None:
            raise self.used_fails
        self.used.append(list(indices))


@pytest.fixture
def paths(tmp_path: Path) -> list[Path]:
    dataset = write_dataset({"x": torch.arange(3 * ROWS).reshape(-1, 1)}, tmp_path, "rows", ROWS)
    return [dataset.slice_path(i) for i in range(3)]


def feed_of(bridge: SliceBridge, batch: int = 4) -> SliceFeed:
    return SliceFeed(bridge, BatchStream(batch))  # type: ignore[arg-type]


async def test_the_next_slice_is_fetched_while_the_batch_before_it_trains(paths: list[Path]) -> None:
    # Prepare: batches of 4 from slices of 6 rows
    bridge = SliceBridge(paths)
    feed = feed_of(bridge)

    # Execute / Assert: after the first batch 2 rows are left, so the second batch needs slice 1
    first = await feed.next_batch()
    assert first is not None and bridge.handed == 1
    feed.fetch_ahead()  # as the trainer does right before a batch trains
    await eventually(lambda: bridge.handed == 2, timeout=5)  # fetched before it is asked for
    second = await feed.next_batch()
    assert second is not None and bridge.calls == ["next_slice", "next_slice"]
    rows = [int(v) for b in (first, second) for v in b["x"].flatten()]
    assert rows == list(range(8))  # in order, across the slice boundary


@pytest.mark.parametrize("batch", [1, 4, 5, 7])
async def test_driven_as_the_trainer_does_every_batch_is_full_and_the_allowance_holds(
    paths: list[Path], batch: int
) -> None:
    # Prepare
    bridge = SliceBridge(paths)
    feed = feed_of(bridge, batch)

    # Execute: the trainer's loop (next batch, fetch ahead, train, tell used)
    sizes: list[int] = []
    rows: list[int] = []
    while (got := await feed.next_batch()) is not None:
        feed.fetch_ahead()
        await asyncio.sleep(0)  # the batch "trains" while the fetch runs
        sizes.append(len(got["x"]))
        rows += [int(v) for v in got["x"].flatten()]
        await feed.tell_used()
    await feed.settle()

    # Assert: all 18 rows once and in order, short only at the very end, never 3 slices held
    assert rows == list(range(3 * ROWS))
    assert all(size == batch for size in sizes[:-1]) and 0 < sizes[-1] <= batch
    assert [index for told in bridge.used for index in told] == [0, 1, 2]
    assert bridge.most_held <= 2


async def test_nothing_is_fetched_ahead_while_two_slices_are_held(paths: list[Path]) -> None:
    bridge = SliceBridge(paths)
    feed = feed_of(bridge, batch=8)
    await feed.next_batch()  # needs slices 0 and 1: 4 rows of slice 1 left, slice 0 not told yet
    feed.fetch_ahead()
    await asyncio.sleep(0)
    assert bridge.calls == ["next_slice", "next_slice"]


async def test_nothing_is_fetched_ahead_while_two_batches_are_left(paths: list[Path]) -> None:
    bridge = SliceBridge(paths)
    feed = feed_of(bridge, batch=2)
    await feed.next_batch()  # 4 of 6 rows left: two more batches
    feed.fetch_ahead()
    await asyncio.sleep(0)
    assert bridge.calls == ["next_slice"]


async def test_used_slices_are_told_in_order_one_call_at_a_time(paths: list[Path]) -> None:
    bridge = SliceBridge(paths)
    feed = feed_of(bridge, batch=6)
    for _ in range(3):
        assert await feed.next_batch() is not None
        await feed.tell_used()
    await feed.settle()
    assert bridge.used == [[0], [1], [2]]
    assert await feed.next_batch() is None  # dry, nothing pending


async def test_a_failed_used_call_is_raised_at_settle(paths: list[Path]) -> None:
    bridge = SliceBridge(paths)
    bridge.used_fails = FailedPreconditionError("job gone")
    feed = feed_of(bridge, batch=6)
    await feed.next_batch()
    await feed.tell_used()
    with pytest.raises(FailedPreconditionError):
        await feed.settle()


async def test_an_unreachable_scheduler_is_no_data_for_now(paths: list[Path]) -> None:
    bridge = SliceBridge(paths)
    bridge.fail_next = UnavailableError("scheduler unreachable")
    feed = feed_of(bridge)
    assert await feed.next_batch() is None
    assert await feed.next_batch() is not None  # asks again and gets one


async def test_cancel_stops_a_fetch_in_flight(paths: list[Path]) -> None:
    bridge = SliceBridge(paths)
    feed = feed_of(bridge)
    await feed.next_batch()
    bridge.gate = asyncio.Event()
    feed.fetch_ahead()
    await eventually(lambda: len(bridge.calls) == 2, timeout=5)
    feed.cancel()
    bridge.gate.set()
    await asyncio.sleep(0)
    assert bridge.handed == 1  # the second slice was never taken
