"""When this router last sent a request to each replica (ARCHITECTURE #1: unknown is not idle).

The map is stamped where the endpoint is taken: one dict store, no lock (one event loop), no message
per request; and, once a tick, for every replica with a request still in flight. A replica this
router never routed to is absent from the map, never 0.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw_common.router_messages import IdleReport


class IdleMap:
    __slots__ = ("last_used", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.last_used: dict[str, float] = {}

    def stamp(self, replica_id: str, now: float) -> None:
        self.last_used[replica_id] = now

    def report(
        self, router: str, now: float, breakers: dict[str, str] | None = None, busy: Iterable[str] = ()
    ) -> IdleReport:
        """The map as of ``now``; ``busy``: replicas with a request in flight, used now (a stream that
        began long ago is not idle: stamped at its start alone, it would look idle for its length)."""
        in_flight = sorted(busy)
        for replica_id in in_flight:
            self.last_used[replica_id] = now
        return IdleReport(
            router=router,
            since=self.since,
            sent_at=now,
            last_used=dict(self.last_used),
            breakers=breakers or {},
            in_flight=in_flight,
        )
