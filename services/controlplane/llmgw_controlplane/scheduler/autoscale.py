"""The control plane's scaling state across passes (issue 13): scale memo, wakes, evictions, and the
events they cause. The decisions are pure (:mod:`scaling`, :mod:`eviction`, :mod:`wake_decisions`); this
holds what they need from one pass to the next, and is read by ``ctl status``.

One pass: :meth:`Autoscaler.decide` (wanted counts for the reconciler) -> reconcile ->
:meth:`Autoscaler.evict` (for models the reconciler could not place: stops that make room, the victim
models' targets lowered so they are not placed back) -> apply -> :meth:`Autoscaler.events`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from llmgw_common.catalog import ModelProfile
from llmgw_common.ctl import EvictionInfo, LoadScaleInfo
from llmgw_common.event_details import (
    EventDetails,
    ModelEvictedDetails,
    ModelScaledDownDetails,
    ModelScaledToZeroDetails,
    ModelScaledUpDetails,
    ModelWokenDetails,
    event,
)
from llmgw_common.messages import Event
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_controlplane.scheduler.demand import DemandBook
from llmgw_controlplane.scheduler.eviction import may_evict_any, plan_eviction
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.scheduler.loadscale import LoadMemo, LoadVerdict, Step, follow_load
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.plan import Plan, StopReplica
from llmgw_controlplane.scheduler.scaling import IdleLookup, ScaleDecision, ScaleMemo, decide
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot
from llmgw_controlplane.scheduler.wake_decisions import WakeBook, wake_answer

MODEL_SCALED_TO_ZERO = ModelScaledToZeroDetails.KIND
MODEL_WOKEN = ModelWokenDetails.KIND
MODEL_EVICTED = ModelEvictedDetails.KIND
MODEL_SCALED_UP = ModelScaledUpDetails.KIND
MODEL_SCALED_DOWN = ModelScaledDownDetails.KIND
# Every kind this module emits.
KINDS = (MODEL_SCALED_TO_ZERO, MODEL_WOKEN, MODEL_EVICTED, MODEL_SCALED_UP, MODEL_SCALED_DOWN)

# Evictions kept for `ctl status`.
RECENT_EVICTIONS = 32
# Models that get an eviction search in one pass.
SEARCHES_PER_PASS = 4


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    at: float
    replica_id: str
    model: str
    for_model: str
    nodes: tuple[str, ...]
    reason: str


def idle_lookup(idle: IdleMerger, now: float) -> IdleLookup:
    return lambda rid, created: idle.idle_for(rid, now, created)


def _event(subject: str, key: str, now: float, summary: str, details: EventDetails) -> Event:
    return event(
        details, id=f"{details.KIND}:{key}:{int(now * 1000)}", subject=subject, time=now, summary=summary
    )


class Autoscaler:
    def __init__(
        self, min_residency_s: float, drain_grace_s: float = 600.0, demand: DemandBook | None = None
    ) -> None:
        self.min_residency_s = min_residency_s
        # Following the load (issue 21): the routers' demand, each model's trend, the verdicts of the
        # last pass, and the replicas being drained on a step down (replica -> when it was chosen).
        self.demand = demand if demand is not None else DemandBook(stale_s=5.0)
        self.drain_grace_s = drain_grace_s
        self.load_memos: Mapping[str, LoadMemo] = MappingProxyType({})
        self.load_verdicts: Mapping[str, LoadVerdict] = MappingProxyType({})
        self.load_drains = LoadDrains(drain_grace_s)
        self.memo = ScaleMemo()
        self.book = WakeBook()
        self.last: ScaleDecision | None = None
        self.evictions: deque[EvictionRecord] = deque(maxlen=RECENT_EVICTIONS)
        # model -> what is being done to make room for it (the eviction's one line), until it is placed
        self.making_room: dict[str, str] = {}
        self._pending_events: list[Event] = []

    def new_tenure(self) -> None:
        """Leading (again): targets are taken afresh from what runs; wakes of another tenure are not ours."""
        self.memo = ScaleMemo()
        self.book = WakeBook()
        self.making_room.clear()
        self.load_memos = MappingProxyType({})
        self.load_drains = LoadDrains(self.drain_grace_s)

    # ------------------------------------------------------------ one pass

    def decide(self, snap: Snapshot, idle: IdleLookup) -> ScaleDecision:
        windows = self.book.windows(snap.catalog, snap.now)
        d = decide(snap, idle, windows, self.memo)
        out = follow_load(snap, self.demand.merged(snap.now), d, self.load_memos, idle, windows)
        d, self.load_memos, self.load_verdicts = out.decision, out.memos, out.verdicts
        for v in self.load_verdicts.values():
            if v.victim is not None:
                self.load_drains.chosen(v.victim, snap.now)
            self._pending_events.extend(_load_events(v, snap))
        self.memo = d.memo
        self.last = d
        for m in d.to_zero:
            p = snap.catalog.get(m)
            after = p.idle_after if p is not None and p.idle_after is not None else 0.0
            self._pending_events.append(
                _event(
                    m,
                    m,
                    snap.now,
                    f"model {m} scaled to zero: unused for longer than {after:g}s; a request wakes it",
                    ModelScaledToZeroDetails(idle_after=after),
                )
            )
        return d

    def evict(self, plan: Plan, snap: Snapshot, idle: IdleLookup) -> Plan:
        """``plan`` with a step down's replica drained rather than stopped (:class:`LoadDrains`), and the
        stops that make room for the models it could not place, if any may be made."""
        return self._evict(self.load_drains.hold(plan, snap, idle), snap, idle)

    def _evict(self, plan: Plan, snap: Snapshot, idle: IdleLookup) -> Plan:
        if not plan.unplaceable or not may_evict_any(snap, idle, self.min_residency_s):
            self.making_room.clear()
            return plan
        # A model whose wake is not served yet is coming up: never evicted. One served is guarded by the
        # minimum residency only (else two models sharing one card could not swap within idle_after).
        protected = set(self.book.pending)
        gone = {s.replica_id for s in plan.stop}
        view = replace(snap, replicas=tuple(r for r in snap.replicas if r.id not in gone))
        stops: list[StopReplica] = []
        targets = dict(self.memo.targets)
        room: dict[str, str] = {}
        # Each search costs a placement per candidate: a few models per pass, those woken first (a fleet
        # with many models that fit nowhere would otherwise search for all of them every pass).
        order = sorted(plan.unplaceable, key=lambda m: (m not in self.book.pending, m))
        for model in order[:SEARCHES_PER_PASS]:
            p = snap.catalog.get(model)
            if p is None:
                continue
            ev = plan_eviction(
                p, view, idle, min_residency_s=self.min_residency_s, protected=protected | {model}
            )
            if not ev.victims:
                continue
            room[model] = ev.describe()
            out = {v.replica_id for v in ev.victims}
            view = replace(view, replicas=tuple(r for r in view.replicas if r.id not in out))
            for v in ev.victims:
                stops.append(StopReplica(v.replica_id, v.model, f"evicted for model {model}: {v.reason}"))
                if v.model in targets:
                    targets[v.model] = max(0, targets[v.model] - 1)
                self.book.forget(v.model)  # its wake window must not place it straight back
                self.evictions.append(
                    EvictionRecord(snap.now, v.replica_id, v.model, model, v.nodes, v.reason)
                )
                self._pending_events.append(
                    _event(
                        v.model,
                        v.replica_id,
                        snap.now,
                        f"replica {v.replica_id} of model {v.model} on {', '.join(v.nodes)} stopped to make "
                        f"room for model {model} ({v.reason})",
                        ModelEvictedDetails(
                            replica=v.replica_id, nodes=v.nodes, for_model=model, idle_s=round(v.idle_s, 3)
                        ),
                    )
                )
        self.making_room = room
        if not stops:
            return plan
        self.memo = ScaleMemo(MappingProxyType(targets))
        return replace(plan, stop=plan.stop + tuple(stops))

    def events(self, snap: Snapshot) -> list[Event]:
        """What this pass has to tell people: scaled to zero, evicted, woken (with its cold start)."""
        ready = {r.model for r in snap.replicas if serving(snap, r)}
        for model, took in self.book.served(ready, snap.catalog, snap.now):
            self._pending_events.append(
                _event(
                    model,
                    model,
                    snap.now,
                    f"model {model} woken: a replica serves {took:.1f}s after the first request for it",
                    ModelWokenDetails(cold_start_s=round(took, 3)),
                )
            )
        out, self._pending_events = self._pending_events, []
        return out

    # ------------------------------------------------------------ wakes

    def answer(
        self,
        req: WakeRequest,
        snap: Snapshot,
        idle: IdleLookup,
        backoff: Mapping[str, str],
        settling: bool = False,
    ) -> WakeReply:
        reply = wake_answer(
            snap,
            req.model,
            idle,
            min_residency_s=self.min_residency_s,
            protected=set(self.book.pending),
            backoff=backoff,
            settling=settling,
        )
        if reply.state is WakeState.WAKING:
            self.book.ask(req.model, snap.now)
        return reply

    # ------------------------------------------------------------ for routing and ctl

    def cold(self) -> tuple[str, ...]:
        return self.last.cold if self.last is not None else ()

    def waking(self) -> dict[str, str]:
        """Models woken and not yet served: what is being done for each."""
        return {m: self.making_room.get(m, "waking: a replica is being placed") for m in self.book.pending}

    def load_info(self, unplaceable: Mapping[str, str]) -> dict[str, LoadScaleInfo]:
        """Each load-following model's last verdict, with what holds up a step that does not fit."""
        out = {}
        for m, v in sorted(self.load_verdicts.items()):
            why = v.why
            if m in unplaceable:
                room = self.making_room.get(m, "would evict nothing known idle")
                why = f"{why}; no room: {unplaceable[m]}; {room}"
            out[m] = LoadScaleInfo(
                model=m,
                target=v.target,
                measured=v.measured,
                value=-1.0 if v.value is None else round(v.value, 3),
                trend=v.trend.value,
                for_s=v.for_s,
                replicas=v.current,
                wants=v.wants,
                why=why,
            )
        return out

    def status(self, unplaceable: Mapping[str, str] | None = None) -> dict[str, object]:
        """The ``ctl status`` fields this holds."""
        return {
            "scaling": tuple(self.load_info(unplaceable or {}).values()),
            "cold": self.cold(),
            "waking": self.waking(),
            "cold_starts": {m: round(took, 3) for m, (took, _) in self.book.cold_starts.items()},
            "evictions": tuple(
                EvictionInfo(
                    at=e.at,
                    replica_id=e.replica_id,
                    model=e.model,
                    for_model=e.for_model,
                    nodes=e.nodes,
                    reason=e.reason,
                )
                for e in self.evictions
            ),
        }

    def explain_scaling(self, model: str) -> str:
        """For ``ctl explain-placement``: the count a load-following model asks for and why (its last
        verdict), so the next replica explained is read as the step's; "" for any other model."""
        v = self.load_verdicts.get(model)
        if v is None:
            return ""
        ask = f"asks for {v.wants}" if v.wants == v.current else f"asks for {v.current} → {v.wants}"
        return f"follows load (target {v.target}): {ask}; {v.why}"

    def explain(self, profile: ModelProfile, snap: Snapshot, idle: IdleLookup) -> str:
        """For ``ctl explain-placement`` of a model that does not fit: what would be evicted, and why."""
        ev = plan_eviction(
            profile, snap, idle, min_residency_s=self.min_residency_s, protected=set(self.book.pending)
        )
        return ev.describe()


