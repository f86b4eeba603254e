"""The suite runs its event loops in asyncio debug mode (pyproject: ``asyncio_debug``).

pytest-asyncio makes its own loops and sets their debug mode from its option alone (-X dev in `make
test` does not reach them), so without ``asyncio_debug = true`` the tests' loops do not report
never-awaited coroutines, callbacks that block the loop, or non-threadsafe calls from a thread. The
services the suite starts as processes are not in debug mode (tests/conftest.py): they run as in
production, at about three quarters of debug mode's CPU.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from tests.loopguard import BlockedLoopGuard


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


def _run_a_blocking_step(seconds: float, *, in_a_test: bool = True) -> None:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.01

    # What a blocking helper called on the loop does, in a test's task or in another one.
    async def test_blocks() -> None:
        time.sleep(seconds)  # noqa: ASYNC251

    async def service_works() -> None:
        time.sleep(seconds)  # noqa: ASYNC251

    try:
        loop.run_until_complete(test_blocks() if in_a_test else service_works())
    finally:
        loop.close()


@pytest.mark.slow
def test_the_loop_guard_catches_a_tests_step_over_its_limit_only() -> None:
    # The suite's autouse guard (tests/conftest.py) fails a test with what this one collects.
    with BlockedLoopGuard(0.15).watching() as guard:
        _run_a_blocking_step(0.05)  # logged by asyncio (over 0.01 s) but under the guard's limit
        _run_a_blocking_step(0.3, in_a_test=False)  # the code under test's CPU work, not the test's
        assert guard.steps == []
        _run_a_blocking_step(0.3)
    assert len(guard.steps) == 1 and "test_blocks()" in guard.steps[0], guard.steps
    assert "blocked for more than 0.15 s in 1 step(s)" in guard.report()


def test_a_process_the_suite_starts_runs_without_asyncio_debug() -> None:
    # PYTHONASYNCIODEBUG in the environment that ran pytest (an older `make test` set it) is not
    # passed down: a process started from here makes loops without debug mode.
    code = "import asyncio; print(asyncio.new_event_loop().get_debug())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out
