"""Eviction (issue 13): which running replicas to stop so that a wanted replica that does not fit can.

Pure: a profile that placement refused, a snapshot, what is known of each replica's idleness and the
settings in; an :class:`Eviction` out. A replica may be evicted only when all of these hold, and each
one passed over is listed with the first that did not (for ``ctl explain-placement``):

- its idleness is *known* (ARCHITECTURE #1: a replica no router reports on is never idle), and no
  router has a request on it in flight (a stream on it may have nowhere else to be continued);
- its model is not watched (people depend on it), not waking (a wake not served yet), and keeps at
  least its ``min_replicas`` without it;
- it has run for ``min_residency_s`` at least, so that two models fighting over one card swap at most
  once per residency instead of thrashing.

The replica known idle the longest whose stop alone lets placement succeed is chosen; when no single
one frees enough (a replica needing several cards), the idlest are taken one by one until it fits and
those that turned out not to matter are put back. Placement itself decides what fits (it is asked with
the candidates removed from the snapshot), so an eviction never frees room placement would not use.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from llmgw_common.catalog import ModelProfile
from llmgw_common.durations import format_duration
from llmgw_controlplane.scheduler.placement import Placement, Unplaceable, place
from llmgw_controlplane.scheduler.plan import Plan, StopReplica
from llmgw_controlplane.scheduler.scaling import IdleLookup
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot

# Candidates tried one by one: each try is one placement over the snapshot.
MAX_TRIES = 32
# Models that get an eviction search in one pass.
SEARCHES_PER_PASS = 4


def may_evict_any(snap: Snapshot, idle: IdleLookup, min_residency_s: float) -> bool:
    """Whether any replica passes the checks that do not depend on who needs the room (cheap: a pass
    with no router reporting, or with every replica young, searches nothing)."""
    profiles = {m.name: m for m in snap.catalog.models}
    for r in snap.replicas:
        p = profiles.get(r.model)
        if p is None or p.watch is not None or r.draining or p.floor >= p.replicas:
            continue
        if snap.now - r.created >= min_residency_s:
            k = idle(r.id, r.created)
            if k.known and not k.busy:
                return True
    return False


@dataclass(frozen=True, slots=True)
class Victim:
    replica_id: str
    model: str
    nodes: tuple[str, ...]
    idle_s: float
    # Why it, in the user's terms: "idle for 15m, running for 2h".
    reason: str


@dataclass(frozen=True, slots=True)
class Eviction:
    model: str
    # Empty when nothing may be evicted, or stopping everything that may would not make room.
    victims: tuple[Victim, ...]
    # Where the wanted replica goes once the victims are stopped; None when no eviction makes room.
    placement: Placement | None
    # Every replica of another model not evicted, and why ("b-0: not known to be idle").
    passed_over: tuple[str, ...]

    def describe(self) -> str:
        """One line for people: what would be evicted for this model, or why nothing would."""
        if self.victims and self.placement is not None:
            gone = "; ".join(
                f"{v.replica_id} of {v.model} on {', '.join(v.nodes)} ({v.reason})" for v in self.victims
            )
            return f"would evict {gone}, then place on {', '.join(self.placement.nodes)}"
        if not self.passed_over:
            return "nothing to evict: no other model's replica runs"
        return "nothing may be evicted that would make room: " + "; ".join(self.passed_over[:8])


def _why_not(
    r: ReplicaView,
    snap: Snapshot,
    profiles: dict[str, ModelProfile],
    idle: IdleLookup,
    counts: dict[str, int],
    min_residency_s: float,
    protected: AbstractSet[str],
) -> tuple[str | None, float]:
    """Why ``r`` may not be evicted (None: it may), and its known idle seconds."""
    p = profiles.get(r.model)
    if p is None:
        return "its model left the catalog (it is being stopped)", 0.0
    if p.watch is not None:
        return f"model {r.model} is watched", 0.0
    if r.draining:
        return "draining already", 0.0
    if r.model in protected:
        return f"model {r.model} is waking (its replica is on its way)", 0.0
    if counts[r.model] - 1 < p.floor:
        return f"model {r.model} would fall below its min_replicas ({p.floor})", 0.0
    age = snap.now - r.created
    if age < min_residency_s:
        return f"resident for {format_duration(age)} only (minimum {format_duration(min_residency_s)})", 0.0
    k = idle(r.id, r.created)
    if k.busy:
        return "serving a request right now", 0.0
    if k.seconds is None:
        return "not known to be idle (no router reports on it)", 0.0
    return None, k.seconds


def plan_eviction(
    profile: ModelProfile,
    snap: Snapshot,
    idle: IdleLookup,
    *,
    min_residency_s: float,
    protected: AbstractSet[str] = frozenset(),
) -> Eviction:
    """What to stop so that one more replica of ``profile`` fits; ``protected``: models not to touch
    (waking)."""
    profiles = {m.name: m for m in snap.catalog.models}
    counts: dict[str, int] = {}
    for r in snap.replicas:
        if not r.draining:
            counts[r.model] = counts.get(r.model, 0) + 1
    passed: list[str] = []
    candidates: list[tuple[float, ReplicaView]] = []
    for r in snap.replicas:
        if r.model == profile.name:
            continue
        why, idle_s = _why_not(r, snap, profiles, idle, counts, min_residency_s, protected)
        if why is None:
            candidates.append((idle_s, r))
        else:
            passed.append(f"{r.id}: {why}")
    candidates.sort(key=lambda c: (-c[0], c[1].id))
    candidates = candidates[:MAX_TRIES]

    def fits(gone: AbstractSet[str]) -> Placement | None:
        res = place(profile, replace(snap, replicas=tuple(r for r in snap.replicas if r.id not in gone)))
        return res if isinstance(res, Placement) else None

    # The idlest one whose stop alone makes room.
    for idle_s, r in candidates:
        placed = fits({r.id})
        if placed is not None:
            rest = [f"{c.id}: idle for less long" for _, c in candidates if c is not r]
            return Eviction(profile.name, (_victim(r, idle_s, snap),), placed, tuple(passed + rest))
    # Several: the idlest first until it fits (never more of one model than its floor allows), then
    # put back those it fits without.
    chosen: list[tuple[float, ReplicaView]] = []
    left = dict(counts)
    placed = None
    for idle_s, r in candidates:
        p = profiles[r.model]
        if left[r.model] - 1 < p.floor:
            passed.append(f"{r.id}: model {r.model} would fall below its min_replicas ({p.floor})")
            continue
        left[r.model] -= 1
        chosen.append((idle_s, r))
        placed = fits({c.id for _, c in chosen})
        if placed is not None:
            break
    if placed is None:
        passed += [f"{r.id}: stopping it would not make room" for _, r in candidates]
        return Eviction(profile.name, (), None, tuple(passed))
    for c in list(reversed(chosen[:-1])):
        trial = [x for x in chosen if x is not c]
        alt = fits({x.id for _, x in trial})
        if alt is not None:
            chosen, placed = trial, alt
    return Eviction(profile.name, tuple(_victim(r, s, snap) for s, r in chosen), placed, tuple(passed))


def _victim(r: ReplicaView, idle_s: float, snap: Snapshot) -> Victim:
    reason = f"idle for {format_duration(idle_s)}, running for {format_duration(snap.now - r.created)}"
    return Victim(r.id, r.model, r.nodes, idle_s, reason)


def room_ever(profile: ModelProfile, snap: Snapshot) -> str | None:
    """None when one more replica of ``profile`` would fit were every replica that may ever be evicted
    stopped (what blocks it now passes: a young replica ages, an unknown idleness becomes known once the
    asking router reports, a wake is served); else why not, in placement's words.

    Never evictable: replicas of watched models, and each model's ``min_replicas`` (its oldest).
    """
    keep: list[ReplicaView] = []
    by_model: dict[str, list[ReplicaView]] = {}
    for r in snap.replicas:
        by_model.setdefault(r.model, []).append(r)
    profiles = {m.name: m for m in snap.catalog.models}
    for model, reps in by_model.items():
        p = profiles.get(model)
        if model == profile.name:
            keep.extend(reps)
        elif p is not None and p.watch is not None:
            keep.extend(reps)
        elif p is not None:
            keep.extend(sorted(reps, key=lambda r: (r.created, r.id))[: p.floor])
    res = place(profile, replace(snap, replicas=tuple(keep)))
    return res.summary if isinstance(res, Unplaceable) else None


@dataclass(frozen=True, slots=True)
class Evicted:
    victim: Victim
    for_model: str


@dataclass(frozen=True, slots=True)
class Room:
    """The eviction stage's outcome: the plan with its stops added, each scaling model's target with
    its evicted replicas taken off (so they are not placed straight back), what was evicted, and what is
    being done for each model that gets room (its eviction's one line)."""

    plan: Plan
    targets: Mapping[str, int]
    evicted: tuple[Evicted, ...] = ()
    making_room: Mapping[str, str] = field(default_factory=dict)


def make_room(
    plan: Plan,
    snap: Snapshot,
    idle: IdleLookup,
    targets: Mapping[str, int],
    *,
    min_residency_s: float,
    waking: AbstractSet[str],
) -> Room:
    """Stops that make room for the models ``plan`` could not place, if any may be made. A model whose
    wake is not served yet (``waking``) is coming up: never evicted. One served is guarded by the
    minimum residency only (else two models sharing one card could not swap within idle_after)."""
    if not plan.unplaceable or not may_evict_any(snap, idle, min_residency_s):
        return Room(plan, targets)
    gone = {s.replica_id for s in plan.stop}
    view = replace(snap, replicas=tuple(r for r in snap.replicas if r.id not in gone))
    stops: list[StopReplica] = []
    lowered = dict(targets)
    evicted: list[Evicted] = []
    room: dict[str, str] = {}
    # Each search costs a placement per candidate: a few models per pass, those woken first (a fleet
    # with many models that fit nowhere would otherwise search for all of them every pass).
    order = sorted(plan.unplaceable, key=lambda m: (m not in waking, m))
    for model in order[:SEARCHES_PER_PASS]:
        p = snap.catalog.get(model)
        if p is None:
            continue
        ev = plan_eviction(p, view, idle, min_residency_s=min_residency_s, protected=set(waking) | {model})
        if not ev.victims:
            continue
        room[model] = ev.describe()
        out = {v.replica_id for v in ev.victims}
        view = replace(view, replicas=tuple(r for r in view.replicas if r.id not in out))
        for v in ev.victims:
            stops.append(StopReplica(v.replica_id, v.model, f"evicted for model {model}: {v.reason}"))
            if v.model in lowered:
                lowered[v.model] = max(0, lowered[v.model] - 1)
            evicted.append(Evicted(v, model))
    if not stops:
        return Room(plan, targets, making_room=MappingProxyType(room))
    return Room(
        replace(plan, stop=plan.stop + tuple(stops)),
        MappingProxyType(lowered),
        tuple(evicted),
        MappingProxyType(room),
    )
