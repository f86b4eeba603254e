"""Merging routers' idle maps into per-replica idle knowledge (ARCHITECTURE #1: unknown is not idle).

Each router sends, once a tick, its start time (``since``) and the last time it routed to each replica.
The merge keeps, per router, its newest report; a router that stops reporting is forgotten after
``stale_s`` by the control plane's own clock. For one replica:

- some router saw it used: idle for ``now - newest last use`` (newest timestamp wins);
- no reporting router saw it used: idle for *at least* ``now - max(since)`` (the youngest router limits
  what is known: before it started, a router that has since gone may have used it), and never longer
  than the replica has existed;
- no router reports at all: unknown, which is neither zero nor forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmgw_common.durations import format_duration
from llmgw_common.messages import IdleReport


class IdleKind(StrEnum):
    UNKNOWN = "unknown"
    EXACT = "exact"
    AT_LEAST = "at_least"


@dataclass(frozen=True, slots=True)
class IdleKnowledge:
    kind: IdleKind
    # Seconds idle (EXACT) or the lower bound (AT_LEAST); None when UNKNOWN.
    seconds: float | None = None

    @property
    def known(self) -> bool:
        return self.kind is not IdleKind.UNKNOWN

    def json_seconds(self) -> float:
        """The architecture's JSON form: a negative number for unknown."""
        return -1.0 if self.seconds is None else round(self.seconds, 3)

    def text(self) -> str:
        """Table form: ``-`` unknown, ``12m`` exact, ``>=3d`` a lower bound."""
        if self.seconds is None:
            return "-"
        d = format_duration(self.seconds)
        return d if self.kind is IdleKind.EXACT else f">={d}"

    def at_least(self, threshold_s: float) -> bool:
        """True only when it is *known* that the replica has been idle for ``threshold_s`` or more."""
        return self.seconds is not None and self.seconds >= threshold_s


UNKNOWN = IdleKnowledge(IdleKind.UNKNOWN)


@dataclass(frozen=True, slots=True)
class _RouterView:
    since: float
    sent_at: float
    received_at: float
    last_used: dict[str, float]
    # replica -> "open" | "half_open" (closed breakers are absent)
    breakers: dict[str, str]


class IdleMerger:
    """Routers' idle reports, merged. Pure: time comes in as arguments."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._routers: dict[str, _RouterView] = {}

    def add(self, report: IdleReport, received_at: float) -> None:
        cur = self._routers.get(report.router)
        # A delayed older report never replaces a newer one from the same router.
        if cur is not None and cur.since == report.since and cur.sent_at > report.sent_at:
            return
        self._routers[report.router] = _RouterView(
            report.since, report.sent_at, received_at, dict(report.last_used), dict(report.breakers)
        )

    def prune(self, now: float) -> list[str]:
        """Forget routers silent for longer than ``stale_s``; returns their ids."""
        gone = [r for r, v in self._routers.items() if now - v.received_at > self.stale_s]
        for r in gone:
            del self._routers[r]
        return gone

    @property
    def routers(self) -> tuple[str, ...]:
        return tuple(sorted(self._routers))

    def last_used(self, replica: str) -> float | None:
        best: float | None = None
        for v in self._routers.values():
            t = v.last_used.get(replica)
            if t is not None and (best is None or t > best):
                best = t
        return best

    def breaker(self, replica: str) -> str:
        """The replica's circuit breaker as the routers see it: the worst across them, ``closed`` if none
        reports one open (a router that never sent it a request has nothing to report)."""
        states = {v.breakers.get(replica) for v in self._routers.values()}
        if "open" in states:
            return "open"
        return "half_open" if "half_open" in states else "closed"

    def idle_for(self, replica: str, now: float, created: float | None = None) -> IdleKnowledge:
        """What is known about how long ``replica`` has gone unused at ``now``."""
        self.prune(now)
        if not self._routers:
            return UNKNOWN
        used = self.last_used(replica)
        if used is not None:
            return IdleKnowledge(IdleKind.EXACT, max(0.0, now - used))
        start = max(v.since for v in self._routers.values())
        if created is not None:
            start = max(start, created)
        return IdleKnowledge(IdleKind.AT_LEAST, max(0.0, now - start))
