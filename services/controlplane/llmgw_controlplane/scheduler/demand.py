"""Routers' demand reports merged per model, and what a model's target measures from them (issue 21).

Each router sends, once a tick, a :class:`~llmgw_common.router_messages.DemandReport` (since issue 35 only
what changed, in bounded messages, a whole one every minute: ``llmgw_router.demand_deltas``): per model
that follows load, what it holds itself (in flight, queued, held; exact) and what the engines' load reports told it
(running, waiting, KV use; None where it has none). Merging keeps the two apart:

- a router's own figures add up across routers (each request passes one router);
- the engines' figures are the same reports seen by every router, so they are not added: the one that
  covers most replicas is taken (the largest, when they tie: a lagging router never hides a queue);
- a router silent for ``stale_s`` (our clock) is forgotten: what it held is gone with it.

Unknown stays unknown (ARCHITECTURE #1): no router reporting, or no engine figure reached any router,
yields a :class:`Measure` without a value, on which nothing scales (neither up nor down).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from llmgw_common.catalog import LoadTarget, TargetKind
from llmgw_common.ctl import ModelCacheInfo
from llmgw_common.router_messages import DemandReport, ModelCache, ModelDemand
from llmgw_runtime.clockcheck import Doubts, distrust, order_time

# Models one report may name; a catalog has far fewer, and a forger must not grow our tables.
MAX_REPORT_MODELS = 10_000
# A router whose window is shorter than this has seen too little to say "no requests".
MIN_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class Merged:
    """One model's load as every reporting router together sees it."""

    routers: int
    in_flight: int
    queued: int
    held: int
    replicas_reporting: int
    running: float | None
    waiting: float | None
    kv_use: float | None
    ttft_p90_ms: float | None
    ttft_samples: int
    window_s: float
    # Requests that arrived and that finished over ``rate_s`` (each router's model up_after), summed.
    arrived: int = 0
    completed: int = 0
    rate_s: float = 0.0

    @property
    def pending(self) -> int:
        """Requests no engine has yet: in a router's admission queue or held."""
        return self.queued + self.held


@dataclass(frozen=True, slots=True)
class Measure:
    """What a target measured: ``value`` in the target's own unit, None when not known (and why)."""

    value: float | None
    text: str


@dataclass(frozen=True, slots=True)
class _View:
    since: float
    order: float
    received_at: float
    models: dict[str, ModelDemand]
    # A whole report of this incarnation was applied: the view names every model the router reports.
    whole: bool = True


def _believable(d: ModelDemand) -> bool:
    nums: tuple[float | None, ...] = (d.running, d.waiting, d.kv_use, d.ttft_p90_ms, d.window_s, d.rate_s)
    c = d.cache
    if c is not None:
        nums += (c.prompt_tokens, c.predicted_hit_tokens, c.engine_queries, c.engine_hits, c.index_blocks)
        nums += (c.event_lag_ms,)
    return (
        all(v is None or (math.isfinite(v) and v >= 0) for v in nums)
        and min(d.in_flight, d.queued, d.held, d.replicas_reporting, d.ttft_samples, d.arrived, d.completed)
        >= 0
    )


class DemandBook:
    """The newest demand report of each router. Pure: time comes in as arguments."""

    def __init__(self, stale_s: float, doubts: Doubts | None = None) -> None:
        self.stale_s = stale_s
        self.doubts = doubts or Doubts(logging.getLogger("llmgw.controlplane"))
        self._routers: dict[str, _View] = {}

    def add(self, rep: DemandReport, received_at: float) -> None:
        why = distrust(rep.sent_at, received_at) or distrust(rep.since, received_at, "since")
        if why is None and len(rep.models) > MAX_REPORT_MODELS:
            why = f"{len(rep.models)} models named (at most {MAX_REPORT_MODELS})"
        if why is None and not all(_believable(d) for d in rep.models.values()):
            why = "a figure is negative or not finite"
        if why is not None:
            self.doubts.refuse(f"router {rep.router}", "demand report", why, received_at)
            return
        cur = self._routers.get(rep.router)
        if cur is not None and cur.since == rep.since and cur.order > rep.sent_at:
            return  # a delayed older report never replaces a newer one from the same router
        # A report says what changed since the router's last (issue 35): its entries over what it said
        # before, less ``gone``; a whole one (every report of routers before it) starts anew. Changes
        # whose base was missed (a router new to us, or we just started) are kept, but the router counts
        # as not reporting until its next whole report (within a minute): a model it did not name since
        # must not look unreported by it.
        models: dict[str, ModelDemand] = {}
        whole = rep.whole
        if not rep.whole and cur is not None and cur.since == rep.since:
            models = dict(cur.models)
            whole = cur.whole
            for m in rep.gone:
                models.pop(m, None)
        models.update(rep.models)
        if len(models) > MAX_REPORT_MODELS:
            self.doubts.refuse(
                f"router {rep.router}", "demand report", f"{len(models)} models named (at most {MAX_REPORT_MODELS})",
                received_at,
            )  # fmt: skip
            return
        self._routers[rep.router] = _View(
            rep.since, order_time(rep.sent_at, received_at), received_at, models, whole
        )

    def prune(self, now: float) -> None:
        for r in [r for r, v in self._routers.items() if now - v.received_at > self.stale_s]:
            del self._routers[r]

    @property
    def routers(self) -> tuple[str, ...]:
        return tuple(sorted(self._routers))

    def merged(self, now: float) -> dict[str, Merged]:
        """Each model some router reports on, merged at ``now``."""
        self.prune(now)
        per: dict[str, list[ModelDemand]] = {}
        for v in self._routers.values():
            for m, d in v.models.items() if v.whole else ():
                per.setdefault(m, []).append(d)
        return {m: merge(ds) for m, ds in per.items()}

    def cache(self, now: float) -> dict[str, ModelCacheInfo]:
        """Each model some router routes by cached prefix, its routers' views merged at ``now``."""
        self.prune(now)
        per: dict[str, list[ModelCache]] = {}
        for v in self._routers.values():
            for m, d in v.models.items() if v.whole else ():
                if d.cache is not None:
                    per.setdefault(m, []).append(d.cache)
        return {m: merge_cache(cs) for m, cs in per.items()}


