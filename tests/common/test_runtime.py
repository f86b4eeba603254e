"""The process plumbing every service shares: a loop that ends is a death (exit 70), and the failure
policy of a loop's passes (counted; given up only after enough failures in a row for long enough)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from llmgw_runtime.runtime import (
    EXIT_TASK_DIED,
    FailedPasses,
    PassGuard,
    TaskDied,
    cancel_and_wait,
    raise_if_died,
    run_service,
    until_stopped,
)


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def test_pass_guard_gives_up_only_after_enough_failures_in_a_row_for_long_enough() -> None:
    clock = Clock()
    g = PassGuard("p", logging.getLogger("t"), limit=3, min_span_s=10.0, clock=clock)
    for _ in range(5):  # a burst: many failures within a second is not yet "keeps failing"
        g.failure(ValueError("bad"))
        clock.t += 0.1
    assert (g.failed, g.in_a_row) == (5, 5)
    g.ok()
    assert (g.failed, g.in_a_row) == (5, 0)
    g.failure(ValueError("bad"))
    clock.t += 10.0
    g.failure(ValueError("bad"))  # span reached, but only 2 in a row
    with pytest.raises(FailedPasses, match="p: 3 passes in a row failed over 10s; giving up") as e:
        g.failure(ValueError("bad"))
    assert isinstance(e.value.__cause__, ValueError)


def test_pass_guard_without_limit_never_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    g = PassGuard("tick", logging.getLogger("t"))
    for _ in range(100):
        g.failure(KeyError("x"))
    assert g.failed == 100
    # One traceback per distinct error, one line per failure.
    assert len([r for r in caplog.records if r.exc_info]) == 1
    assert len([r for r in caplog.records if "tick pass failed" in r.message]) == 100


async def test_until_stopped_returns_on_stop_and_names_a_task_that_ended() -> None:
    stop = asyncio.Event()
    forever = asyncio.create_task(asyncio.sleep(3600), name="forever")
    stop.set()
    await until_stopped(stop, [forever])
    stop.clear()

    async def ends() -> None:
        await asyncio.sleep(0.01)

    with pytest.raises(TaskDied, match="task ends returned"):
        await until_stopped(stop, [forever, asyncio.create_task(ends(), name="ends")])

    async def raises() -> None:
        raise OSError("disk")

    with pytest.raises(TaskDied, match="task raises raised OSError: disk") as e:
        await until_stopped(stop, [forever, asyncio.create_task(raises(), name="raises")])
    assert isinstance(e.value.__cause__, OSError)
    forever.cancel()
    with pytest.raises(TaskDied, match="task forever was cancelled"):
        await until_stopped(stop, [forever])


def test_run_service_exits_70_when_a_task_died() -> None:
    async def main(stop: asyncio.Event) -> None:
        async def dies() -> None:
            raise RuntimeError("bug")

        await until_stopped(stop, [asyncio.create_task(dies(), name="loop")])

    with pytest.raises(SystemExit) as e:
        run_service(main)
    assert e.value.code == EXIT_TASK_DIED == 70


async def test_cancel_and_wait_cancelled_itself_still_ends_a_task_that_swallowed_a_cancel() -> None:
    """A stop that is itself cancelled (a service's stop during a stop) raised at once and left the task
    that had swallowed its first cancel (3.11's wait_for in nats-py, CPython gh-86296) running, with
    nothing left to cancel it again."""
    swallowed = asyncio.Event()

    async def loop_that_swallows_one_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # what 3.11's wait_for does when its answer and the cancel arrive together
        while True:
            await asyncio.sleep(3600)

    stubborn = asyncio.create_task(loop_that_swallows_one_cancel())
    await asyncio.sleep(0)
    stopping = asyncio.create_task(cancel_and_wait([stubborn], again_s=0.05))
    try:
        await asyncio.wait_for(swallowed.wait(), 5)
        stopping.cancel()
        # Not wait_for: it would cancel the stop again.
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert stopping in done and stopping.cancelled()
        assert stubborn.done() and stubborn.cancelled()
    finally:
        stubborn.cancel()
        stopping.cancel()
        await asyncio.gather(stubborn, stopping, return_exceptions=True)


async def test_raise_if_died_names_an_ended_task_and_passes_over_running_ones() -> None:
    forever = asyncio.create_task(asyncio.sleep(3600), name="forever")

    async def raises() -> None:
        raise OSError("disk")

    dead = asyncio.create_task(raises(), name="probe-judge")
    await asyncio.sleep(0)
    raise_if_died([forever])  # running: nothing
    with pytest.raises(TaskDied, match="task probe-judge raised OSError: disk"):
        raise_if_died([forever, dead])
    forever.cancel()
    with pytest.raises(TaskDied, match="task forever was cancelled"):
        await asyncio.sleep(0)
        raise_if_died([forever])
