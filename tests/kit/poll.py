"""Waiting for a condition in a test: one way, with a message that says what never happened.

A test that polls names what it waits for (``what``); on timeout the failure says so and shows the
last value (or the last tolerated exception), so a red run reads as a sentence, not "assert False".
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


@overload
async def eventually(
    check: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = 10.0,
    every: float = 0.05,
    what: str = "the condition",
    tolerate: tuple[type[BaseException], ...] = (),
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T | None],
    *,
    timeout: float = 10.0,
    every: float = 0.05,
    what: str = "the condition",
    tolerate: tuple[type[BaseException], ...] = (),
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    *,
    timeout: float = 10.0,
    every: float = 0.05,
    what: str = "the condition",
    tolerate: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call ``check`` (sync or async) until it returns something truthy, and return that.

    Exceptions of the types in ``tolerate`` count as "not yet" (a service that is still starting);
    any other exception fails the test at once. Fails with ``AssertionError`` after ``timeout``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = None
    while True:
        try:
            got = check()
            value = await got if inspect.isawaitable(got) else got
        except tolerate as e:
            last = e
        else:
            if value:
                return value
            last = value
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(every)


def eventually_sync(
    check: Callable[[], T],
    *,
    timeout: float = 10.0,
    every: float = 0.02,
    what: str = "the condition",
) -> T:
    """``eventually`` for a test that has no event loop (process supervision, files)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(every)
