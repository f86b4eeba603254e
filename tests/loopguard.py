"""Fails a test that blocked its own event loop: a step of the test's coroutine (or of an async
fixture's), from one await to the next, that took longer than a limit.

A test that calls a blocking helper on its loop (a subprocess wait, a ``time.sleep`` poll, a process
scan) stalls its own bus client and the services it runs in-process meanwhile: their pings,
subscriptions and timers wait, which shows up later as a flaky failure somewhere else.

The suite's loops are not in asyncio's debug mode, which would time every step too but also record, for
every task, handle and coroutine, the stack it was made at: in-process services ran at about 1.3 times
their CPU, on 2-core boxes whose full run is CPU-bound. The guard times each step itself (two clock
reads) and, while it watches, refuses what debug mode would refuse: a call into the loop from another
thread (``call_soon``/``call_at`` instead of ``call_soon_threadsafe``).

Steps of other tasks (an in-process service placing 300 replicas, nats-py's callbacks) are CPU work of
the code under test, up to 1.5 s on a loaded 2-core box: they are left out. The limit is well above a
loaded box's CPU-bound test steps (under 1 s seen), so only blocking waits trip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from asyncio import base_events, events
from collections.abc import Callable, Iterator
from typing import Any

# A test's coroutine in a task's repr: "coro=<test_x() running at ...", or a qualified test_ name.
_TEST_CORO = re.compile(r"coro=<(?:[\w<>]+\.)*test_\w*\(\)")


def _the_tests_own(step: str) -> bool:
    """A step of a test function's task, or of pytest-asyncio's for an async fixture."""
    return bool(_TEST_CORO.search(step)) or "pytest_asyncio" in step


def _describe(handle: events.Handle) -> str:
    # A task's step is shown as its task (what it runs, and where it is), as debug mode shows it.
    fmt: Callable[[events.Handle], str] = getattr(base_events, "_format_handle", repr)
    return fmt(handle)


def _same_thread(loop: asyncio.AbstractEventLoop) -> None:
    owner = getattr(loop, "_thread_id", None)
    if owner is not None and owner != threading.get_ident():
        raise RuntimeError(
            "Non-thread-safe operation invoked on an event loop other than the current one: "
            "use loop.call_soon_threadsafe or asyncio.run_coroutine_threadsafe"
        )


class BlockedLoopGuard:
    """Collects the test's steps, on loops run by this thread, that took more than ``limit_s``."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.thread = threading.get_ident()
        self.steps: list[str] = []

    def _timed(self, run: Callable[[events.Handle], None]) -> Callable[[events.Handle], None]:
        clock, limit, thread = time.perf_counter, self.limit_s, self.thread

        def timed_run(handle: events.Handle) -> None:
            t0 = clock()
            try:
                run(handle)
            finally:
                took = clock() - t0
                # Only this thread's loops: the test's own (a loop in a helper thread is not the test's).
                if took > limit and threading.get_ident() == thread:
                    step = _describe(handle)
                    if _the_tests_own(step):
                        self.steps.append(f"{took:.2f} s: {step}")

        return timed_run

    @contextlib.contextmanager
    def watching(self) -> Iterator[BlockedLoopGuard]:
        loop_cls = base_events.BaseEventLoop
        run, call_soon, call_at = events.Handle._run, loop_cls.call_soon, loop_cls.call_at

        def checked_call_soon(loop: Any, *a: Any, **kw: Any) -> Any:
            _same_thread(loop)
            return call_soon(loop, *a, **kw)

        def checked_call_at(loop: Any, *a: Any, **kw: Any) -> Any:
            _same_thread(loop)
            return call_at(loop, *a, **kw)

        events.Handle._run = self._timed(run)  # type: ignore[method-assign,assignment]
        loop_cls.call_soon = checked_call_soon  # type: ignore[method-assign,assignment]
        loop_cls.call_at = checked_call_at  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            events.Handle._run = run  # type: ignore[method-assign,assignment]
            loop_cls.call_soon = call_soon  # type: ignore[method-assign,assignment]
            loop_cls.call_at = call_at  # type: ignore[method-assign,assignment]

    def report(self) -> str:
        return (
            f"the event loop was blocked for more than {self.limit_s:g} s in {len(self.steps)} step(s); "
            "await the blocking call in a thread (asyncio.to_thread) or use an async helper:\n  "
            + "\n  ".join(self.steps)
        )
