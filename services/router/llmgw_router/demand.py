"""What this router sees of each model's load, summarised once a tick for the control plane (issue 21).

The control plane moves a model's replica count to keep a target (``ModelProfile.target``); the signal
is what clients feel, so it has two halves:

- what only the routers know: requests in flight through this router, waiting in its admission queue,
  held while the model has no ready replica. Exact from the router's start: 0 is 0.
- what the engines said (running, waiting, KV use), from the agents' load reports this router already
  follows for scheduling. Only fresh ones count; a router that holds none for a model says None, never
  0: a router that just started must not look like an idle fleet (ARCHITECTURE #1).
- first-byte times of the answers it relayed over the last ``window_s``, as the metrics histogram
  records them: the p90 is the bucket bound it falls in, so it never reads better than the truth.

One small report per tick, one entry per model that follows load: the control plane keeps no
per-replica state for it, whatever the fleet's size.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmgw_common.router_messages import DemandReport, ModelCache, ModelDemand
from llmgw_router.context import RouterContext
from llmgw_router.metrics import _TTFT_BUCKETS

# How far back first-byte times are counted: long enough for a p90 of a few requests a second, short
# enough that the control plane sees a step within its up_after.
WINDOW_S = 30.0


def p90_ms(counts: Sequence[int]) -> float | None:
    """The p90 of a histogram's counts (``_TTFT_BUCKETS`` plus +Inf) as its bucket's upper bound, in ms;
    None with no sample. Past the last bound it is that bound (the +Inf bucket has no upper one)."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = math.ceil(0.9 * total)
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank:
            return _TTFT_BUCKETS[min(i, len(_TTFT_BUCKETS) - 1)] * 1000.0
    return _TTFT_BUCKETS[-1] * 1000.0


class DemandMeter:
    """Keeps the last window's first-byte histograms, and builds one :class:`DemandReport` per tick."""

    def __init__(self, ctx: RouterContext, window_s: float = WINDOW_S) -> None:
        self.ctx = ctx
        self.window_s = window_s
        # Per tick, oldest first, one past the window kept as its base: (time, model -> cumulative
        # first-byte counts, model -> requests finished, model -> requests outstanding).
        self._marks: deque[_Mark] = deque()
        # A model's routing by cached prefix (cache/), for operators; None: not reported.
        self.cache_report: Callable[[str], ModelCache | None] = lambda model: None

    def report(self, router: str, now: float) -> DemandReport:
        ctx = self.ctx
        cumulative = ctx.metrics.ttft_counts()
        follows = {n: p for n, p in ctx.pool.profiles.items() if p.follows_load}
        finished = {m: n for m, n in ctx.metrics.finished_counts().items() if m in follows}
        here: dict[str, tuple[int, int, int]] = {}
        for name in follows:
            gate = ctx.gates.by_model.get(name)
            in_flight = sum(e.in_flight for e in ctx.pool.by_model.get(name, []))
            here[name] = (in_flight, gate.queued if gate is not None else 0, ctx.holding.held(name))
        outstanding = {m: sum(v) for m, v in here.items()}
        self._marks.append(_Mark(now, cumulative, finished, outstanding))
        while len(self._marks) > 1 and self._marks[1].at <= now - self.window_s:
            self._marks.popleft()
        base = self._marks[0]
        if base.at == now:
            # The first tick: what came before is since the router's start, within the window or not.
            base = _Mark(ctx.started, {}, {}, {})
        stale = ctx.limits.load_stale_s
        models: dict[str, ModelDemand] = {}
        for name, profile in follows.items():
            eps = ctx.pool.by_model.get(name, [])
            fresh = [e for e in eps if e.load_at is not None and now - e.load_at <= stale]
            delta = [
                c - b for c, b in zip(cumulative.get(name, []), base.ttft.get(name, [0] * 64), strict=False)
            ]
            # Rates over the model's up_after: a step is judged on what happened since it began.
            rb = self._rate_base(now - min(profile.up_after, self.window_s), base)
            done = finished.get(name, 0) - rb.finished.get(name, 0)
            arrived = done + outstanding[name] - rb.outstanding.get(name, 0)
            in_flight, queued, held = here[name]
            models[name] = ModelDemand(
                in_flight=in_flight,
                queued=queued,
                held=held,
                replicas_reporting=len(fresh),
                running=_sum([e.running for e in fresh]),
                waiting=_sum([e.waiting for e in fresh]),
                kv_use=_max([e.kv_use for e in fresh]),
                ttft_p90_ms=p90_ms(delta),
                ttft_samples=sum(delta),
                window_s=round(min(self.window_s, max(0.0, now - base.at)), 3),
                arrived=max(0, arrived),
                completed=max(0, done),
                rate_s=round(max(0.0, now - rb.at), 3),
            )
        for name in ctx.pool.profiles:
            cache = self.cache_report(name)
            if cache is None or cache.mode == "off":
                continue
            d = models.get(name)
            models[name] = ModelDemand(cache=cache) if d is None else d.model_copy(update={"cache": cache})
        return DemandReport(router=router, since=ctx.started, sent_at=now, models=models)

    def _rate_base(self, since: float, oldest: _Mark) -> _Mark:
        """The newest mark at or before ``since`` (the oldest there is, when none is that old)."""
        best = oldest
        for m in self._marks:
            if m.at > since:
                break
            best = m
        return best


@dataclass(frozen=True, slots=True)
class _Mark:
    at: float
    ttft: dict[str, list[int]]
    finished: dict[str, int]
    outstanding: dict[str, int]


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    # An engine that does not expose a figure (None) is left out; none at all is not 0.
    return sum(known) if known else None


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None
