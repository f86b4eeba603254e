"""Per-key and per-team limits, held across routers without a central hop. Pure: every call takes
``now``; nothing here reads a clock or touches the bus (service.py carries the reports).

A *meter* is one set of limits: a key's over every model (``k:<id>``), a key's for one model
(``k:<id>/<model>``), and the same for its team (``t:<team>``, ``t:<team>/<model>``). A request is
admitted only when every meter it falls under admits it. Each meter counts in fixed windows aligned
to the UTC minute (requests, tokens), day and month (token budgets), plus the requests in flight.

Across routers: each router admits from its own *allowance* of each limit, recomputed every tick
(and when a window turns) by :func:`share` from its own exact counts and its peers' last reports
(``UsageReport.quota``): its own use plus a part of what remains, in proportion to where the demand
was in the last tick. Reports carry whole window counts, not increments, so a lost report is made
good by the next one and a repeated one counts nothing twice; peers not heard for 3 ticks are
forgotten (what they admitted in the open windows stays counted). The bound this gives is in
``docs/tenancy.md``. The meters themselves: ``meter.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw_common.messages import ApiKeyRecord, KeyLimits, Limits, UsageHour
from llmgw_common.router_messages import QuotaUse, UsageReport
from llmgw_common.tenancy import day_start, minute_start, month_bounds
from llmgw_router.errors import RouterError
from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.meter import Meter, Peer, rate_headers, share
from llmgw_runtime.usage_ledger import spent

__all__ = ["Quotas", "Ticket", "meter_id", "share"]

# A peer silent for this many ticks is gone (stopped, partitioned): its share returns to the others.
FORGET_TICKS = 3
_NONE = Limits()


def meter_id(kind: str, name: str, model: str | None) -> str:
    return f"{kind}:{name}" if model is None else f"{kind}:{name}/{model}"


class Ticket:
    """An admitted request's hold on its meters: ``release()`` in the same ``finally`` as the gate."""

    __slots__ = ("meters", "minute", "sent")

    def __init__(self, meters: tuple[Meter, ...], minute: float) -> None:
        self.meters = meters
        self.minute = minute
        # Set when the request goes to an engine; one the router itself refused (the model's queue
        # full, nothing coming) is given back to the minute it was counted in.
        self.sent = False

    def header_lines(self, now: float) -> bytes:
        """The x-ratelimit-* header lines of an admitted request (what is left after it)."""
        return b"".join(f"{k}: {v}\r\n".encode() for k, v in rate_headers(self.meters, now).items())

    def release(self) -> None:
        for m in self.meters:
            m.in_flight -= 1
            if not self.sent and m.minute == self.minute:
                m.requests -= 1
                m.tick_requests -= 1


