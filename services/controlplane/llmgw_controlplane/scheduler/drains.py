"""Drains end without a dropped request (issues 8 and 21), pure: a replica that serves is stopped only
once routers send it nothing new and hold nothing on it.

- **A handover** (a node drain's or a roll's replica whose replacement serves, ``StopReplica.handover``):
  the routing table flags it in the pass the reconciler first asks for its stop, so the stop waits
  ``DRAIN_SETTLE_S`` (every router has seen the flag and reported what it still holds on it) and then
  while a router reports a request on it, up to the drain grace. Stopped at once, a request routed to
  it just before the flag was cut by the engine (vLLM aborts what it runs on SIGTERM: a 500).
- **A step down's replica** (:func:`loadscale.follow_load` chose it): marked draining first, then held
  the same way, except that an idleness no router reports is not free (ARCHITECTURE #1: it was
  chosen while routers reported on it; a new leader waits for their reports). Other stops pass as
  they are.

What a step down drains is derived again from the records after a failover: a new leader finds the
replica marked draining (with ``draining_since``) and nothing else explaining it (no roll: its spec is
current; no node drain: its nodes are not draining), so the drain was a step down, and continues it
(the grace counted from the record's mark, the settle from this tenure's first sight, since the
routers' idle reports reach a new leader only now) instead of stopping it at once while it serves.
Its scale memo starts from the replicas not draining, so no second replica is chosen for the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from llmgw_controlplane.scheduler.plan import Plan, StopReplica
from llmgw_controlplane.scheduler.scaling import IdleLookup
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot

# A drained replica stops no sooner than this after it was chosen: every router has by then seen it
# flagged draining and sent an idle report naming a request still on it (routers report each tick).
DRAIN_SETTLE_S = 3.0


def _empty() -> Mapping[str, float]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DrainMemo:
    """The replicas a step down drains: when each drain began (the grace's start), and when this tenure
    took it up (the settle's start)."""

    chosen: Mapping[str, float] = field(default_factory=_empty)
    seen: Mapping[str, float] = field(default_factory=_empty)
    # Handovers: when the stop was first asked for (the routing flag's pass).
    handovers: Mapping[str, float] = field(default_factory=_empty)

    @property
    def draining(self) -> tuple[str, ...]:
        return tuple(sorted(self.chosen))

    def choose(self, replicas: Iterable[str], now: float) -> DrainMemo:
        """With ``replicas`` chosen at ``now`` (one chosen already keeps its times)."""
        new = [r for r in replicas if r not in self.chosen]
        if not new:
            return self
        return DrainMemo(
            MappingProxyType({**self.chosen, **dict.fromkeys(new, now)}),
            MappingProxyType({**dict.fromkeys(new, now), **self.seen}),
            self.handovers,
        )


def load_drain(r: ReplicaView, snap: Snapshot) -> bool:
    """Whether ``r`` is a load drain of another tenure: marked draining, and only a step down marks a
    replica of a load-following model, current and on nodes not draining, so."""
    p = snap.catalog.get(r.model)
    if not r.draining or p is None or not p.follows_load:
        return False
    if r.spec is not None and not r.spec.matches(p):
        return False  # a roll's
    # Not a node drain's.
    return not any((n := snap.nodes.get(node)) is not None and n.draining for node in r.nodes)


def hold(
    plan: Plan, snap: Snapshot, idle: IdleLookup, memo: DrainMemo, grace_s: float
) -> tuple[Plan, DrainMemo]:
    """``plan`` with each stop of a replica that still serves held until it is free (or its grace is
    over), and the memo with the drains that ended dropped and those of another tenure taken up."""
    by_id = {r.id: r for r in snap.replicas}
    # Those stopped (or gone by other means) are forgotten.
    chosen = {rid: t for rid, t in memo.chosen.items() if rid in by_id}
    seen = {rid: t for rid, t in memo.seen.items() if rid in by_id}
    # Only this pass's handovers: one whose replacement stopped serving starts again when it is asked
    # for again (its flag was taken back meanwhile).
    handovers: dict[str, float] = {}
    stops: list[StopReplica] = []
    mark = list(plan.mark_draining)
    for s in plan.stop:
        r = by_id.get(s.replica_id)
        if r is None or s.failed or s.node_lost:
            stops.append(s)
            continue
        if s.replica_id not in chosen and load_drain(r, snap):
            since = r.draining_since if r.draining_since is not None else snap.now
            chosen[r.id], seen[r.id] = min(since, snap.now), snap.now
        if s.replica_id in chosen:
            held = _step_down(s, r, snap, idle, chosen[r.id], seen, grace_s, mark)
        elif s.handover:
            first = handovers[r.id] = memo.handovers.get(r.id, snap.now)
            held = _handover(s, r, snap, idle, first, grace_s)
        else:
            held = s
        if held is not None:
            stops.append(held)
    out = DrainMemo(MappingProxyType(chosen), MappingProxyType(seen), MappingProxyType(handovers))
    if out == memo:
        out = memo
    if tuple(stops) == plan.stop and tuple(mark) == plan.mark_draining:
        return plan, out
    return replace(plan, stop=tuple(stops), mark_draining=tuple(mark)), out


def _handover(
    s: StopReplica, r: ReplicaView, snap: Snapshot, idle: IdleLookup, first: float, grace_s: float
) -> StopReplica | None:
    """The stop once routers have seen the flag and hold nothing on it (None: not yet)."""
    age = snap.now - first
    if age < DRAIN_SETTLE_S:
        return None
    k = idle(r.id, r.created)
    if k.busy and age < grace_s:
        return None  # it finishes what it serves
    return s if not k.busy else replace(s, reason=f"{s.reason}; a request still on it after the drain grace")


def _step_down(
    s: StopReplica,
    r: ReplicaView,
    snap: Snapshot,
    idle: IdleLookup,
    t: float,
    seen: Mapping[str, float],
    grace_s: float,
    mark: list[str],
) -> StopReplica | None:
    """A step down's stop: marked draining first, then held until free (None: not yet)."""
    if not r.draining:
        if s.replica_id not in mark:
            mark.append(s.replica_id)
        return None
    age = snap.now - t
    settled = snap.now - seen.get(s.replica_id, t) >= DRAIN_SETTLE_S
    k = idle(r.id, r.created)
    # Unknown is not free (ARCHITECTURE #1): no router heard from yet may hold a stream on it.
    free = k.known and not k.busy
    if not settled or (not free and age < grace_s):
        return None  # it finishes what it serves
    why = "nothing on it" if free else "a request still on it after the drain grace"
    return replace(s, reason=f"scaled down: drained for {age:.0f}s, {why}")
