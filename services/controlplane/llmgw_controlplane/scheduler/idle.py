"""Merging routers' idle maps into per-replica idle knowledge (ARCHITECTURE #1: unknown is not idle).

Each router sends, once a tick, its start time (``since``) and the last time it routed to each replica.
The merge keeps, per router, its newest report; a router that stops reporting is forgotten after
``stale_s`` by the control plane's own clock, but not what its silence means: it reported up to its
last report, and what it did after that (its last tick, or more if it is cut off but still routing) is
not known. The *horizon* is the latest such last report (a router restarted under the same id departs
too). For one replica:

- a reporting router saw it used after the horizon: idle for ``now - newest last use``;
- otherwise: idle for *at least* ``now - max(horizon, max(since))`` (the youngest router limits what is
  known: before it started, a router that has since gone unseen may have used it; a router seen going
  may have used it up to its last report, even if it said it had used it earlier), and never longer than
  the replica has existed. A departed router's knowledge thus only ever shortens the bound;
- no router reports at all: unknown, which is neither zero nor forever.

A report's times are the router's claims: one that is not a finite time or lies in the future by our
clock is dropped with one log line (:mod:`llmgw_runtime.clockcheck`), and a kept report outranks the
router's later ones only by the time it arrived, so a forged ``sent_at`` cannot freeze a router's view.
A report naming more than ``max_report_entries`` replicas is refused likewise: a forger with the router
role could otherwise have ~1 MiB reports (~40,000 replicas, ~7 MB decoded) kept under invented ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from llmgw_common.durations import format_duration
from llmgw_common.router_messages import IdleReport
from llmgw_runtime.clockcheck import Doubts, distrust, distrust_all, order_time

# Replicas one report may name (last uses and breakers together); a cluster has far fewer.
MAX_REPORT_ENTRIES = 10_000


class IdleKind(StrEnum):
    UNKNOWN = "unknown"
    EXACT = "exact"
    AT_LEAST = "at_least"


@dataclass(frozen=True, slots=True)
class IdleKnowledge:
    kind: IdleKind
    # Seconds idle (EXACT) or the lower bound (AT_LEAST); None when UNKNOWN.
    seconds: float | None = None
    # A router has a request on it in flight right now: in use, whatever the seconds say.
    busy: bool = False

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
        return not self.busy and self.seconds is not None and self.seconds >= threshold_s


UNKNOWN = IdleKnowledge(IdleKind.UNKNOWN)


@dataclass(frozen=True, slots=True)
class _RouterView:
    since: float
    # What later reports of the same router are compared with: never later than it arrived.
    order: float
    received_at: float
    last_used: dict[str, float]
    # replica -> "open" | "half_open" (closed breakers are absent)
    breakers: dict[str, str]
    in_flight: frozenset[str]


class IdleMerger:
    """Routers' idle reports, merged. Pure: time comes in as arguments."""

    def __init__(
        self, stale_s: float, doubts: Doubts | None = None, max_report_entries: int = MAX_REPORT_ENTRIES
    ) -> None:
        self.stale_s = stale_s
        self.max_report_entries = max_report_entries
        self.doubts = doubts or Doubts(logging.getLogger("llmgw.controlplane"))
        self._routers: dict[str, _RouterView] = {}
        # The latest last report (our clock) of a router that is gone: what it did after is not known.
        self.horizon = float("-inf")

    def add(self, report: IdleReport, received_at: float) -> None:
        why = distrust(report.sent_at, received_at) or distrust(report.since, received_at, "since")
        why = why or distrust_all(report.last_used, received_at, "last use of")
        n = len(report.last_used) + len(report.breakers) + len(report.in_flight)
        if why is None and n > self.max_report_entries:
            why = f"{n} replicas named (at most {self.max_report_entries} kept per report)"
        if why is not None:
            self.doubts.refuse(f"router {report.router}", "idle report", why, received_at)
            return
        cur = self._routers.get(report.router)
        if cur is not None:
            if cur.since != report.since:
                # Restarted under the same id: the old run is gone, known up to its last report.
                self.horizon = max(self.horizon, cur.received_at)
            elif cur.order > report.sent_at:
                return  # a delayed older report never replaces a newer one from the same router
        self._routers[report.router] = _RouterView(
            report.since,
            order_time(report.sent_at, received_at),
            received_at,
            dict(report.last_used),
            dict(report.breakers),
            frozenset(report.in_flight),
        )

    def prune(self, now: float) -> list[str]:
        """Forget routers silent for longer than ``stale_s`` (moving the horizon); returns their ids."""
        gone = [r for r, v in self._routers.items() if now - v.received_at > self.stale_s]
        for r in gone:
            self.horizon = max(self.horizon, self._routers.pop(r).received_at)
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

    def in_flight(self, replica: str) -> bool:
        """Whether a reporting router has a request on ``replica`` in flight."""
        return any(replica in v.in_flight for v in self._routers.values())

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
        if self.in_flight(replica):
            return IdleKnowledge(IdleKind.EXACT, 0.0, busy=True)
        if used is not None and used >= self.horizon:
            return IdleKnowledge(IdleKind.EXACT, max(0.0, now - used))
        start = max(self.horizon, max(v.since for v in self._routers.values()))
        if created is not None:
            start = max(start, created)
        return IdleKnowledge(IdleKind.AT_LEAST, max(0.0, now - start))
