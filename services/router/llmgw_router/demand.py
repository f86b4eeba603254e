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

LoRA adapters (issue 33) run on their base's replicas: the base's entry is the whole load on them, its
adapters' requests included (in flight, queued, held, first bytes, arrivals), as the engines' own
figures are. Every adapter has an entry of its own too, its share of that (the engines' figures are the
base's: None there), whether its base follows load or not: the control plane never unloads an adapter
with requests here, orders its least recently used by a rise in ``arrived``, and spreads a hot adapter
from these entries. Adding adapters' entries to their base's would count them twice.
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
        pool, metrics, holding = ctx.pool, ctx.metrics, ctx.holding
        follows = {n: p for n, p in pool.profiles.items() if p.follows_load}
        # Every adapter whose base is served here, the base following load or not.
        adapters = {n: a.base for n, a in pool.adapters.items() if a.base in pool.profiles}
        cumulative = _hists_with_adapters(metrics.ttft_counts(), adapters)
        finished = {
            m: n
            for m, n in _with_adapters(metrics.finished_counts(), adapters).items()
            if m in follows or m in adapters
        }
        here: dict[str, tuple[int, int, int]] = {}
        holds = {name: holding.held(name) for name in (*follows, *adapters)}
        for name, of in adapters.items():
            if of in holds:
                holds[of] += holds[name]
            in_flight = metrics.adapter_in_flight.get(name, 0)
            here[name] = (in_flight, metrics.adapter_queued.get(name, 0), holds[name])
        for name in follows:
            gate = ctx.gates.by_model.get(name)
            # The base's endpoints' in-flight count and its gate include its adapters' requests.
            in_flight = sum(e.in_flight for e in pool.by_model.get(name, []))
            here[name] = (in_flight, gate.queued if gate is not None else 0, holds[name])
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
        for name in (*follows, *adapters):
            parent = adapters.get(name)
            profile = pool.profiles[parent if parent is not None else name]
            eps = pool.by_model.get(profile.name, [])
            if parent is not None:
                eps = [e for e in eps if name in e.adapters]
            fresh = [e for e in eps if e.load_at is not None and now - e.load_at <= stale]
            if parent is not None:
                # The engines' figures are the base replicas', not the adapter's own: not told twice.
                fresh_running: list[float | None] = []
                fresh_waiting: list[float | None] = []
                fresh_kv: list[float | None] = []
            else:
                fresh_running = [e.running for e in fresh]
                fresh_waiting = [e.waiting for e in fresh]
                fresh_kv = [e.kv_use for e in fresh]
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
                running=_sum(fresh_running),
                waiting=_sum(fresh_waiting),
                kv_use=_max(fresh_kv),
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


def _with_adapters(counts: dict[str, int], adapters: dict[str, str]) -> dict[str, int]:
    """Per-name counts with each adapter's added to its base's too: the base's figures are the whole load
    on its replicas."""
    out = dict(counts)
    for name, base in adapters.items():
        out[base] = out.get(base, 0) + counts.get(name, 0)
    return out


def _hists_with_adapters(hists: dict[str, list[int]], adapters: dict[str, str]) -> dict[str, list[int]]:
    """Per-name histograms (bucket counts) with each adapter's added to its base's too."""
    out = dict(hists)
    for name, base in adapters.items():
        mine = hists.get(name)
        if mine is not None:
            theirs = out.get(base)
            out[base] = mine if theirs is None else [x + y for x, y in zip(theirs, mine, strict=True)]
    return out


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    # An engine that does not expose a figure (None) is left out; none at all is not 0.
    return sum(known) if known else None


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None
