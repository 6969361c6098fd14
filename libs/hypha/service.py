"""The lifecycle of a long-lived part, and the owner of its background tasks.

Every long-lived part of a node (a server, a link, a market, the job
manager) has an async ``start()``, an idempotent ``stop()`` and ``async
with`` on top; ``Service`` supplies the last so each part writes only the
first two. ``Resource`` does the same for objects that are usable from
construction and only need ``close()`` (a channel, a client).

``BackgroundTasks`` owns the fire-and-forget tasks a part spawns (a status
report, a lease-end callback, a send): it keeps a reference (so the loop
cannot garbage-collect a running task), logs a crash instead of losing it in
"Task exception was never retrieved", and cancels or drains what is left
when the part stops.

NOTE: not ``asyncio.TaskGroup``: a TaskGroup cancels every sibling when one
child fails and can only be awaited from the scope that opened it, while a
part's helpers are independent of each other and outlive the call that
spawned them. Cancellation is never swallowed here: ``cancel()`` waits for
the tasks it cancelled, but a ``CancelledError`` aimed at the caller
propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, Self

_log = logging.getLogger(__name__)


class Service:
    """Base of a long-lived part: subclasses define ``start`` and an idempotent ``stop``."""

    async def start(self) -> object:
        """Begin work; a part that needs no start-up keeps this.

        What it returns (a bound port, a socket path) is the subclass's own
        business: ``async with`` ignores it.
        """

    async def stop(self) -> None:
        """End work and release what ``start`` took; safe to call twice or before ``start``."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class Resource:
    """Base of an object that is usable from construction until ``close()`` (a channel, a client).

    ``async with`` closes it on the way out; ``close`` must be idempotent.
    """

    async def close(self) -> None:
        """Release what the object holds; safe to call twice."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def cancel_and_wait(
    *tasks: asyncio.Task[Any] | None,
    expected: tuple[type[BaseException], ...] = (),
    logger: logging.Logger | None = None,
) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until each has ended.

    Unlike ``task.cancel(); with suppress(CancelledError): await task``, a cancellation aimed
    at the caller while it waits still reaches the caller, and a task that had already crashed
    has its error logged (unless it is one of ``expected``) instead of raised into a ``stop()``.
    """
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    if not live:
        return
    await asyncio.wait(live)
    for task in live:
        if task.cancelled() or (error := task.exception()) is None or isinstance(error, expected):
            continue
        (logger or _log).warning("task %s had failed", task.get_name(), exc_info=error)


class BackgroundTasks:
    """A set of independent background tasks that logs their crashes and can cancel or drain them."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or _log
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task owned by this set until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._log.error("background task %s failed", task.get_name(), exc_info=error)

    def cancel_nowait(self) -> None:
        """Cancel every task without waiting, for a teardown that cannot await."""
        for task in list(self._tasks):
            task.cancel()

    async def cancel(self) -> None:
        """Cancel every task and wait until all have ended."""
        tasks = list(self._tasks)
        self.cancel_nowait()
        if tasks:
            await asyncio.wait(tasks)

    async def drain(self, timeout_s: float) -> None:
        """Let the tasks finish for up to ``timeout_s``, then cancel what is left."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        await self.cancel()


__all__ = ["BackgroundTasks", "Resource", "Service", "cancel_and_wait"]
