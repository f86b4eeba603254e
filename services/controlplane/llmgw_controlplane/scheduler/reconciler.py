"""The reconciler: desired (the catalog) against actual (replicas, node states) → a :class:`Plan`.

Pure and synchronous: time comes in as ``snap.now``, memory as a :class:`ReconcileMemo` that the plan
hands back. Pipeline of one pass:

1. classify every replica (here): its model left the catalog (#10), a shard's node is lost, it failed
   (:func:`phase.replica_status`, startup timeout included; counted once towards its model's crash-loop
   backoff), a shard stopped, it is draining (#8), or it is active (and then current, or outdated:
   started with a spec its model's profile no longer has);
2. per catalog model (:mod:`reconcile_model`): roll one outdated replica at a time by draining it (its replacement gets the new
   spec; a roll has no deadline: the old one serves until the new one does), stop drained replicas once
   enough replacements serve (or the deadline passed), stop the surplus (outdated first), and place what
   is missing, unless the model is backing off;
3. placements go through one :class:`Fleet`, so a pass never double-books a GPU, and through one
   per-address port table, so it never double-books a port.

The working state of a pass is :class:`reconcile_pass.Pass`. Steady state costs one look at each replica and each catalog model: the fleet index is built only when
some model is below its count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from types import MappingProxyType

from llmgw_common.backoff import backoff_delay
from llmgw_common.catalog import ModelProfile
from llmgw_controlplane.scheduler.phase import ReplicaPhase, replica_status
from llmgw_controlplane.scheduler.plan import ModelMemo, Plan, ReconcileMemo, StopReplica
from llmgw_controlplane.scheduler.ports import PORT_HI, PORT_LO
from llmgw_controlplane.scheduler.reconcile_model import reconcile_model
from llmgw_controlplane.scheduler.reconcile_pass import Active, Draining, NewId, Pass, default_replica_id
from llmgw_controlplane.scheduler.snapshot import NodeState, Snapshot

# Part of reconcile()'s interface: the default ``new_id``, and its type.
__all__ = ["NewId", "default_replica_id", "reconcile"]


def reconcile(
    snap: Snapshot,
    memo: ReconcileMemo | None = None,
    *,
    backoff_base_s: float = 5.0,
    backoff_max_s: float = 300.0,
    drain_grace_s: float = 600.0,
    placing: bool = True,
    new_id: NewId | None = None,
    port_range: tuple[int, int] = (PORT_LO, PORT_HI),
    reasons_refresh_s: float = 10.0,
    wanted: Mapping[str, int] | None = None,
    stop_first: AbstractSet[str] = frozenset(),
) -> Plan:
    """One pass: what to place, stop and mark draining so that the cluster moves towards the catalog.

    ``placing=False`` computes stops and drains but places nothing (e.g. during the settling window
    after a restart). ``new_id(model, seq)`` mints replica ids; the default is :func:`default_replica_id`.
    A node absent from ``snap.nodes`` counts as lost. Whether a model fits is decided afresh every pass;
    the reasons why it does not are worked out again at most every ``reasons_refresh_s`` (they cost a
    verdict per node).
    ``wanted`` overrides the catalog's replica count per model (scaling); ``stop_first`` names replicas
    to stop before any other when a model has more than it wants (those known idle).
    """
    memo = memo if memo is not None else ReconcileMemo()
    now = snap.now
    p = Pass(snap, memo, new_id, port_range, reasons_refresh_s, wanted or {}, stop_first)
    catalog = {m.name: m for m in snap.catalog.models}
    nodes = snap.nodes
    active: dict[str, list[Active]] = {}
    draining: dict[str, list[Draining]] = {}
    # Newest ready replica per model that the memo remembers (only those can be ending a crash loop).
    newest_ready: dict[str, float] = {}

    for r in snap.replicas:
        p.ids.add(r.id)
        profile = catalog.get(r.model)
        if profile is None:
            p.stop.append(StopReplica(r.id, r.model, f"model {r.model} left the catalog"))
            continue
        lost: list[str] = []
        reachable = True
        drain_deadline: float | None = None
        on_draining = False
        for s in r.shards:
            n = nodes.get(s.node)
            if n is None or n.state is NodeState.LOST:
                lost.append(s.node)
                continue
            if n.state is not NodeState.READY:
                reachable = False
            if n.draining:
                on_draining = True
                if n.drain_deadline is not None:
                    drain_deadline = (
                        n.drain_deadline if drain_deadline is None else min(drain_deadline, n.drain_deadline)
                    )
        if lost:
            which = ", ".join(sorted(set(lost)))
            p.stop.append(StopReplica(r.id, r.model, f"node {which} lost", node_lost=True))
            continue
        spec = r.spec
        outdated = spec is not None and not spec.matches(profile)
        st = replica_status(snap, r)
        if st.phase is ReplicaPhase.FAILED:
            p.stop.append(StopReplica(r.id, r.model, "failed: " + "; ".join(st.errors), failed=True))
            if r.id not in p.counted:
                p.counted.add(r.id)
                _count_failure(p, r.model, now, "; ".join(st.errors), backoff_base_s, backoff_max_s)
            continue
        if st.phase is ReplicaPhase.STOPPING:
            p.stop.append(StopReplica(r.id, r.model, "; ".join(st.errors)))
            continue
        ready = st.phase is ReplicaPhase.READY
        if ready and r.model in memo.models:
            newest_ready[r.model] = max(newest_ready.get(r.model, r.created), r.created)
        if r.draining or on_draining:
            if not r.draining:
                p.mark.append(r.id)
            rolling = outdated and not on_draining
            if not on_draining:
                # Marked by a roll, or by a node drain since lifted: nobody needs it gone by a time, so it
                # waits for its replacement however long (giving up would only lose capacity). This holds
                # when a roll is reverted too: the marked replica is current again, but its mark stays.
                drain_deadline = math.inf
            elif drain_deadline is None:
                since = r.draining_since if r.draining_since is not None else now
                drain_deadline = since + drain_grace_s
            draining.setdefault(r.model, []).append(Draining(r, ready, drain_deadline, rolling))
            continue
        active.setdefault(r.model, []).append(Active(r, ready, reachable, outdated))

    # A replica placed after the last failure is serving: the crash loop is over.
    for model, created in newest_ready.items():
        m = p.models.get(model)
        if m is not None and m.failures and m.last_failure_at is not None and created > m.last_failure_at:
            p.set_model(model, replace(m, failures=0, next_attempt=0.0))

    for profile in snap.catalog.models:
        reconcile_model(p, profile, active.get(profile.name, []), draining.get(profile.name, []), placing)

    return _finish(p, catalog)


def _count_failure(p: Pass, model: str, now: float, error: str, base: float, cap: float) -> None:
    m = p.models.get(model) or ModelMemo()
    n = m.failures + 1
    p.set_model(
        model,
        replace(
            m,
            failures=n,
            last_failure_at=now,
            last_error=error,
            next_attempt=now + backoff_delay(n, base, cap),
        ),
    )


def _finish(p: Pass, catalog: dict[str, ModelProfile]) -> Plan:
    memo = p.memo
    counted = frozenset(p.counted & p.ids) if p.counted else frozenset()
    if any(k not in catalog for k in p.models):
        p.models = {k: v for k, v in p.models.items() if k in catalog}
        p.models_changed = True
    if p.models_changed or counted != memo.counted or p.seq != memo.seq:
        memo = ReconcileMemo(
            models=MappingProxyType(dict(p.models)) if p.models_changed else memo.models,
            counted=counted,
            seq=p.seq,
        )
    return Plan(
        place=tuple(p.place),
        stop=tuple(p.stop),
        mark_draining=tuple(p.mark),
        unplaceable=MappingProxyType(p.unplaceable),
        backoff=MappingProxyType(p.backoff),
        memo=memo,
    )
