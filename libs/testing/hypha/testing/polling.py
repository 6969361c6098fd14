"""Waiting for a condition with a deadline instead of sleeping a guessed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(
    predicate: Callable[[], Any | Awaitable[Any]],
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "condition",
) -> Any:
    """Poll ``predicate`` until it returns something truthy (its value); fail after ``timeout`` seconds.

    An ``AssertionError`` raised by the predicate counts as "not yet" and is chained
    to the final failure, so an assertion-style predicate reports what was last wrong.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
                value = await value
            if value:
                return value
        except AssertionError as err:
            last_error = err
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not reached within {timeout}s") from last_error
        await asyncio.sleep(interval)


async def until(predicate: Callable[[], Any | Awaitable[Any]], message: str, timeout: float = 10) -> Any:
    """``eventually`` with the message first, as mesh tests and benchmarks read best."""
    return await eventually(predicate, timeout=timeout, message=message)
