"""Process plumbing shared by every service: logging, the event loop, signals, and the rule that a
service whose long-running task dies exits non-zero instead of lingering half-alive.

That rule is the one policy for a loop that dies, in every service: the process exits with
:data:`EXIT_TASK_DIED` and its supervisor (`llmgw up`'s upkeep, systemd, Kubernetes) starts it afresh,
with a backoff and a restart count someone can see. A loop is never revived in place: the death of a
loop is a bug, whatever state it left behind is suspect, and a loop revived every few seconds by its own
process crash-loops in silence with nothing but a log line (a restarting process is counted and
alerted on). Fixed loops are watched by :func:`until_stopped`; loops started and retired as the work
changes (one per webhook, one per watched model) by :func:`raise_if_died` on each housekeeping pass.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from llmgw_common.names import VisibleFormatter


def setup_logging(level: str = "INFO", name: str = "llmgw") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(VisibleFormatter(f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop where available; SIGTERM and SIGINT set ``stop``.

    ``main`` raising :class:`TaskDied` (from :func:`until_stopped`) or :class:`FailedPasses` exits the
    process with :data:`EXIT_TASK_DIED`, after ``main``'s own cleanup ran.
    """

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(runner())
        else:
            uvloop.run(runner())
    except (TaskDied, FailedPasses) as e:
        _log.critical("%s; exiting with status %d so that it is restarted", e, EXIT_TASK_DIED, exc_info=e)
        raise SystemExit(EXIT_TASK_DIED) from None


# The exit status of a process whose long-running task ended (sysexits.h EX_SOFTWARE): not a clean stop,
# so that `llmgw up`, systemd or Kubernetes restarts it, and a standby control plane takes over.
EXIT_TASK_DIED = 70

_log = logging.getLogger("llmgw.runtime")


class TaskDied(RuntimeError):
    """A task meant to run as long as the process ended (returned, raised or was cancelled)."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task_name = task.get_name()
        if task.cancelled():
            how = "was cancelled"
        elif (e := task.exception()) is not None:
            how = f"raised {type(e).__name__}: {e}"
            self.__cause__ = e
        else:
            how = "returned"
        super().__init__(f"task {self.task_name} {how}")


async def until_stopped(stop: asyncio.Event, tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Wait until ``stop`` is set; raise :class:`TaskDied` as soon as one of ``tasks`` ends first.

    A service's loops run for its whole life, so one that ends is a bug whatever the way: the process
    must not linger half-alive (a control plane renewing its lease without reconciling). The caller's
    ``finally`` cancels the others and cleans up; :func:`run_service` then exits with
    :data:`EXIT_TASK_DIED`.
    """
    waiter = asyncio.create_task(stop.wait(), name="stop")
    try:
        done, _ = await asyncio.wait({waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if stop.is_set():
        return  # loops that end because of the stop are not deaths
    dead = sorted((t for t in done if t is not waiter), key=lambda t: t.get_name())
    raise TaskDied(dead[0])


def raise_if_died(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Raise :class:`TaskDied` for one of ``tasks`` that has ended (the first by name), else nothing.

    For loops the service starts and retires as its work changes: pass only the *current* ones (a
    retired loop ends on purpose), and call it on each periodic pass. The same policy as
    :func:`until_stopped`: the caller's ``finally`` cleans up and :func:`run_service` exits 70.
    """
    dead = sorted((t for t in tasks if t.done()), key=lambda t: t.get_name())
    if dead:
        raise TaskDied(dead[0])


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], again_s: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every ``again_s``.

    Python 3.11's ``asyncio.wait_for``, which nats-py's request and flush use, drops a cancel that lands
    as its answer arrives (CPython gh-86296): a loop around such a call goes on, and a stop that cancels
    once waits for it for ever. Their results and errors are dropped: the caller is stopping them.

    Cancelled itself meanwhile (a service's stop cancelled during its stop), this still goes on until the
    tasks have ended, and only then raises that CancelledError: returning at once would leave a task
    that swallowed its cancel running with no one left to cancel it again. So it is no more bounded
    than without that cancel: a task that never ends, even cancelled, is waited for as long.
    """
    pending = list(tasks)
    for t in pending:
        t.cancel()
    interrupted: asyncio.CancelledError | None = None
    for t in pending:
        while not t.done():
            try:
                await asyncio.wait((t,), timeout=again_s)
            except asyncio.CancelledError as e:
                interrupted = e  # re-raised once the tasks have ended
            t.cancel()
        if not t.cancelled():
            t.exception()  # retrieved, so asyncio does not log it as never retrieved
    if interrupted is not None:
        raise interrupted


class FailedPasses(RuntimeError):
    """A loop's passes kept failing: the loop gives up so that the process exits (and is replaced)."""


class PassGuard:
    """The failure policy of one loop's passes.

    A pass that raises is logged (with its traceback when the error is new) and counted, and the loop
    goes on: one bad input must not stop the loop. ``limit`` failures in a row (None: no limit), the
    first of them at least ``min_span_s`` ago (so that a burst of passes is not "for long"), raise
    :class:`FailedPasses` from the last error, for a loop whose process should rather be replaced than
    go on failing (a leader that cannot reconcile must not hold the lease for ever).
    """

    def __init__(
        self,
        name: str,
        logger: logging.Logger,
        limit: int | None = None,
        *,
        min_span_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.log = logger
        self.limit = limit
        self.min_span_s = min_span_s
        self.clock = clock
        self.failed = 0
        self.in_a_row = 0
        self._since = 0.0
        self._last = ""

    def ok(self) -> None:
        self.in_a_row = 0
        self._last = ""

    def failure(self, e: Exception) -> None:
        now = self.clock()
        if self.in_a_row == 0:
            self._since = now
        self.failed += 1
        self.in_a_row += 1
        what = f"{type(e).__name__}: {e}"
        self.log.error(
            "%s pass failed (%d in a row, %d in all): %s",
            self.name, self.in_a_row, self.failed, what,
            exc_info=e if what != self._last else None,  # one traceback per distinct error
        )  # fmt: skip
        self._last = what
        span = now - self._since
        if self.limit is not None and self.in_a_row >= self.limit and span >= self.min_span_s:
            raise FailedPasses(
                f"{self.name}: {self.in_a_row} passes in a row failed over {span:.0f}s; giving up"
            ) from e
