"""A bounded queue of frames for one outgoing stream.

Topic traffic is offered (dropped and counted when full, so a slow reader
only hurts itself); direct traffic waits for room with a deadline, because a
direct message must either arrive or be reported as failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
F = TypeVar("F")


class Outbox(Generic[F]):
    def __init__(self, maxsize: int, label: str) -> None:
        self._queue: asyncio.Queue[F | None] = asyncio.Queue(maxsize)
        self.label = label
        self.dropped = 0
        self.closed = False
        self._last_warning = 0.0

    def offer(self, frame: F) -> bool:
        if self.closed:
            return False
        try:
            self._queue.put_nowait(frame)
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            now = time.monotonic()
            if now - self._last_warning > 5.0:
                self._last_warning = now
                log.warning("%s: queue full, dropped %d frames so far", self.label, self.dropped)
            return False

    async def put(self, frame: F, timeout_s: float) -> bool:
        if self.closed:
            return False
        if not self._queue.full():
            # NOTE: the common case without ``wait_for``, which wraps the put in a task and a timer
            # for every frame (a relayed stream puts one per 1 MiB chunk at each gateway).
            self._queue.put_nowait(frame)
            return True
        try:
            await asyncio.wait_for(self._queue.put(frame), timeout_s)
            return not self.closed
        except TimeoutError:
            return False

    @property
    def full(self) -> bool:
        """No room for another frame: ``offer`` drops and ``put`` waits."""
        return self._queue.full()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        while True:
            try:
                self._queue.put_nowait(None)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()  # pending frames are moot once closed

    async def frames(self) -> AsyncIterator[F]:
        while True:
            frame = await self._queue.get()
            if frame is None:
                return
            yield frame
