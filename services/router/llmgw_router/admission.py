"""Per-model admission: at most ``limit`` concurrent requests, a bounded FIFO queue beyond, a max wait.

A model without a limit admits everything (no queue, no bookkeeping beyond a counter). The gate is
per router; the catalog's ``max_concurrency`` is "per router" by definition.
"""

from __future__ import annotations

import asyncio
import collections

from llmgw_common.errors import Refused


class AdmissionRefused(Refused):
    """The request could not be admitted; ``reason`` in the user's terms, ``retry_after`` in seconds."""

    def __init__(self, reason: str, retry_after: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _Expired(Exception):
    """A queued request's wait ran out (set on its future by the gate's timer)."""


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


def _admitted(fut: asyncio.Future[None]) -> bool:
    """Whether the gate handed this waiter a slot (rather than its timer or a cancel ending the wait)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


class Gate:
    __slots__ = ("active", "held", "limit", "max_queue", "model", "queue_timeout_s", "waiters")

    def __init__(self, model: str, limit: int | None, max_queue: int, queue_timeout_s: float) -> None:
        self.model = model
        self.limit = limit
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        # Requests held for this model while it has no ready endpoint (holding.py): they take places
        # in the same bounded queue, so a burst while a replica starts cannot hold unbounded memory.
        self.held = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def configure(self, limit: int | None, max_queue: int, queue_timeout_s: float) -> None:
        self.limit, self.max_queue, self.queue_timeout_s = limit, max_queue, queue_timeout_s
        self._wake()

    def try_enter(self) -> bool:
        """Admit at once when there is room and nobody is queued ahead."""
        if self.limit is None or (self.active < self.limit and not self.waiters):
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        """Admit or wait in the queue; AdmissionRefused when the queue is full or the wait too long."""
        if self.try_enter():
            return
        if len(self.waiters) + self.held >= self.max_queue:
            raise AdmissionRefused(
                f"model {self.model!r} is at its limit of {self.limit} concurrent requests and its "
                f"queue of {self.max_queue} is full",
                retry_after=1,
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiters.append(fut)
        # Our own timer on the future, not asyncio.wait_for: on Python 3.11 wait_for returns normally
        # when the task is cancelled in the instant the slot is handed over, swallowing the cancel, so
        # a request whose client has gone would run to its end holding the slot.
        timer = loop.call_later(self.queue_timeout_s, _expire, fut)
        try:
            await fut
        except _Expired:
            raise AdmissionRefused(
                f"model {self.model!r} is at its limit of {self.limit} concurrent requests; "
                f"waited {self.queue_timeout_s:g}s in the queue",
                retry_after=max(1, int(self.queue_timeout_s)),
            ) from None
        except asyncio.CancelledError:
            if _admitted(fut):
                self.leave()  # the slot was handed to us as we were cancelled: pass it on
            raise
        finally:
            timer.cancel()
            try:
                self.waiters.remove(fut)
            except ValueError:
                pass

    def leave(self) -> None:
        self.active -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiters and (self.limit is None or self.active < self.limit):
            fut = self.waiters.popleft()
            if fut.done():
                continue
            self.active += 1
            fut.set_result(None)
