"""The suite's claim that it runs with asyncio debug on (slow callbacks, never-awaited coroutines and
calls from the wrong thread are reported): pytest-asyncio sets each test loop's debug flag from its own
``asyncio_debug`` option, so ``PYTHONASYNCIODEBUG=1`` in ``make test`` alone left it off."""

from __future__ import annotations

import asyncio


async def test_test_loops_run_in_debug_mode() -> None:
    assert asyncio.get_running_loop().get_debug()
