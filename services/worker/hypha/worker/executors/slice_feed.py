"""The trainer's batches: the next slice fetched while batches train, used slices told in the background.

Asking the bridge for a slice (and, behind it, the scheduler, and the data
node if the worker has not fetched it yet), then loading its file, stopped
training every few batches; telling the bridge which slices were used cost a
round trip after the batch that finished one. Together that was 3-4 % of a
small model's round on a 2-core machine (docs/performance.md). So:

- the next slice is fetched and loaded as soon as the batch after the one
  about to train would need it, while that batch trains; at most one slice is
  fetched ahead, and only while the trainer holds at most one other: the
  scheduler assigns a worker at most two slices at a time (its prefetch
  allowance, ``hypha.scheduler.diloco.slice_tracker``) and answers "none for now" beyond
  that, which must not end a batch short. A slice fetched ahead is assigned a
  few batches early, as the one in use already is: a worker that stops leaves
  it unused, and the scheduler hands a lost worker's slices out again;
- used slices are told in the background, one call at a time and in order;
  every slice request waits for the call in flight first (the bridge passes
  used slices on with its next request, so the allowance is freed in time),
  and ``settle`` waits for it before a round's last report, so the scheduler
  sees the round's slices with it; a failed call is raised there.

An unreachable scheduler is not fatal: a slice request counts as "no data for
now" and the trainer asks again later.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from hypha.datasets.format import load_slice_file
from hypha.errors import UnavailableError
from hypha.worker.executors.batches import Batch, BatchStream
from hypha.worker.executors.bridge_api import Bridge, raise_if_bridge_gone

logger = logging.getLogger(__name__)

Slice = tuple[int, dict[str, torch.Tensor]]


class SliceFeed:
    """Batches of ``stream``'s size from the slices the bridge hands this worker."""

    def __init__(self, bridge: Bridge, stream: BatchStream) -> None:
        self.bridge = bridge
        self.stream = stream
        self._ahead: asyncio.Task[Slice | None] | None = None
        self._telling: asyncio.Task[None] | None = None

    async def next_batch(self) -> Batch | None:
        """The next full batch, pulling slices as needed; a short one (or None) when they run dry."""
        while (batch := self.stream.next_batch()) is None:
            ahead, self._ahead = self._ahead, None
            got = await ahead if ahead is not None else None
            if got is None:  # nothing fetched ahead, or its "none for now" may be stale: ask now
                got = await self._fetch()
            if got is None:
                return self.stream.flush()
            self.stream.add_slice(*got)
        return batch

    def fetch_ahead(self) -> None:
        """Start fetching the next slice if the batch after the next one would need it (and the
        trainer holds at most one slice, so the fetch stays within the scheduler's allowance)."""
        stream = self.stream
        if self._ahead is None and stream.held_slices <= 1 and stream.pending_rows < 2 * stream.batch_size:
            self._ahead = asyncio.create_task(self._fetch(), name="slice-ahead")

    async def tell_used(self) -> None:
        """Tell the bridge, in the background, which slices the batches so far used up."""
        used = self.stream.take_consumed()
        if not used:
            return
        await self.settle()
        self._telling = asyncio.create_task(self.bridge.slices_used(used), name="slices-used")

    async def settle(self) -> None:
        """Wait for the used-slices call in flight; its failure is raised here."""
        telling, self._telling = self._telling, None
        if telling is not None:
            await telling

    def cancel(self) -> None:
        """Stop what runs in the background (the trainer is ending)."""
        for task in (self._ahead, self._telling):
            if task is None:
                continue
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the trainer already ends for its own reason
            task.cancel()
        self._ahead = self._telling = None

    async def _fetch(self) -> Slice | None:
        await self.settle()  # used slices reach the bridge before it asks for the next one
        try:
            info = await self.bridge.next_slice()
        except UnavailableError as exc:
            raise_if_bridge_gone(exc)
            logger.warning("no slice for now: %s", exc.message)
            return None
        if info is None:
            return None
        return int(info.index), await asyncio.to_thread(load_slice_file, info.path)
