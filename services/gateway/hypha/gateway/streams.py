"""Pumping a bidi stream: a task feeds incoming frames to a handler while
the outbox is yielded out; the stream ends when either side does.

Stream handlers are async generators (not ``context.write`` loops) because
interceptors such as OpenTelemetry's wrap streaming responses as generators.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from hypha.gateway.outbox import Outbox
from hypha.service import cancel_and_wait

#: Ways a stream ends that are the peer's business, not an error of ours.
_BENIGN = (grpc.aio.AioRpcError, ConnectionError, asyncio.CancelledError)


async def serve_frames(
    incoming: AsyncIterator[Any],
    outbox: Outbox[Any],
    handle: Callable[[Any], Awaitable[None]],
) -> AsyncIterator[Any]:
    """Yield outgoing frames until the peer half-closes, breaks, or the outbox closes."""

    async def reader() -> None:
        try:
            async for frame in incoming:
                await handle(frame)
        finally:
            outbox.close()

    task = asyncio.create_task(reader())
    try:
        async for frame in outbox.frames():
            yield frame
        if task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None and not isinstance(exc, _BENIGN):
                raise exc
    finally:
        await cancel_and_wait(task, expected=(Exception,))  # raised above when it mattered


async def frames_of(call: Any) -> AsyncIterator[Any]:
    """The incoming frames of a client-side bidi call."""
    while True:
        frame = await call.read()
        if frame is grpc.aio.EOF:
            return
        yield frame
