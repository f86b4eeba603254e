"""Replicas that follow the load (issue 21): each load-following model's wanted count, and why (pure).

In: the snapshot (its ``now`` is the only clock), the routers' merged demand (:mod:`demand`), the
decision :mod:`scaling` made for idleness and wakes, and each model's :class:`LoadMemo` of the last
pass. Out: the decision with the load-following models' counts moved, and a :class:`LoadVerdict` per
model for ``ctl status`` / ``ctl models`` and the events.

- **Over** the target by more than ``UP_TOLERANCE`` (10 %, as Kubernetes' HPA), sample by sample, for
  ``up_after``: up at once by as many replicas as the excess needs (``ceil(serving * peak / target)``,
  the peak since it went over; a queue is sized by its rates when it grows or drains, see
  :func:`needed`), at least one more, never past the ceiling. Within the band is on target: a steady
  load sampled noisily around its target never reads as over for up_after.
- **Under** for ``down_after``: down by one. Under means the figure's moving average (time constant
  ``down_after / 6``) would be at most ``DOWN_MARGIN`` of the target with one replica fewer
  (``average * n / (n - 1)``; a latency goal is not linear in replicas, so there: at most
  ``LATENCY_DOWN_MARGIN`` of the goal), and has been so at every sample of the last ``down_after``: a
  stabilization window (HPA's: the highest count asked for over the window is the one kept), so a lull
  shorter than down_after never gives back a replica the load then asks for again. Between over and
  under is steady.
- Nothing moves while replicas it asked for are not serving yet (their load is not spread yet: it
  would ask again for the same excess; never down while a step up is in flight), while a wake window
  is open (down only), nor on an unknown figure (ARCHITECTURE #1: a router that just started is not an
  idle fleet). Each step restarts the clock, so the next one is judged on the load the new count serves.
- A backlog that drains (more finish than arrive, by ``DRAINING``) is not load to add replicas for: a
  second step sized by the backlog queued while the first one's replicas started would be given back
  one replica at a time, inside what is a steady load.
- Load never takes a model below one replica nor below its floor; only idleness takes it to zero.
- The replica let go on the way down is the one no router has a request on, the idlest: it is then
  drained (:class:`~llmgw_controlplane.scheduler.autoscale.Autoscaler`), never stopped while it serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType

from llmgw_common.catalog import ModelProfile, TargetKind
from llmgw_common.durations import format_duration
from llmgw_controlplane.scheduler.demand import Measure, Merged, measure
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.scaling import IdleLookup, ScaleDecision, ScaleMemo
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot

DOWN_MARGIN = 0.8
LATENCY_DOWN_MARGIN = 0.5
# The down average's time constant is down_after over this: short enough that the window after it is
# most of the wait (a load gone is given back about down_after later), long enough that one Poisson
# burst does not break the window.
AVERAGE_SHARE = 6.0
# Over means more than this share above the target: sampling noise around a target is not a step.
UP_TOLERANCE = 0.1


class Trend(StrEnum):
    OVER = "over"
    UNDER = "under"
    STEADY = "steady"
    UNKNOWN = "unknown"


class Step(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class LoadMemo:
    """Since when a model's figure has been on its side of the target (the snapshot's clock)."""

    trend: Trend
    since: float
    # The highest figure since then: a step up is sized by it, as one tick's sample of a bursty load
    # (closed-loop clients between two requests) reads low and would add too few, then more again.
    peak: float = 0.0
    # Since the last figure over the target (or unknown, or a step), and the figure's moving average
    # (time constant down_after / 6; None: no sample since a step). Down is judged on the average, so
    # one noisy sample (a Poisson burst) does not restart the down_after clock, and old load is
    # forgotten; the margin still keeps a load near its target from flapping.
    calm_since: float = 0.0
    average: float | None = None
    average_at: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadVerdict:
    model: str
    target: str  # "waiting_per_replica 2"
    measured: str  # "4.5 waiting per replica", or "unknown: ..."
    value: float | None
    trend: Trend
    for_s: float
    current: int  # the count wanted before this pass
    wants: int  # the count wanted after it
    step: Step
    # The one line: why it moved ("4.5 waiting per replica over 2 for 40 s: 2 -> 4") or what holds it.
    why: str
    # The replica drained on a step down.
    victim: str | None = None


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    decision: ScaleDecision
    memos: Mapping[str, LoadMemo]
    verdicts: Mapping[str, LoadVerdict]


def target_text(p: ModelProfile) -> str:
    assert p.target is not None
    return f"{p.target.kind.value} {p.target.value:g}"


def _trend(
    p: ModelProfile, m: Measure, mean: float | None, serving_n: int, current: int, lower: int
) -> Trend:
    """Over on this sample; under or steady on the mean since the last time it was over."""
    assert p.target is not None
    if m.value is None:
        return Trend.UNKNOWN
    goal = p.target.value
    if m.value > goal * (1.0 + UP_TOLERANCE):
        return Trend.OVER
    value = m.value if mean is None else mean
    if current <= lower:
        return Trend.STEADY  # nothing to give back
    if p.target.kind is TargetKind.TTFT_P90:
        return Trend.UNDER if value <= goal * LATENCY_DOWN_MARGIN else Trend.STEADY
    if serving_n < current or serving_n < 2:
        # Replicas asked for are not serving yet: under when those serving are enough on their own.
        return Trend.UNDER if value <= goal * DOWN_MARGIN else Trend.STEADY
    projected = value * serving_n / (serving_n - 1)
    return Trend.UNDER if projected <= goal * DOWN_MARGIN else Trend.STEADY


def _calm(prev: LoadMemo | None, value: float | None, p: ModelProfile, now: float) -> LoadMemo:
    """The calm part of the memo after this sample (only its calm_since and average fields are read)."""
    assert p.target is not None
    if value is None:
        return LoadMemo(Trend.UNKNOWN, now, calm_since=now)
    if prev is None or prev.average is None:
        avg = value
    else:
        w = 1.0 - math.exp(-max(0.0, now - prev.average_at) / max(p.down_after / AVERAGE_SHARE, 1e-9))
        avg = prev.average + w * (value - prev.average)
    over = value > p.target.value * (1.0 + UP_TOLERANCE)
    since = now if over or prev is None or prev.average is None else prev.calm_since
    return LoadMemo(Trend.UNKNOWN, now, calm_since=since, average=avg, average_at=now)


# A queue grows when this many more requests arrive than finish: then its length is mostly backlog.
GROWING = 1.25
# A backlog drains when this many more finish than arrive, and at least DRAIN_MIN more over rate_s
# (closed-loop clients arrive as they finish: their counts differ by a few, never by a share).
DRAINING = 1.05
DRAIN_MIN = 3


def _draining(p: ModelProfile, d: Merged | None) -> bool:
    assert p.target is not None
    if p.target.kind not in (TargetKind.IN_FLIGHT, TargetKind.WAITING) or d is None or d.completed == 0:
        return False
    return d.completed - d.arrived >= max(DRAIN_MIN, (DRAINING - 1.0) * d.arrived)


def _shrinking(p: ModelProfile, d: Merged | None) -> str | None:
    """Why a queue figure over the target needs no more replicas: its backlog drains (more finished
    than arrived over up_after: the count keeps up, the rest is what queued before it served), or None.

    Not sized by the rates either: while a backlog drains the engines run saturated, and on a loaded
    host slower than they serve the same arrivals once it is gone (bench/autoscale.py: 4 replicas
    finishing 1.1x the arrivals under the backlog asked for a fifth, which served 1.2 in flight each
    once it had drained, and was given back). Once drained, the figure says what the arrivals need."""
    if d is None or not _draining(p, d):
        return None
    return f"its queue shrinks ({d.completed} finished, {d.arrived} arrived in {d.rate_s:.0f} s)"


def needed(p: ModelProfile, value: float, serving_n: int, d: Merged | None = None) -> int:
    """Replicas that bring the figure back to the target, if it spreads evenly over them.

    A queue figure (in flight, waiting) under an open-loop load that the replicas cannot keep up with
    is mostly backlog: its length says how long the load has been too much, not how much. Then the
    count is also sized by the rates, ``serving * arrived / finished`` (what keeps up), times the share
    of a replica the target leaves unused (engines running more than the target per replica finish
    more than the target would), and the smaller of the two is taken. Closed-loop clients never grow
    a queue (arrivals follow completions): their figure is what they need."""
    assert p.target is not None
    by_figure = math.ceil(serving_n * value / p.target.value - 1e-9)
    queue = p.target.kind in (TargetKind.IN_FLIGHT, TargetKind.WAITING)
    if queue and d is not None and d.completed > 0 and d.arrived > GROWING * d.completed:
        per = d.running / d.replicas_reporting if d.running and d.replicas_reporting else p.target.value
        keep_up = serving_n * d.arrived / d.completed
        if p.target.kind is TargetKind.IN_FLIGHT:
            keep_up *= max(1.0, per / p.target.value)
        by_figure = min(by_figure, math.ceil(keep_up - 1e-9))
    return max(serving_n + 1, by_figure)


def follow_load(
    snap: Snapshot,
    demand: Mapping[str, Merged],
    base: ScaleDecision,
    memos: Mapping[str, LoadMemo],
    idle: IdleLookup,
    wakes: Mapping[str, float],
) -> LoadOutcome:
    now = snap.now
    by_model: dict[str, list[ReplicaView]] = {}
    for r in snap.replicas:
        if not r.draining:
            by_model.setdefault(r.model, []).append(r)
    wanted = dict(base.wanted)
    stop_first = set(base.stop_first)
    new_memos: dict[str, LoadMemo] = {}
    verdicts: dict[str, LoadVerdict] = {}
    for p in snap.catalog.models:
        if not p.follows_load or p.target is None or p.name not in wanted:
            continue
        live = by_model.get(p.name, [])
        n = sum(1 for r in live if serving(snap, r))
        current = wanted[p.name]
        lower = max(p.floor, 1)
        m = measure(p.target, demand.get(p.name), n)
        prev = memos.get(p.name)
        calm = _calm(prev, m.value, p, now)
        trend = _trend(p, m, calm.average, n, current, lower)
        since = prev.since if prev is not None and prev.trend is trend else now
        if trend is Trend.UNDER:
            # The stabilization window: under at every sample since ``since``, and no sample over.
            since = max(since, calm.calm_since)
        peak = m.value if m.value is not None else 0.0
        if prev is not None and since == prev.since:
            peak = max(peak, prev.peak)
        held = _held(trend, n, len(live), current, p.name in wakes)
        if held is not None and n < current:
            # Replicas coming: the clock restarts once they serve, on the load they then share.
            since, peak = now, m.value or 0.0
            # The average too: the load over fewer replicas than will serve it is not what they share.
            calm = LoadMemo(Trend.UNKNOWN, now, calm_since=now)
        want, why, step, victim = current, held or "", Step.HOLD, None
        for_s = now - since
        unit = f"{m.text} {'over' if trend is Trend.OVER else 'under'} {p.target.value:g}"
        if held is None and trend is Trend.OVER:
            if current >= p.ceiling:
                why = f"{m.text} over {p.target.value:g}; at max_replicas {p.ceiling}"
            elif (draining := _shrinking(p, demand.get(p.name))) is not None:
                why = f"{m.text} over {p.target.value:g}, but {draining}: the replicas keep up"
            elif for_s >= p.up_after:
                want = min(p.ceiling, needed(p, peak, n, demand.get(p.name)))
                step, since = Step.UP, now
                seen = f" (up to {peak:.3g})" if m.value is not None and peak > m.value else ""
                why = f"{unit}{seen} for {format_duration(for_s)}: {current} → {want}"
            else:
                why = f"{unit} for {format_duration(for_s)}, up after {format_duration(p.up_after)}"
        elif held is None and trend is Trend.UNDER:
            mean = calm.average
            unit = f"{m.text} now, {mean or 0.0:.3g} on average, under {p.target.value:g}"
            if for_s >= p.down_after and n < current:
                # Less load than the replicas serving need: the ones never placed (no room) are not
                # needed. Ones placed and starting hold every step (_held).
                want, step, since = max(lower, n), Step.DOWN, now
                why = f"{unit} for {format_duration(for_s)}: {current} → {want} (never placed)"
            elif for_s >= p.down_after and current > lower:
                victim = _victim(live, idle)
                want, step, since = current - 1, Step.DOWN, now
                why = f"{unit} for {format_duration(for_s)}: {current} → {want}"
            else:
                why = f"{unit} for {format_duration(for_s)}, down after {format_duration(p.down_after)}"
        elif held is None:
            band = f"within target {p.target.value:g} (+{UP_TOLERANCE:.0%})"
            why = m.text if trend is Trend.UNKNOWN else f"{m.text}: {band}"
        wanted[p.name] = want
        if victim is not None:
            stop_first.add(victim)
        if step is not Step.HOLD:
            calm = LoadMemo(trend, now, calm_since=now)  # the next step is judged on the new count's load
        new_memos[p.name] = LoadMemo(
            trend,
            since,
            peak if since != now else m.value or 0.0,
            calm.calm_since,
            calm.average,
            calm.average_at,
        )
        verdicts[p.name] = LoadVerdict(
            p.name, target_text(p), m.text, m.value, trend, round(for_s, 3), current, want, step, why, victim
        )
    targets = {**dict(base.memo.targets), **{m: wanted[m] for m in verdicts}}
    memo = base.memo if dict(base.memo.targets) == targets else ScaleMemo(MappingProxyType(targets))
    decision = replace(base, wanted=MappingProxyType(wanted), stop_first=frozenset(stop_first), memo=memo)
    return LoadOutcome(decision, MappingProxyType(new_memos), MappingProxyType(verdicts))


def _held(trend: Trend, serving_n: int, live_n: int, current: int, waking: bool) -> str | None:
    """What keeps the count where it is whatever the figure says, or None."""
    if serving_n < current and trend is not Trend.UNDER:
        coming = current - serving_n
        return f"waiting for {coming} replica{'s' if coming != 1 else ''} to serve ({serving_n} of {current})"
    if trend is Trend.UNDER and live_n > serving_n:
        # Never down while a step up is in flight: the load has not spread over the new ones yet, and a
        # replica given back while another starts is the flap hysteresis is for.
        starting = live_n - serving_n
        return f"{starting} replica{'s' if starting != 1 else ''} still starting: not scaled down meanwhile"
    if trend is Trend.UNDER and waking:
        return "woken recently: not scaled down while its wake window is open"
    return None


def _victim(live: list[ReplicaView], idle: IdleLookup) -> str:
    """The replica to drain: none of a router's requests on it, then the idlest, then the newest."""

    def key(r: ReplicaView) -> tuple[bool, float, float, str]:
        k = idle(r.id, r.created)
        return (k.busy, -(k.seconds or 0.0), -r.created, r.id)

    return min(live, key=key).id
