"""Fails a test that blocked its own event loop: a step of the test's coroutine (or of an async
fixture's), from one await to the next, that took longer than a limit.

asyncio in debug mode (the suite's loops are) logs each step over ``loop.slow_callback_duration``
(0.1 s) as a WARNING on the "asyncio" logger; the guard collects the test's own over ``limit_s``. A test
that calls a blocking helper on its loop (a subprocess wait, a ``time.sleep`` poll, a process scan)
stalls its own bus client and the services it runs in-process meanwhile: their pings, subscriptions and
timers wait, which shows up later as a flaky failure somewhere else.

Steps of other tasks (an in-process service placing 300 replicas, nats-py's callbacks) are CPU work of
the code under test, up to 1.5 s on a loaded 2-core box: they are left out. The limit is well above a
loaded box's CPU-bound test steps (under 1 s seen), so only blocking waits trip it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator

# A test's coroutine in a task's repr: "coro=<test_x() running at ...", or a qualified test_ name.
_TEST_CORO = re.compile(r"coro=<(?:[\w<>]+\.)*test_\w*\(\)")

# asyncio.base_events logs a slow step with this format string and (handle, seconds).
SLOW_STEP = "Executing %s took %.3f seconds"


def _the_tests_own(handle: str) -> bool:
    """A step of a test function's task, or of pytest-asyncio's for an async fixture."""
    return bool(_TEST_CORO.search(handle)) or "pytest_asyncio" in handle


class BlockedLoopGuard(logging.Handler):
    """Collects the test's steps, on loops run by this thread, that took more than ``limit_s``."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(logging.WARNING)
        self.limit_s = limit_s
        self.thread = threading.get_ident()
        self.steps: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # Only this thread's loops: the test's own (a loop in a helper thread is not the test's).
        if record.msg != SLOW_STEP or record.thread != self.thread:
            return
        if not isinstance(record.args, tuple) or len(record.args) != 2:
            return
        handle, seconds = record.args
        if not _the_tests_own(str(handle)):
            return
        if isinstance(seconds, float) and seconds > self.limit_s:
            self.steps.append(f"{seconds:.2f} s: {handle}")

    @contextlib.contextmanager
    def watching(self) -> Iterator[BlockedLoopGuard]:
        logger = logging.getLogger("asyncio")
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)

    def report(self) -> str:
        return (
            f"the event loop was blocked for more than {self.limit_s:g} s in {len(self.steps)} step(s); "
            "await the blocking call in a thread (asyncio.to_thread) or use an async helper:\n  "
            + "\n  ".join(self.steps)
        )