def _load_events(v: LoadVerdict, snap: Snapshot) -> list[Event]:
    if v.step is Step.HOLD or v.value is None:
        return []
    common = {
        "replicas_from": v.current,
        "replicas_to": v.wants,
        "target": v.target,
        "measured": round(v.value, 3),
        "for_s": v.for_s,
        "reason": v.why,
    }
    if v.step is Step.UP:
        summary = f"model {v.model} scaled up: {v.why}"
        return [_event(v.model, v.model, snap.now, summary, ModelScaledUpDetails.model_validate(common))]
    summary = f"model {v.model} scaled down: {v.why}; replica {v.victim or '-'} drains"
    details = ModelScaledDownDetails.model_validate({**common, "replica": v.victim or ""})
    return [_event(v.model, v.model, snap.now, summary, details)]


# A drained replica stops no sooner than this after it was chosen: every router has by then seen it
# flagged draining and sent an idle report naming a request still on it (routers report each tick).
DRAIN_SETTLE_S = 3.0


class LoadDrains:
    """A step down's replica goes through the drain path: marked draining (routers send it nothing new),
    stopped only once no router reports a request on it (a stream finishes where it began), or after
    ``grace_s`` at most. Other stops pass as they are.

    What it drains is derived again from the records after a failover: a new leader finds the replica
    marked draining (with ``draining_since``) and nothing else explaining it (no roll: its spec is
    current; no node drain: its nodes are not draining), so the drain was a step down, and continues it
    (the grace counted from the record's mark, the settle from this tenure's first sight, since the
    routers' idle reports reach a new leader only now) instead of stopping it at once while it serves.
    Its scale memo starts from the replicas not draining, so no second replica is chosen for the step.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        # replica -> when its drain began; replica -> when this tenure took it up (its settle's start)
        self._chosen: dict[str, float] = {}
        self._seen: dict[str, float] = {}

    def chosen(self, replica: str, now: float) -> None:
        self._chosen.setdefault(replica, now)
        self._seen.setdefault(replica, now)

    @property
    def draining(self) -> tuple[str, ...]:
        return tuple(sorted(self._chosen))

    def _adopt(self, r: ReplicaView, snap: Snapshot) -> bool:
        """Take up a load drain of another tenure: ``r`` is marked draining, and only a step down marks
        a replica of a load-following model, current and on nodes not draining, so."""
        p = snap.catalog.get(r.model)
        if not r.draining or p is None or not p.follows_load:
            return False
        if r.spec is not None and not r.spec.matches(p):
            return False  # a roll's
        if any((n := snap.nodes.get(node)) is not None and n.draining for node in r.nodes):
            return False  # a node drain's
        since = r.draining_since if r.draining_since is not None else snap.now
        self._chosen[r.id] = min(since, snap.now)
        self._seen[r.id] = snap.now
        return True

    def hold(self, plan: Plan, snap: Snapshot, idle: IdleLookup) -> Plan:
        by_id = {r.id: r for r in snap.replicas}
        for rid in [rid for rid in self._chosen if rid not in by_id]:
            del self._chosen[rid]  # stopped (or gone by other means)
            self._seen.pop(rid, None)
        stops: list[StopReplica] = []
        mark = list(plan.mark_draining)
        for s in plan.stop:
            r = by_id.get(s.replica_id)
            if r is None or s.failed or s.node_lost:
                stops.append(s)
                continue
            if s.replica_id not in self._chosen and not self._adopt(r, snap):
                stops.append(s)
                continue
            t = self._chosen[s.replica_id]
            if not r.draining:
                if s.replica_id not in mark:
                    mark.append(s.replica_id)
                continue
            age = snap.now - t
            settled = snap.now - self._seen.get(s.replica_id, t) >= DRAIN_SETTLE_S
            k = idle(r.id, r.created)
            # Unknown is not free (ARCHITECTURE #1): no router heard from yet may hold a stream on it.
            free = k.known and not k.busy
            if not settled or (not free and age < self.grace_s):
                continue  # it finishes what it serves
            why = "nothing on it" if free else "a request still on it after the drain grace"
            stops.append(replace(s, reason=f"scaled down: drained for {age:.0f}s, {why}"))
        if len(stops) == len(plan.stop) and len(mark) == len(plan.mark_draining):
            return plan
        return replace(plan, stop=tuple(stops), mark_draining=tuple(mark))
