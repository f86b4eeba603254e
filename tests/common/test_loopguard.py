"""The suite's event loops: not in asyncio's debug mode (pyproject: ``asyncio_debug = false``), and
checked by the loop guard (tests/loopguard.py, autouse in tests/conftest.py) instead.

Debug mode records, for every task, handle and coroutine, the stack it was made at: the services a test
runs in-process cost about a third more CPU in it, on 2-core boxes whose full run is CPU-bound. What it
was on for, the guard does: it fails a test whose own step held the loop too long, and refuses a call
into a loop from a thread that does not run it. The services the suite starts as processes are not in
debug mode either (tests/conftest.py): they run as in production.
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


async def test_a_test_loop_and_a_fixture_loop_run_without_debug_mode(fixture_loop_debug: bool) -> None:
    assert not asyncio.get_running_loop().get_debug()
    assert not fixture_loop_debug


def _run_a_blocking_step(seconds: float, *, in_a_test: bool = True) -> None:
    loop = asyncio.new_event_loop()

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
        _run_a_blocking_step(0.05)  # under the guard's limit
        _run_a_blocking_step(0.3, in_a_test=False)  # the code under test's CPU work, not the test's
        assert guard.steps == []
        _run_a_blocking_step(0.3)
    assert len(guard.steps) == 1 and "test_blocks()" in guard.steps[0], guard.steps
    assert "blocked for more than 0.15 s in 1 step(s)" in guard.report()
    _run_a_blocking_step(0.3)  # no longer watched
    assert len(guard.steps) == 1


async def test_the_loop_guard_refuses_a_call_into_the_loop_from_another_thread() -> None:
    loop = asyncio.get_running_loop()
    ran = asyncio.Event()
    with pytest.raises(RuntimeError, match="Non-thread-safe operation"):
        await asyncio.to_thread(loop.call_soon, ran.set)
    with pytest.raises(RuntimeError, match="Non-thread-safe operation"):
        await asyncio.to_thread(loop.call_later, 0.01, ran.set)
    await asyncio.to_thread(loop.call_soon_threadsafe, ran.set)  # the way that is safe
    await asyncio.wait_for(ran.wait(), 5)


def test_a_process_the_suite_starts_runs_without_asyncio_debug() -> None:
    # PYTHONASYNCIODEBUG in the environment that ran pytest (an older `make test` set it) is not
    # passed down: a process started from here makes loops without debug mode.
    code = "import asyncio; print(asyncio.new_event_loop().get_debug())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out
