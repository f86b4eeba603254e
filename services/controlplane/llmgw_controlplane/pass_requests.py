"""The one way to ask the reconcile loop for a pass before its tick, and why it was asked.

The loop passes every ``tick_s`` whatever happens; a request only brings the next pass forward. Every
part that changes what a pass would see asks through :class:`PassRequests` with a :class:`PassReason`:
reports that changed the tables (``ingest``), the catalog or marks (``desired``), the bus coming back
and a wake (``service``), a new tenure (``leadership``), room freed by an eviction (``reconcile_loop``).
The reasons are counted for ``/metrics``, so an operator can see what keeps the loop busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import Counter

__all__ = ["PassReason", "PassRequests"]


class PassReason(enum.Enum):
    # A node's heartbeat, inventory or shard status changed the tables.
    REPORT = "report"
    # The catalog or the operator's marks (cordon, drain, ...) changed.
    DESIRED = "desired"
    # The bus is back: silence clocks restarted, the settling window opened.
    BUS_BACK = "bus_back"
    # A router asked for a cold model and the answer is "waking".
    WAKE = "wake"
    # This process began leading: the tables were loaded from the stored copies.
    TENURE = "tenure"
    # An eviction stopped a replica to make room: the next pass places what wanted it.
    ROOM_FREED = "room_freed"


class PassRequests:
    """Pending requests for a pass (one event, whoever asks) and how often each reason was asked."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._pending: set[PassReason] = set()
        self.counts: Counter[PassReason] = Counter()

    def request(self, why: PassReason) -> None:
        self._pending.add(why)
        self.counts[why] += 1
        self._event.set()

    @property
    def pending(self) -> frozenset[PassReason]:
        return frozenset(self._pending)

    async def wait(self, timeout: float) -> frozenset[PassReason]:
        """Until a pass is asked for, or ``timeout`` seconds; the reasons asked since the last wait (empty
        when the tick came first). Requests made while a pass runs are kept for the next wait."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        self._event.clear()
        got = frozenset(self._pending)
        self._pending.clear()
        return got
