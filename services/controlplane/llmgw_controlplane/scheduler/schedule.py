"""One scheduler pass, pure: its stages in order over one snapshot, and the one memo it carries on.

1. **scale** (:func:`scaling.decide`): each scaling model's wanted count from idleness and wakes;
2. **follow the load** (:func:`loadscale.follow_load`): load-following models' counts moved by their
   load, and the replica a step down lets go;
3. **classify, place, plan** (:func:`reconciler.reconcile`): what runs against what is wanted;
   replicas placed, stopped, marked draining;
4. **hold drains** (:func:`drains.hold`): a step down's replica drained rather than stopped;
5. **evict** (:func:`eviction.make_room`): stops that make room for what placement could not place;
   it acts on placement's refusals, so it comes after placement, and the room it makes is placed on
   the next pass.

Time is ``snap.now``; what a pass remembers for the next is one :class:`SchedulerMemo`, handed back in
the :class:`Schedule`. The caller applies the plan and tells people (:class:`autoscale.Autoscaler`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw_controlplane.scheduler.demand import Merged
from llmgw_controlplane.scheduler.drains import DrainMemo, hold
from llmgw_controlplane.scheduler.eviction import Evicted, make_room
from llmgw_controlplane.scheduler.loadscale import LoadMemo, LoadVerdict, follow_load
from llmgw_controlplane.scheduler.plan import Plan, ReconcileMemo
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.scaling import IdleLookup, ScaleDecision, ScaleMemo, decide
from llmgw_controlplane.scheduler.snapshot import Snapshot


def _no_load() -> Mapping[str, LoadMemo]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SchedulerMemo:
    """Everything one pass remembers for the next; a fresh control plane starts from ``SchedulerMemo()``."""

    # Replica ids minted, failures counted, crash-loop backoffs, unplaceable streaks.
    reconcile: ReconcileMemo = field(default_factory=ReconcileMemo)
    # Each scaling model's target.
    scale: ScaleMemo = field(default_factory=ScaleMemo)
    # Each load-following model's trend.
    load: Mapping[str, LoadMemo] = field(default_factory=_no_load)
    # The replicas a step down drains.
    drains: DrainMemo = field(default_factory=DrainMemo)

    def new_tenure(self) -> SchedulerMemo:
        """Leading (again): targets and trends are taken afresh from what runs, drains derived again from
        the records (:mod:`drains`); the ids this process minted and the failures it counted stay."""
        return SchedulerMemo(reconcile=self.reconcile)


@dataclass(frozen=True, slots=True)
class Policy:
    """The settings a pass decides with."""

    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0
    # A node drain's default grace, and a step down's drain's longest wait.
    drain_grace_s: float = 600.0
    # A replica younger than this is never evicted.
    min_residency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PassInputs:
    """What a pass reads beside the snapshot: the routers' knowledge, and the wakes asked for."""

    idle: IdleLookup
    # Models whose wake window is open (model -> its latest wake).
    wakes: Mapping[str, float] = field(default_factory=dict)
    # Models woken and not served yet: never evicted.
    waking: AbstractSet[str] = frozenset()
    # The routers' demand, merged per model.
    demand: Mapping[str, Merged] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Schedule:
    scale: ScaleDecision
    load: Mapping[str, LoadVerdict]
    plan: Plan
    evicted: tuple[Evicted, ...]
    # Model -> what is being done to make room for it (its eviction's one line).
    making_room: Mapping[str, str]
    memo: SchedulerMemo


def schedule(snap: Snapshot, memo: SchedulerMemo, inputs: PassInputs, policy: Policy) -> Schedule:
    """One pass's stages, in order (the module's docstring)."""
    base = decide(snap, inputs.idle, inputs.wakes, memo.scale)
    out = follow_load(snap, inputs.demand, base, memo.load, inputs.idle, inputs.wakes)
    scale = out.decision
    drains = memo.drains.choose((v.victim for v in out.verdicts.values() if v.victim is not None), snap.now)
    plan = reconcile(
        snap,
        memo.reconcile,
        backoff_base_s=policy.backoff_base_s,
        backoff_max_s=policy.backoff_max_s,
        drain_grace_s=policy.drain_grace_s,
        wanted=scale.wanted,
        stop_first=scale.stop_first,
    )
    plan, drains = hold(plan, snap, inputs.idle, drains, policy.drain_grace_s)
    room = make_room(
        plan,
        snap,
        inputs.idle,
        scale.memo.targets,
        min_residency_s=policy.min_residency_s,
        waking=inputs.waking,
    )
    targets = scale.memo if room.targets is scale.memo.targets else ScaleMemo(room.targets)
    return Schedule(
        scale=scale,
        load=out.verdicts,
        plan=room.plan,
        evicted=room.evicted,
        making_room=room.making_room,
        memo=SchedulerMemo(plan.memo, targets, out.memos, drains),
    )
