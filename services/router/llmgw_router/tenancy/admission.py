"""Per-model admission: at most ``limit`` concurrent requests, a bounded queue beyond, a max wait.

A model without a limit admits everything (no queue, no bookkeeping beyond a counter). The gate is
per router; the catalog's ``max_concurrency`` is "per router" by definition.

The queue is fair across keys, by weight (``ApiKeyRecord.weight``), not first come: start-time fair
queueing. Each waiter gets a start tag, its key's previous finish tag or the gate's virtual time (the
start tag served last), whichever is later; its key's finish tag is that plus 1/weight; a freed slot
goes to the smallest start tag. A key with one request waiting is served
within about one slot per other waiting key, however many another key has queued; keys that all
flood share the slots in proportion to their weights. Within one key, first come first served. A
full queue refuses the waiter that would be served last, not the newcomer, when the newcomer would be
served before it: a flood that fills the queue does not lock a light key out of it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Mapping

from llmgw_common.catalog import ModelProfile
from llmgw_common.errors import Refused


class AdmissionRefused(Refused):
    """The request could not be admitted; ``reason`` in the user's terms, ``retry_after`` in seconds."""

    def __init__(self, reason: str, retry_after: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _Expired(Exception):
    """A queued request's wait ran out (set on its future by the gate's timer)."""


class _PushedOut(Exception):
    """A queued request's place went to one that would be served before it (the queue was full)."""


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


def _admitted(fut: asyncio.Future[None]) -> bool:
    """Whether the gate handed this waiter a slot (rather than its timer or a cancel ending the wait)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


class Gate:
    __slots__ = (
        "_heap",
        "_last",
        "_live",
        "_seq",
        "_vtime",
        "active",
        "held",
        "limit",
        "max_queue",
        "model",
        "queue_timeout_s",
    )

    def __init__(self, model: str, limit: int | None, max_queue: int, queue_timeout_s: float) -> None:
        self.model = model
        self.limit = limit
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        # Requests held for this model while it has no ready endpoint (holding.py): they take places
        # in the same bounded queue, so a burst while a replica starts cannot hold unbounded memory.
        self.held = 0
        # (tag, arrival, future): a waiter whose wait ended (timer, cancel) stays until popped or
        # compacted; ``_live`` counts the others.
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._live = 0
        self._seq = itertools.count()
        # The tag of the waiter served last, and each key's last tag while it is ahead of that.
        self._vtime = 0.0
        self._last: dict[str, float] = {}

    @property
    def queued(self) -> int:
        return self._live

    @property
    def waiters(self) -> list[asyncio.Future[None]]:
        """The futures of the requests waiting now, in no particular order."""
        return [f for _, _, f in self._heap if not f.done()]

    def configure(self, limit: int | None, max_queue: int, queue_timeout_s: float) -> None:
        self.limit, self.max_queue, self.queue_timeout_s = limit, max_queue, queue_timeout_s
        self._wake()

    def try_enter(self) -> bool:
        """Admit at once when there is room and nobody is queued ahead."""
        if self.limit is None or (self.active < self.limit and not self._live):
            self.active += 1
            return True
        return False

    def _tag(self, key: str, weight: float) -> float:
        """The waiter's start tag (what the queue is ordered by); its key's finish tag moves on by
        1/weight. Ordered by start, not finish: a key with nothing queued starts at the virtual time,
        the start of the request served last, so it goes before a flood's next request (whose start
        is one past that), not tied with it behind the flood's earlier arrival."""
        start = max(self._vtime, self._last.get(key, 0.0))
        if len(self._last) > 4 * self.max_queue + 64:
            # Keys whose last tag the virtual time has passed start from it anyway: forget them.
            self._last = {k: t for k, t in self._last.items() if t > self._vtime}
        self._last[key] = start + 1.0 / weight
        return start

    async def enter(self, key: str = "", weight: float = 1.0) -> None:
        """Admit or wait in the queue; AdmissionRefused when the queue is full or the wait too long.
        ``key`` and ``weight``: whose request it is, for the fair share of the slots."""
        if self.try_enter():
            return
        if self._live + self.held >= self.max_queue and not self._push_out(key, weight):
            raise self._full()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._heap, (self._tag(key, weight), next(self._seq), fut))
        self._live += 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if not e[2].done()]  # ended waits, compacted
            heapq.heapify(self._heap)
        if self.limit is None or self.active < self.limit:
            # Room, but a waiter ahead had not yet left the count when we looked (its wait just ended):
            # serve the queue now rather than wait for a leave() that may not come.
            self._wake()
        # Our own timer on the future, not asyncio.wait_for: on Python 3.11 wait_for returns normally
        # when the task is cancelled in the instant the slot is handed over, swallowing the cancel, so
        # a request whose client has gone would run to its end holding the slot.
        timer = loop.call_later(self.queue_timeout_s, _expire, fut)
        try:
            await fut
        except _PushedOut:
            raise self._full() from None
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
            if not _admitted(fut):
                self._live -= 1  # still in the heap, done: skipped when popped
                if self._live:
                    self._wake()  # one waiting behind us may have room now that we have gone

    def _full(self) -> AdmissionRefused:
        return AdmissionRefused(
            f"model {self.model!r} is at its limit of {self.limit} concurrent requests and its "
            f"queue of {self.max_queue} is full",
            retry_after=1,
        )

    def _push_out(self, key: str, weight: float) -> bool:
        """A full queue: the waiter that would be served last gives its place to this request when
        this one would be served before it (a flood fills the queue; a light key still gets in)."""
        tag = max(self._vtime, self._last.get(key, 0.0))
        last = max(((t, n, f) for t, n, f in self._heap if not f.done()), default=None)
        if last is None or last[0] <= tag:
            return False
        last[2].set_exception(_PushedOut())
        return True

    def leave(self) -> None:
        self.active -= 1
        self._wake()

    def _wake(self) -> None:
        heap = self._heap
        while heap and (self.limit is None or self.active < self.limit):
            tag, _, fut = heapq.heappop(heap)
            if fut.done():
                continue
            self._vtime = tag
            self._live -= 1
            self.active += 1
            fut.set_result(None)


class Gates:
    """Each model's gate, made on its first request with the catalog's settings."""

    __slots__ = ("by_model",)

    def __init__(self) -> None:
        self.by_model: dict[str, Gate] = {}

    def of(self, profile: ModelProfile) -> Gate:
        g = self.by_model.get(profile.name)
        if g is None:
            g = self.by_model[profile.name] = Gate(
                profile.name, profile.max_concurrency, profile.max_queue, profile.queue_timeout_s
            )
        return g

    def configure(self, profiles: Mapping[str, ModelProfile]) -> None:
        """Apply the catalog's admission settings to existing gates (after a catalog update)."""
        for name, g in self.by_model.items():
            p = profiles.get(name)
            if p is not None:
                g.configure(p.max_concurrency, p.max_queue, p.queue_timeout_s)