class Quotas:
    """Every meter of this router, resolved from the key table (rebuilt when it changes)."""

    def __init__(self, keys: KeyTable, router_id: str, tick_s: float = 1.0) -> None:
        self.keys, self.router_id, self.tick_s = keys, router_id, tick_s
        self.meters: dict[str, Meter] = {}
        # (key id, model) -> its meters; emptied when the key table changes.
        self._cache: dict[tuple[str, str], tuple[Meter, ...]] = {}
        self._version = -1
        # Key ids with meters: the usage hook's one check (a key without limits costs a set lookup).
        self.active: set[str] = set()
        # meter id -> router -> its last report of it; router -> (since, seq) last taken, when heard.
        self.peers: dict[str, dict[str, Peer]] = {}
        self._seen: dict[str, tuple[float, int, float]] = {}
        # What incarnations not heard from spent of day and month budgets, from the durable ledger at
        # start (load_spent): incarnation -> key id -> model -> (day, month) tokens; and those windows.
        self._spent: dict[tuple[str, float], dict[str, dict[str, tuple[int, int]]]] = {}
        self._spent_in = (0.0, 0.0)

    # ------------------------------------------------------------ resolving

    def meters_for(self, rec: ApiKeyRecord, model: str, now: float) -> tuple[Meter, ...]:
        if self._version != self.keys.version:
            self._refresh(now)
        got = self._cache.get((rec.id, model))
        if got is None:
            found: list[Meter] = []
            self._add(found, "k", rec.id, f"key {rec.name!r}", rec.limits, model, now)
            team = self.keys.teams.get(rec.team) if rec.team is not None else None
            if team is not None:
                self._add(found, "t", team.name, f"team {team.name!r}", team.limits, model, now)
            got = self._cache[(rec.id, model)] = tuple(found)
            self.active.add(rec.id)
        return got

    def _add(
        self,
        out: list[Meter],
        kind: str,
        name: str,
        label: str,
        limits: KeyLimits | None,
        model: str,
        now: float,
    ) -> None:
        if limits is None:
            return
        for mid, lim, lab in (
            (meter_id(kind, name, None), limits, label),
            (meter_id(kind, name, model), limits.models.get(model), f"{label} for model {model!r}"),
        ):
            if lim is None or Limits.empty(lim):
                continue
            m = self.meters.get(mid)
            if m is None:
                peers = self.peers.setdefault(mid, {})
                m = self.meters[mid] = Meter(mid, lab, lim, peers, self._seen, self.tick_s, self.router_id)
                if self._spent:
                    self._seed(m, kind, name, None if mid == meter_id(kind, name, None) else model, now)
            elif m.limits != lim:
                m.limits = lim
                m.recompute(now)
            m.roll(now)
            out.append(m)

    def load_spent(self, hours: Iterable[UsageHour], now: float) -> None:
        """The ledger's hours of this month, read at start: a budget spent before a router restart
        (or by a router gone) stays spent. Taken as retired peers of each meter (named as
        ``_retire`` names them), so a router heard again under that incarnation supersedes it."""
        day, month = day_start(now), month_bounds(now)[0]
        live = {(r, since) for r, (since, _, _) in self._seen.items()}
        self._spent = spent(hours, day, month, live)
        self._spent_in = (day, month)
        for mid, m in self.meters.items():
            kind, _, rest = mid.partition(":")
            name, _, model = rest.partition("/")
            self._seed(m, kind, name, model or None, now)

    def _seed(self, m: Meter, kind: str, name: str, model: str | None, now: float) -> None:
        day, month = self._spent_in
        if day != day_start(now):
            return  # read in another day: the budgets' windows have turned since
        for (router, since), per_key in self._spent.items():
            seen = self._seen.get(router)
            inc = f"{router}@{since}"
            if (seen is not None and seen[0] == since) or inc in m.peers:
                continue
            if kind == "k":
                ids = [name]
            else:
                ids = [k for k in per_key if (r := self.keys.by_id(k)) is not None and r.team == name]
            d = mo = 0
            for kid in ids:
                for mdl, (dt, mt) in per_key.get(kid, {}).items():
                    if model is None or mdl == model:
                        d, mo = d + dt, mo + mt
            if d or mo:
                use = QuotaUse(minute=-1.0, day=day, day_tokens=d, month=month, month_tokens=mo)
                m.peers[inc] = Peer(use, now)
        m.recompute(now)

    def _refresh(self, now: float) -> None:
        """The key table changed: meters are resolved again (counts kept), limits taken anew."""
        self._version = self.keys.version
        self._cache.clear()
        self.active.clear()
        for mid, m in list(self.meters.items()):
            lim = self._limits_of(mid) or _NONE
            if lim is _NONE and m.in_flight == 0:
                del self.meters[mid]
            elif lim != m.limits:
                m.limits = lim  # none left while requests are in flight: gone once they end
                m.recompute(now)

    def _limits_of(self, mid: str) -> Limits | None:
        kind, _, rest = mid.partition(":")
        name, _, model = rest.partition("/")
        limits: KeyLimits | None = None
        if kind == "k":
            rec = self.keys.by_id(name)
            limits = rec.limits if rec is not None and not rec.revoked else None
        else:
            team = self.keys.teams.get(name)
            limits = team.limits if team is not None else None
        if limits is None:
            return None
        lim: Limits | None = limits.models.get(model) if model else limits
        return None if lim is None or Limits.empty(lim) else lim

    # ------------------------------------------------------------ the request path

    def admit(self, rec: ApiKeyRecord, model: str, now: float) -> Ticket | RouterError:
        """A ticket, or the 429 answer (every meter checked before any is counted)."""
        meters = self.meters_for(rec, model, now)
        for m in meters:
            m.roll(now)
            m.attempts += 1
        for m in meters:
            refused = m.refusal(now)
            if refused is not None:
                headers = rate_headers(meters, now)
                headers["Retry-After"] = str(refused.retry_after)
                return RouterError(429, refused.message, code=refused.code, headers=headers)
        for m in meters:
            m.requests += 1
            m.tick_requests += 1
            m.in_flight += 1
        return Ticket(meters, minute_start(now))

    def add_tokens(self, key_id: str, model: str, tokens: int, now: float) -> None:
        """Tokens used: a stream's as they pass, an answer's usage once known (less what its stream
        was charged: negative when the events were more than its tokens)."""
        rec = self.keys.by_id(key_id)
        if rec is None or not rec.limited or tokens == 0:
            return
        for m in self.meters_for(rec, model, now):
            m.roll(now)
            m.tokens += tokens
            m.day_tokens += tokens
            m.month_tokens += tokens
            m.tick_tokens += tokens

    # ------------------------------------------------------------ the bus (service.py)

    def tick(self, now: float) -> None:
        """Once per tick, before the report: forget silent peers, move demand on, recompute shares."""
        gone = [r for r, (_, _, at) in self._seen.items() if now - at > FORGET_TICKS * self.tick_s]
        for r in gone:
            since = self._seen.pop(r)[0]
            self._retire(r, since)
        if gone or len(self._seen) < sum(len(p) for p in self.peers.values()):
            self._drop_retired(now)
        if self._version != self.keys.version:
            self._refresh(now)
        for mid, m in list(self.meters.items()):
            if m.limits is _NONE and m.in_flight == 0:
                del self.meters[mid]
            else:
                m.tick(now)

    def _retire(self, router: str, since: float) -> None:
        """A router gone (silent, or restarted): no longer shared with, but its counts in the open
        windows are kept under its incarnation's name (not a live router's) until they end."""
        for peers in self.peers.values():
            p = peers.pop(router, None)
            if p is not None:
                peers[f"{router}@{since}"] = p

    def _drop_retired(self, now: float) -> None:
        minute, day, month = minute_start(now), day_start(now), month_bounds(now)[0]
        for peers in self.peers.values():
            for name in [n for n in peers if n not in self._seen]:
                u = peers[name].use
                if not (
                    (u.minute == minute and (u.requests or u.tokens))
                    or (u.day == day and u.day_tokens)
                    or (u.month == month and u.month_tokens)
                ):
                    del peers[name]

    def report(self) -> dict[str, QuotaUse]:
        return {mid: m.use() for mid, m in self.meters.items() if m.busy()}

    def on_report(self, rep: UsageReport, now: float) -> bool:
        """A peer's report; False when it is ours, a repeat or older than one taken (dropped)."""
        if rep.router == self.router_id:
            return False
        seen = self._seen.get(rep.router)
        if seen is not None and seen[0] == rep.since and rep.seq <= seen[1]:
            return False
        if seen is not None and seen[0] != rep.since:
            self._retire(rep.router, seen[0])  # restarted: what it admitted before still counts
        self._seen[rep.router] = (rep.since, rep.seq, now)
        back = f"{rep.router}@{rep.since}"  # heard again after being forgotten: its report supersedes
        for mid, peers in self.peers.items():
            peers.pop(back, None)
            if mid not in rep.quota:
                peers.pop(rep.router, None)  # it no longer uses that meter
        for mid, use in rep.quota.items():
            self.peers.setdefault(mid, {})[rep.router] = Peer(use, now)
        return True
