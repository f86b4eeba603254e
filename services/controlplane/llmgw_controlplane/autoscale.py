"""The control plane's scaling state across passes (issue 13): scale memo, wakes, evictions, and the
events they cause. The decisions are pure (:mod:`scaling`, :mod:`eviction`, :mod:`wakes`); this holds
what they need from one pass to the next, and is read by ``ctl status``.

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
from llmgw_common.ctl import EvictionInfo
from llmgw_common.event_details import (
    EventDetails,
    ModelEvictedDetails,
    ModelScaledToZeroDetails,
    ModelWokenDetails,
    event,
)
from llmgw_common.messages import Event, WakeReply, WakeRequest, WakeState
from llmgw_controlplane.eviction import may_evict_any, plan_eviction
from llmgw_controlplane.idle import IdleMerger
from llmgw_controlplane.plan import Plan, StopReplica
from llmgw_controlplane.routing import serving
from llmgw_controlplane.scaling import IdleLookup, ScaleDecision, ScaleMemo, decide
from llmgw_controlplane.snapshot import Snapshot
from llmgw_controlplane.wakes import WakeBook, wake_answer

MODEL_SCALED_TO_ZERO = ModelScaledToZeroDetails.KIND
MODEL_WOKEN = ModelWokenDetails.KIND
MODEL_EVICTED = ModelEvictedDetails.KIND
# Every kind this module emits.
KINDS = (MODEL_SCALED_TO_ZERO, MODEL_WOKEN, MODEL_EVICTED)

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
    def __init__(self, min_residency_s: float) -> None:
        self.min_residency_s = min_residency_s
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

    # ------------------------------------------------------------ one pass

    def decide(self, snap: Snapshot, idle: IdleLookup) -> ScaleDecision:
        d = decide(snap, idle, self.book.windows(snap.catalog, snap.now), self.memo)
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
        """``plan`` with the stops that make room for the models it could not place, if any may be made."""
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

    def status(self) -> dict[str, object]:
        """The ``ctl status`` fields this holds."""
        return {
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

    def explain(self, profile: ModelProfile, snap: Snapshot, idle: IdleLookup) -> str:
        """For ``ctl explain-placement`` of a model that does not fit: what would be evicted, and why."""
        ev = plan_eviction(
            profile, snap, idle, min_residency_s=self.min_residency_s, protected=set(self.book.pending)
        )
        return ev.describe()
