"""Handing data slices to one execution: the bridge's ``/v1/slices/next`` and ``/v1/slices/used``.

The scheduler decides which slice a trainer gets next; the worker fetches it
(``SliceSource``: the verified cache) and places it in the execution's work
dir. Slices the executor reports used ride along with the next request to the
scheduler (one call, not two), and are put back for the one after when that
request fails. A slice whose fetch fails (its provider down) is kept and
fetched again on the next request, not dropped. With ``slice_lookahead`` the following slice is reserved and
prefetched as soon as one is handed out, so the executor's next request is a
local file; a request that finds the lookahead still running waits for it
rather than asking twice.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from hypha.errors import UnavailableError
from hypha.v1 import scheduler_pb2
from hypha.worker.fetcher import ProviderInfo
from hypha.worker.scheduler_link import SchedulerLink

log = logging.getLogger(__name__)


class SliceSource(Protocol):
    """What ``SliceFetcher`` offers: verified local copies of data slices."""

    async def fetch(self, dataset: str, index: int, providers: Sequence[ProviderInfo]) -> Path: ...

    def prefetch(self, dataset: str, index: int, providers: Sequence[ProviderInfo]) -> bool: ...


#: A slice handed out: (index, epoch, its file in the work dir).
HandedSlice = tuple[int, int, Path]


class SliceHandout:
    """The slices of one execution: asked for, fetched, placed, looked ahead and reported used."""

    def __init__(
        self,
        job_id: str,
        work_dir: Path,
        link: SchedulerLink,
        slices: SliceSource | None,
        *,
        lookahead: bool = True,
    ) -> None:
        self.job_id = job_id
        self.work_dir = work_dir
        self.link = link
        self.slices = slices
        self.lookahead = lookahead
        self._lock = asyncio.Lock()
        #: Slices reported used, not yet told to the scheduler.
        self.used: list[int] = []
        self._ahead: scheduler_pb2.NextSliceResponse | None = None
        self._looking: asyncio.Task[None] | None = None
        self._placed: dict[int, Path] = {}

    async def next(self) -> HandedSlice | None:
        """The next slice as a file of the work dir; None when the scheduler has none for now."""
        if self.slices is None:
            raise UnavailableError("this worker cannot fetch data slices")
        async with self._lock:
            if self._looking is not None:
                await asyncio.gather(self._looking, return_exceptions=True)
                self._looking = None
            response, self._ahead = self._ahead, None
            if response is None:
                response = await self._ask()
            if not response.available:
                return None
            providers = [ProviderInfo.from_proto(peer) for peer in response.providers]
            try:
                fetched = await self.slices.fetch(response.dataset, response.index, providers)
            except BaseException:
                # The scheduler handed this slice to us: fetched again on the next call rather
                # than dropped (a dropped slice is never trained on in its epoch).
                self._ahead = response
                raise
            path = await asyncio.to_thread(self._place, response.index, fetched)
            if self.lookahead:
                self._looking = asyncio.create_task(self._look_ahead(), name=f"slices-{self.job_id}")
        return response.index, response.epoch, path

    def mark_used(self, indices: Sequence[int]) -> None:
        """Slices the executor is done with: told to the scheduler with the next request; their
        copies in the work dir are removed."""
        self.used.extend(indices)
        for index in indices:
            placed = self._placed.pop(index, None)
            if placed is not None:
                placed.unlink(missing_ok=True)

    async def close(self) -> None:
        if self._looking is not None:
            self._looking.cancel()
            await asyncio.gather(self._looking, return_exceptions=True)
            self._looking = None

    async def _ask(self) -> scheduler_pb2.NextSliceResponse:
        used, self.used = self.used, []
        try:
            return await self.link.next_slice(scheduler_pb2.NextSliceRequest(job_id=self.job_id, used=used))
        except BaseException:
            self.used = used + self.used  # reported with the next request instead
            raise

    async def _look_ahead(self) -> None:
        """Reserve the following slice now and start downloading it, so the next call is a local hit."""
        try:
            response = await self._ask()
        except Exception as err:
            log.debug("job %s: slice lookahead failed: %r", self.job_id, err)
            return
        if response.available and self.slices is not None:
            self._ahead = response
            providers = [ProviderInfo.from_proto(peer) for peer in response.providers]
            self.slices.prefetch(response.dataset, response.index, providers)

    def _place(self, index: int, fetched: Path) -> Path:
        """The slice as a file of the work dir: a copy (through a hard link the job could write the cache)."""
        root = self.work_dir.resolve()
        if fetched.resolve().is_relative_to(root):
            return fetched
        target = root / "slices" / f"{index:06d}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        shutil.copyfile(fetched, target)
        self._placed[index] = target
        return target


__all__ = ["HandedSlice", "SliceHandout", "SliceSource"]
