"""Concurrent slots with a FIFO waiting queue beyond them, so running and waiting are true counts."""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    """``slots`` requests run at once; the rest wait in arrival order.

    A freed slot is handed straight to the oldest waiter, so ``running`` never drops below the
    number of requests that hold one and a late arrival cannot overtake the queue.
    """

    __slots__ = ("_waiters", "capacity", "running")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take a slot without waiting when one is free and nobody queues before us."""
        if self.running < self.capacity and not self._waiters:
            self.running += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed over as we were cancelled: pass it on.
                self.release()
            elif fut in self._waiters:
                # Still queued (release() may already have dropped it as cancelled).
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                # Hand the slot over: running stays the same.
                fut.set_result(None)
                return
        self.running -= 1
