"""Fails a test whose event loop was blocked: a step of the loop (one callback, or one run of a task up
to its next await) that took longer than a limit.

asyncio in debug mode (the suite's loops are) logs each step over ``loop.slow_callback_duration``
(0.1 s) as a WARNING on the "asyncio" logger; the guard collects those over ``limit_s``. A test that
calls a blocking helper on its loop (a subprocess wait, a ``time.sleep`` poll, a process scan) stalls
its own bus client and servers meanwhile: their pings, subscriptions and timers wait, which shows up
later as a flaky failure somewhere else. The limit is well above a loaded box's CPU-bound steps
(0.1-0.9 s seen on 2 cores), so only blocking waits trip it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

# asyncio.base_events logs a slow step with this format string and (handle, seconds).
SLOW_STEP = "Executing %s took %.3f seconds"


class BlockedLoopGuard(logging.Handler):
    """Collects slow-step records of loops run by this thread that took more than ``limit_s``."""

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
