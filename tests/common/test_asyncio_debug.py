"""The suite runs its event loops in asyncio debug mode (pyproject: ``asyncio_debug``).

`make test` sets PYTHONASYNCIODEBUG=1, but pytest-asyncio makes its own loops and sets their debug
mode from its option alone, so without ``asyncio_debug = true`` the tests' loops do not report
never-awaited coroutines, callbacks that block the loop, or non-threadsafe calls from a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


@pytest.fixture
async def fixture_loop_debug() -> AsyncIterator[bool]:
    yield asyncio.get_running_loop().get_debug()


async def test_a_test_loop_runs_in_debug_mode() -> None:
    assert asyncio.get_running_loop().get_debug()


async def test_an_async_fixture_loop_runs_in_debug_mode(fixture_loop_debug: bool) -> None:
    assert fixture_loop_debug


@pytest.mark.asyncio(loop_scope="module")
async def test_a_module_scoped_loop_runs_in_debug_mode() -> None:
    # Each loop scope has its own runner fixture: the option reaches all of them, not only the default.
    assert asyncio.get_running_loop().get_debug()
