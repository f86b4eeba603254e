"""One meter of quota.py: a set of limits counted in its UTC windows, the requests in flight, and
this router's allowance of each limit from its peers' reports (:func:`share`). Pure: every call
takes ``now``."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw_common.messages import Limits
from llmgw_common.router_messages import QuotaUse
from llmgw_common.tenancy import MINUTE, day_start, minute_start, month_bounds

# Allowance slots: one per kind of limit.
RPM, TPM, CONC, DAY, MONTH = range(5)
# A router with no demand in the last tick still gets this part of the others' mean weight, so a key
# that moves to it is not refused for a tick while the key is under its limit.
FLOOR = 0.1


def share(
    limit: float, own: float, own_demand: float, peers: Sequence[tuple[float, float, str]], me: str = ""
) -> float:
    """This router's allowance of one limit: ``own`` (its exact use) plus its part of what remains
    cluster-wide, by the demand it had against ``peers``' (use, demand, router id) of every peer.

    Parts are whole units: each router's part of the demand rounded down, and the units left by the
    rounding given one each to the largest remainders (ties: the lower router id), so routers holding
    the same reports compute parts that sum to exactly what remains, and the cluster never admits
    more than ``limit``, not even by rounding. No demand known anywhere: an equal split.
    """
    remaining = max(0.0, limit - own - sum(u for u, _, _ in peers))
    n = 1 + len(peers)
    total = own_demand + sum(d for _, d, _ in peers)
    floor = FLOOR * total / n
    weights = [(own_demand + floor if total > 0 else 1.0, me)]
    weights += [(d + floor if total > 0 else 1.0, rid) for _, d, rid in peers]
    whole = math.floor(remaining + 1e-9)
    scale = sum(w for w, _ in weights)
    parts = [(whole * w / scale, rid) for w, rid in weights]
    base = [math.floor(p + 1e-9) for p, _ in parts]
    left = whole - sum(base)
    mine = base[0]
    if left > 0:
        ranked = sorted(range(n), key=lambda i: (-(parts[i][0] - base[i]), parts[i][1]))
        mine += 1 if 0 in ranked[:left] else 0
    return own + mine


@dataclass(slots=True)
class Peer:
    use: QuotaUse
    at: float  # our clock when the report came


def _until(seconds: float) -> str:
    """OpenAI's reset format: ``20s``, ``6m0s``, ``1h2m3s``."""
    s = max(1, math.ceil(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


def _wire(allowance: float) -> float:
    return 0.0 if math.isinf(allowance) else allowance  # no limit of that kind: msgpack has no inf


class Meter:
    __slots__ = (
        "allow",
        "attempts",
        "day",
        "day_tokens",
        "demand",
        "id",
        "in_flight",
        "label",
        "last_requests",
        "last_tokens",
        "limits",
        "live",
        "me",
        "minute",
        "month",
        "month_end",
        "month_tokens",
        "peers",
        "requests",
        "tick_requests",
        "tick_s",
        "tick_tokens",
        "tokens",
    )

    def __init__(
        self,
        mid: str,
        label: str,
        limits: Limits,
        peers: dict[str, Peer],
        live: dict[str, tuple[float, int, float]],
        tick_s: float,
        me: str = "",
    ) -> None:
        self.id, self.label, self.limits, self.peers, self.tick_s = mid, label, limits, peers, tick_s
        # Every peer router heard lately (Quotas._seen): the routers this meter's limits are shared by.
        self.live = live
        self.me = me  # our router id: ties in the rounding of parts go to the lower id
        self.minute = self.day = self.month = self.month_end = -1.0
        self.requests = self.tokens = self.day_tokens = self.month_tokens = self.in_flight = 0
        # This tick's requests asked for, admitted, tokens; the last tick's (what peers are told).
        self.attempts = self.tick_requests = self.tick_tokens = 0
        self.demand = self.last_requests = self.last_tokens = 0
        self.allow = [math.inf] * 5

    # ------------------------------------------------------------ windows and shares

    def roll(self, now: float) -> None:
        """Start the windows ``now`` is past, and recompute the allowances when one turned."""
        turned = False
        ms = minute_start(now)
        if ms != self.minute:
            self.minute, self.requests, self.tokens, turned = ms, 0, 0, True
        ds = day_start(now)
        if ds != self.day:
            self.day, self.day_tokens, turned = ds, 0, True
        if not (self.month <= now < self.month_end):
            (self.month, self.month_end), self.month_tokens, turned = month_bounds(now), 0, True
        if turned:
            self.recompute(now)

    def _counts(self, u: QuotaUse, grow: float) -> tuple[float, float, float, float]:
        """A report's requests, tokens, day and month tokens in our windows (0 from another window)."""
        same_min = u.minute == self.minute
        return (
            u.requests + grow * u.tick_requests if same_min else 0.0,
            u.tokens + grow * u.tick_tokens if same_min else 0.0,
            u.day_tokens + grow * u.tick_tokens if u.day == self.day else 0.0,
            u.month_tokens + grow * u.tick_tokens if u.month == self.month else 0.0,
        )

    def _retired(self) -> list[float]:
        """What routers gone (silent, or restarted as another incarnation) admitted in our windows:
        it was admitted, so it stays taken from the limits until the windows end."""
        out = [0.0] * 5
        for name, p in self.peers.items():
            if name not in self.live:
                reqs, toks, day, month = self._counts(p.use, 0.0)
                out[RPM] += reqs
                out[TPM] += toks
                out[DAY] += day
                out[MONTH] += month
        return out

    def _peer_use(self, now: float) -> tuple[list[tuple[float, float, str]], ...]:
        """(use, demand) per live peer for each slot, in our windows. A peer's use is the larger of its
        counts (grown by its last tick's rate for the time since its report) and the allowance it
        holds until its next tick: it may admit up to that meanwhile, so it is not ours to give."""
        out: tuple[list[tuple[float, float, str]], ...] = ([], [], [], [], [])
        for router in self.live:
            p = self.peers.get(router)
            if p is None:
                # A live router that has not reported this meter is still one to share with (its
                # weight is the floor): a key's first burst on every router at once is split between
                # them all, not the whole limit taken by each.
                for uses in out:
                    uses.append((0.0, 0.0, router))
                continue
            u, d = p.use, float(p.use.demand)
            reqs, toks, day, month = self._counts(u, min(1.0, max(0.0, now - p.at) / self.tick_s))
            a = u.allow
            same_min = u.minute == self.minute
            out[RPM].append((max(reqs, a[RPM] if same_min else 0.0), d, router))
            out[TPM].append((max(toks, a[TPM] if same_min else 0.0), d, router))
            out[CONC].append((max(float(u.in_flight), a[CONC]), d, router))
            out[DAY].append((max(day, a[DAY] if u.day == self.day else 0.0), d, router))
            out[MONTH].append((max(month, a[MONTH] if u.month == self.month else 0.0), d, router))
        return out

    def recompute(self, now: float) -> None:
        lim = self.limits
        limits = (lim.rpm, lim.tpm, lim.concurrency, lim.daily_tokens, lim.monthly_tokens)
        gone = self._retired() if any(p not in self.live for p in self.peers) else [0.0] * 5
        caps = [float(x) - g if x is not None else 0.0 for x, g in zip(limits, gone, strict=True)]
        peers = self._peer_use(now)
        owns = (self.requests, self.tokens, self.in_flight, self.day_tokens, self.month_tokens)
        for slot, limit in enumerate(limits):
            self.allow[slot] = (
                math.inf
                if limit is None
                else share(caps[slot], owns[slot], self.demand, peers[slot], self.me)
            )

    def tick(self, now: float) -> None:
        """One round (ticks are aligned to the wall clock, service.py): the allowance recomputed from
        the previous round's reports with the demand we reported in it (what peers weigh us by, so
        every router splits by the same weights), then this round's demand moved on for the report."""
        self.roll(now)
        self.recompute(now)
        self.demand, self.attempts = self.attempts, 0
        self.last_requests, self.tick_requests = self.tick_requests, 0
        self.last_tokens, self.tick_tokens = self.tick_tokens, 0

    # ------------------------------------------------------------ requests

    def refusal(self, now: float) -> QuotaRefusal | None:
        lim, allow = self.limits, self.allow
        if lim.monthly_tokens is not None and self.month_tokens >= allow[MONTH]:
            return self._refuse("monthly budget", lim.monthly_tokens, "tokens", self.month_end, now, True)
        if lim.daily_tokens is not None and self.day_tokens >= allow[DAY]:
            return self._refuse("daily budget", lim.daily_tokens, "tokens", self.day + 86400.0, now, True)
        if lim.rpm is not None and self.requests >= allow[RPM]:
            return self._refuse("limit", lim.rpm, "requests per minute", self.minute + MINUTE, now, False)
        if lim.tpm is not None and self.tokens >= allow[TPM]:
            return self._refuse("limit", lim.tpm, "tokens per minute", self.minute + MINUTE, now, False)
        if lim.concurrency is not None and self.in_flight >= allow[CONC]:
            return QuotaRefusal(
                f"{self.label} has {self.in_flight} requests in flight on this router, at its limit of "
                f"{lim.concurrency:,} concurrent requests (across routers); retry when one ends",
                "rate_limit_exceeded",
                1,
            )
        return None

    def _refuse(
        self, kind: str, limit: int, unit: str, reset: float, now: float, budget: bool
    ) -> QuotaRefusal:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(reset))
        what = f"its {kind} of {limit:,} {unit}" if budget else f"its limit of {limit:,} {unit}"
        verb = "has used" if budget else "is at"
        return QuotaRefusal(
            f"{self.label} {verb} {what} (across routers); it resets at {at}, in {_until(reset - now)}",
            "insufficient_quota" if budget else "rate_limit_exceeded",
            max(1, math.ceil(reset - now)),
        )

    def use(self) -> QuotaUse:
        a = self.allow
        return QuotaUse(
            minute=self.minute,
            requests=self.requests,
            tokens=self.tokens,
            day=self.day,
            day_tokens=self.day_tokens,
            month=self.month,
            month_tokens=self.month_tokens,
            in_flight=self.in_flight,
            demand=self.demand,
            tick_requests=self.last_requests,
            tick_tokens=self.last_tokens,
            allow=(_wire(a[RPM]), _wire(a[TPM]), _wire(a[CONC]), _wire(a[DAY]), _wire(a[MONTH])),
        )

    def busy(self) -> bool:
        """Whether peers need to hear of it: anything counted in a window still open, or demand."""
        lim = self.limits
        return bool(
            self.requests
            or self.tokens
            or self.in_flight
            or self.demand
            or (lim.daily_tokens is not None and self.day_tokens)
            or (lim.monthly_tokens is not None and self.month_tokens)
        )


@dataclass(frozen=True, slots=True)
class QuotaRefusal:
    message: str
    code: str  # rate_limit_exceeded, or insufficient_quota for a spent day or month budget
    retry_after: int


def rate_headers(meters: Sequence[Meter], now: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers from the tightest meter with a per-minute limit of each kind."""
    out: dict[str, str] = {}
    for kind, slot, field in (("requests", RPM, "rpm"), ("tokens", TPM, "tpm")):
        best: tuple[float, int, Meter] | None = None
        for m in meters:
            limit = getattr(m.limits, field)
            if limit is None:
                continue
            used = m.requests if slot == RPM else m.tokens
            left = max(0.0, m.allow[slot] - used)
            if best is None or left < best[0]:
                best = (left, limit, m)
        if best is not None:
            left, limit, m = best
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(math.floor(left))
            out[f"x-ratelimit-reset-{kind}"] = _until(m.minute + MINUTE - now)
    return out
