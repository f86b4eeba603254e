"""Tokens per API key and model, merged from the routers' usage reports.

Each router reports, once a tick, everything it counted since it started. The book keeps each router's
newest report and sums across routers, so a report lost or repeated changes nothing. A router that
restarts comes back under a new id; its old report stays counted (it is what that process served).

A report whose times are not finite or lie in the future by our clock is dropped with one log line, and
a kept report outranks the router's later ones only by when it arrived (:mod:`llmgw_runtime.clockcheck`):
one forged ``sent_at`` cannot make every genuine report after it look old.

What is kept is bounded by entries (key/model pairs), not only by routers: a forger with the router role
can send reports near the bus's 1 MiB limit (~45,000 entries, ~17 MB once decoded) under many invented
router ids. A report with more than ``max_report_entries`` is refused (one log line per router and
minute); past ``max_entries`` in all, the routers heard from longest ago are forgotten first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmgw_common.router_messages import UsageReport
from llmgw_runtime.clockcheck import Doubts, distrust, order_time

# Routers remembered at most; past it the one heard from longest ago is forgotten first.
MAX_ROUTERS = 1024
# Key/model pairs in one report at most (a genuine router counts keys x models it served); more: refused.
MAX_REPORT_ENTRIES = 100_000
# Key/model pairs kept across all routers (about 400 MB at worst); past it, as past MAX_ROUTERS.
MAX_ENTRIES = 1_000_000


def entries(report: UsageReport) -> int:
    return sum(len(per_model) for per_model in report.usage.values())


@dataclass(frozen=True, slots=True)
class UsageRow:
    key: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class UsageView:
    """What the Usage page shows: rows by total tokens, largest first."""

    routers: int
    # The earliest start among the counted routers: the totals cover from then on.
    since: float | None
    # When the newest report arrived, by the control plane's clock.
    updated_at: float | None
    rows: tuple[UsageRow, ...]


class UsageBook:
    def __init__(
        self,
        max_routers: int = MAX_ROUTERS,
        doubts: Doubts | None = None,
        max_report_entries: int = MAX_REPORT_ENTRIES,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.max_routers = max_routers
        self.max_report_entries = max_report_entries
        self.max_entries = max_entries
        self.doubts = doubts or Doubts(logging.getLogger("llmgw.controlplane"))
        # router -> (its newest report, when it arrived by our clock)
        self._reports: dict[str, tuple[UsageReport, float]] = {}
        # router -> its kept report's entries, and their sum
        self._entries: dict[str, int] = {}
        self._total = 0

    def add(self, report: UsageReport, now: float) -> None:
        """Keep ``report`` unless this router already sent a newer one (reports can arrive out of order)."""
        why = distrust(report.sent_at, now) or distrust(report.since, now, "since")
        n = entries(report)
        if why is None and n > self.max_report_entries:
            why = f"{n} key/model entries (at most {self.max_report_entries} kept per report)"
        if why is not None:
            self.doubts.refuse(f"router {report.router}", "usage report", why, now)
            return
        old = self._reports.get(report.router)
        if old is not None and order_time(old[0].sent_at, old[1]) > report.sent_at:
            return
        self._reports[report.router] = (report, now)
        self._total += n - self._entries.get(report.router, 0)
        self._entries[report.router] = n
        while len(self._reports) > 1 and (
            len(self._reports) > self.max_routers or self._total > self.max_entries
        ):
            oldest = min((r for r in self._reports if r != report.router), key=lambda r: self._reports[r][1])
            del self._reports[oldest]
            self._total -= self._entries.pop(oldest)

    def view(self) -> UsageView:
        totals: dict[tuple[str, str], list[int]] = {}
        for rep, _ in self._reports.values():
            for key, per_model in rep.usage.items():
                for model, (requests, prompt, completion) in per_model.items():
                    t = totals.setdefault((key, model), [0, 0, 0])
                    t[0] += requests
                    t[1] += prompt
                    t[2] += completion
        rows = sorted(
            (UsageRow(k, m, t[0], t[1], t[2]) for (k, m), t in totals.items()),
            key=lambda r: (-r.total_tokens, -r.requests, r.key, r.model),
        )
        reports = self._reports.values()
        return UsageView(
            routers=len(self._reports),
            since=min((r.since for r, _ in reports), default=None),
            updated_at=max((at for _, at in reports), default=None),
            rows=tuple(rows),
        )
