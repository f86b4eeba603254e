"""When this router last sent a request to each replica (ARCHITECTURE #1: unknown is not idle).

The map is stamped where the endpoint is taken: one dict store, no lock (one event loop), no message
per request. A replica this router never routed to is absent from the map, never 0.
"""

from __future__ import annotations

from llmgw_common.messages import IdleReport


class IdleMap:
    __slots__ = ("last_used", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.last_used: dict[str, float] = {}

    def stamp(self, replica_id: str, now: float) -> None:
        self.last_used[replica_id] = now

    def report(self, router: str, now: float, breakers: dict[str, str] | None = None) -> IdleReport:
        return IdleReport(
            router=router,
            since=self.since,
            sent_at=now,
            last_used=dict(self.last_used),
            breakers=breakers or {},
        )
