"""The control plane's scaling state across passes (issue 13): wakes, evictions, the last decisions, and
the events they cause. The decisions are pure (:mod:`schedule` and its stages); this holds what they
need from outside the scheduler's memo (the routers' demand, the wakes asked for), keeps what they
decided for ``ctl status``, and tells people.

One pass: :meth:`Autoscaler.inputs` -> :func:`schedule.schedule` -> :meth:`Autoscaler.record` -> apply
-> :meth:`Autoscaler.events`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
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
from llmgw_controlplane.scheduler.adapter_book import AdapterBook
from llmgw_controlplane.scheduler.demand import DemandBook
from llmgw_controlplane.scheduler.eviction import plan_eviction
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.scheduler.loadscale import LoadVerdict, Step
from llmgw_controlplane.scheduler.phase import serving
from llmgw_controlplane.scheduler.scaling import IdleLookup, ScaleDecision
from llmgw_controlplane.scheduler.schedule import PassInputs, Schedule
from llmgw_controlplane.scheduler.snapshot import Snapshot
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
        self, min_residency_s: float, demand: DemandBook | None = None, adapters: AdapterBook | None = None
    ) -> None:
        self.min_residency_s = min_residency_s
        # LoRA adapters (issue 33): what agents report of them, the wakes for them, the last decision.
        self.adapters = adapters if adapters is not None else AdapterBook()
        # Following the load (issue 21): the routers' demand, and the verdicts of the last pass.
        self.demand = demand if demand is not None else DemandBook(stale_s=5.0)
        self.load_verdicts: Mapping[str, LoadVerdict] = MappingProxyType({})
        self.book = WakeBook()
        self.last: ScaleDecision | None = None
        self.evictions: deque[EvictionRecord] = deque(maxlen=RECENT_EVICTIONS)
        # model -> what is being done to make room for it (the eviction's one line), until it is placed
        self.making_room: dict[str, str] = {}
        self._pending_events: list[Event] = []

    def new_tenure(self) -> None:
        """Leading (again): wakes of another tenure are not ours (the scheduler's memo starts afresh too:
        :meth:`SchedulerMemo.new_tenure`)."""
        self.book = WakeBook()
        self.making_room.clear()
        self.adapters.new_tenure()

    # ------------------------------------------------------------ one pass

    def inputs(self, snap: Snapshot, idle: IdleLookup) -> PassInputs:
        """What the pass reads from outside the snapshot: idleness, the wakes asked for, the demand."""
        return PassInputs(
            idle=idle,
            wakes=self.book.windows(snap.catalog, snap.now),
            waking=frozenset(self.book.pending),
            # A base's entry counts its adapters' requests already (the router reports the base's total
            # and each adapter's share beside it), so its count follows them (issue 33).
            demand=self.demand.merged(snap.now),
        )

    def record(self, s: Schedule, snap: Snapshot) -> None:
        """Keep what the pass decided, for ``ctl status`` and the routing table, and the events it causes."""
        self.last, self.load_verdicts = s.scale, s.load
        for v in s.load.values():
            self._pending_events.extend(_load_events(v, snap))
        for m in s.scale.to_zero:
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
        for e in s.evicted:
            ev, model = e.victim, e.for_model
            self.book.forget(ev.model)  # its wake window must not place it straight back
            self.evictions.append(
                EvictionRecord(snap.now, ev.replica_id, ev.model, model, ev.nodes, ev.reason)
            )
            self._pending_events.append(
                _event(
                    ev.model,
                    ev.replica_id,
                    snap.now,
                    f"replica {ev.replica_id} of model {ev.model} on {', '.join(ev.nodes)} stopped to make "
                    f"room for model {model} ({ev.reason})",
                    ModelEvictedDetails(
                        replica=ev.replica_id, nodes=ev.nodes, for_model=model, idle_s=round(ev.idle_s, 3)
                    ),
                )
            )
        self.making_room = dict(s.making_room)

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
        adapter = snap.catalog.adapter(req.model)
        if adapter is not None:
            base_req = WakeRequest(model=adapter.base, router=req.router, sent_at=req.sent_at)
            # The base's own wake (recorded as one) only when no replica of it serves.
            return self.adapters.answer(
                snap, adapter, lambda: self.answer(base_req, snap, idle, backoff, settling)
            )
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