def _rate(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def merge_cache(cs: list[ModelCache]) -> ModelCacheInfo:
    """Predictions add up over routers (each counts its own requests); the engines' counters are the
    same replicas seen by every router, so the router that sees most of them speaks for all."""
    engines = max(cs, key=lambda c: c.engine_queries)
    lags = [c.event_lag_ms for c in cs if c.event_lag_ms is not None]
    modes = sorted({c.mode for c in cs})
    return ModelCacheInfo(
        mode="/".join(modes),
        routers=len(cs),
        predicted_hit_rate=_rate(sum(c.predicted_hit_tokens for c in cs), sum(c.prompt_tokens for c in cs)),
        engine_hit_rate=_rate(engines.engine_hits, engines.engine_queries),
        index_blocks=max(c.index_blocks for c in cs),
        event_lag_ms=max(lags) if lags else None,
    )


def merge(ds: list[ModelDemand]) -> Merged:
    engines = [d for d in ds if d.replicas_reporting > 0]
    best = max(engines, key=lambda d: (d.replicas_reporting, d.waiting or 0.0)) if engines else None
    p90s = [d.ttft_p90_ms for d in ds if d.ttft_p90_ms is not None and d.ttft_samples > 0]
    kvs = [d.kv_use for d in engines if d.kv_use is not None]
    return Merged(
        routers=len(ds),
        in_flight=sum(d.in_flight for d in ds),
        queued=sum(d.queued for d in ds),
        held=sum(d.held for d in ds),
        replicas_reporting=best.replicas_reporting if best is not None else 0,
        running=best.running if best is not None else None,
        waiting=best.waiting if best is not None else None,
        kv_use=max(kvs) if kvs else None,
        # Routers' p90s cannot be combined exactly; the worst is what some clients feel.
        ttft_p90_ms=max(p90s) if p90s else None,
        ttft_samples=sum(d.ttft_samples for d in ds),
        window_s=max(d.window_s for d in ds),
        arrived=sum(d.arrived for d in ds),
        completed=sum(d.completed for d in ds),
        rate_s=max(d.rate_s for d in ds),
    )


def measure(target: LoadTarget, m: Merged | None, serving: int) -> Measure:
    """The target's figure for a model with ``serving`` ready replicas; its value None when unknown."""
    if m is None:
        return Measure(None, "unknown: no router reports its load")
    if serving <= 0:
        return Measure(None, "unknown: no replica serves")
    kind = target.kind
    if kind is TargetKind.IN_FLIGHT:
        # The routers' own counts: every request passes one, so these are exact without the engines.
        v = (m.in_flight + m.pending) / serving
        return Measure(v, f"{v:.3g} in flight per replica")
    if kind is TargetKind.WAITING:
        if m.waiting is None:
            return Measure(None, "unknown: no engine load report reached a router yet")
        v = (m.waiting + m.pending) / serving
        return Measure(v, f"{v:.3g} waiting per replica")
    if kind is TargetKind.KV_USE:
        if m.kv_use is None:
            return Measure(None, "unknown: no engine reports its KV-cache use")
        return Measure(m.kv_use, f"KV cache {m.kv_use:.0%} used")
    # TTFT_P90
    if m.ttft_p90_ms is not None:
        return Measure(m.ttft_p90_ms, f"first byte p90 {m.ttft_p90_ms:.0f} ms")
    if m.window_s < MIN_WINDOW_S:
        return Measure(None, "unknown: the routers have just started")
    if m.in_flight + m.pending > 0:
        # Requests wait, and none got a first byte in the whole window: at least that slow.
        v = m.window_s * 1000.0
        return Measure(v, f"no first byte in {m.window_s:.0f} s with {m.in_flight + m.pending} waiting")
    return Measure(0.0, f"no requests in the last {m.window_s:.0f} s")
