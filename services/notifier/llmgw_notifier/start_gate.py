"""Order across a restart: which events a target's worker may send while the events a dead notifier
held are still to come back (pure; the worker passes its clock's time in)."""

from __future__ import annotations

from collections.abc import Iterable


class StartGate:
    """After a restart, the events a dead notifier held come back only once their ack wait lapses;
    newer events must not overtake them. Until as many of the old ones as were outstanding have come
    back (or a deadline passes, in case some were acknowledged out of order), only events at or below
    the last sequence the consumer had handed out may be sent."""

    def __init__(
        self, last_delivered: int, outstanding: int, deadline: float, already: Iterable[int] = ()
    ) -> None:
        self.last_delivered = last_delivered
        self.outstanding = outstanding
        self.deadline = deadline
        self.seen: set[int] = {s for s in already if s <= last_delivered}

    def saw(self, seq: int) -> None:
        if seq <= self.last_delivered:
            self.seen.add(seq)

    def is_open(self, now: float) -> bool:
        return len(self.seen) >= self.outstanding or now >= self.deadline

    def admits(self, seq: int, now: float) -> bool:
        return seq <= self.last_delivered or self.is_open(now)
