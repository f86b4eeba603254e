"""The reconciler: desired (the catalog) against actual (replicas, node states) → a :class:`Plan`.

Pure and synchronous: time comes in as ``snap.now``, memory as a :class:`ReconcileMemo` that the plan
hands back. Pipeline of one pass:

1. classify every replica: its model left the catalog (#10), a shard's node is lost, it failed (counted
   once towards its model's crash-loop backoff), a shard stopped, it is draining (#8), or it is active
   (and then current, or outdated: started with a spec its model's profile no longer has);
2. per catalog model: roll one outdated replica at a time by draining it (its replacement gets the new
   spec; a roll has no deadline: the old one serves until the new one does), stop drained replicas once
   enough replacements serve (or the deadline passed), stop the surplus (outdated first), and place what
   is missing, unless the model is backing off;
3. placements go through one :class:`Fleet`, so a pass never double-books a GPU, and through one
   per-address port table, so it never double-books a port.

Steady state costs one look at each replica and each catalog model: the fleet index is built only when
some model is below its count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType

from llmgw_common.backoff import backoff_delay
from llmgw_common.catalog import ModelProfile
from llmgw_common.messages import ReplicaSpec, ShardState
from llmgw_controlplane.placement import Fleet, Placement, Unplaceable, place_in
from llmgw_controlplane.plan import (
    Backoff,
    ModelMemo,
    NewReplica,
    Plan,
    ReconcileMemo,
    ShardPlacement,
    StopReplica,
)
from llmgw_controlplane.ports import PORT_HI, PORT_LO, PortsExhausted, allocate_port, ports_by_address
from llmgw_controlplane.snapshot import NodeState, ReplicaView, Snapshot

NewId = Callable[[str, int], str]

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    state: ReplicaState
    # Every failed shard's error ("shard 1 on gpu-b2: CUDA out of memory"), or why it counts as failed.
    errors: tuple[str, ...] = ()


def replica_status(replica: ReplicaView, now: float, startup_timeout_s: float | None = None) -> ReplicaStatus:
    """A replica is ready only when all its shards are; one failed shard fails it, with every error kept.

    A replica not ready ``startup_timeout_s`` after it was created (or after its ``startup_from``, when
    its node's agent restarted) counts as failed.
    """
    errors: list[str] = []
    stopping = False
    all_ready = True
    for s in replica.shards:
        st = s.state
        if st is ShardState.FAILED:
            errors.append(f"shard {s.shard} on {s.node}: {s.error or 'failed'}")
        elif st is ShardState.STOPPING or st is ShardState.STOPPED:
            stopping = True
        if st is not ShardState.READY:
            all_ready = False
    if errors:
        return ReplicaStatus(ReplicaState.FAILED, tuple(errors))
    if stopping:
        gone = [
            f"shard {s.shard} on {s.node} {s.state}"
            for s in replica.shards
            if s.state in (ShardState.STOPPING, ShardState.STOPPED)
        ]
        return ReplicaStatus(ReplicaState.STOPPING, tuple(gone))
    if all_ready and replica.shards:
        return ReplicaStatus(ReplicaState.READY)
    if startup_timeout_s is not None and now - max(replica.created, replica.startup_from) > startup_timeout_s:
        waiting = [
            f"shard {s.shard} on {s.node} {s.state or 'not reported'}"
            for s in replica.shards
            if s.state is not ShardState.READY
        ]
        return ReplicaStatus(
            ReplicaState.FAILED,
            (f"not ready {startup_timeout_s:g}s after start: {', '.join(waiting)}",),
        )
    return ReplicaStatus(ReplicaState.STARTING)


def default_replica_id(model: str, now: float, seq: int) -> str:
    """``<model>-<ms since epoch, hex>-<seq>``: unique across restarts, safe as a KV key and subject token."""
    return f"{_ID_UNSAFE.sub('_', model)}-{int(now * 1000):x}-{seq}"


@dataclass(slots=True)
class _Active:
    replica: ReplicaView
    ready: bool
    reachable: bool
    # Started with a spec that its model's profile no longer has: to be rolled.
    outdated: bool = False


@dataclass(slots=True)
class _Draining:
    replica: ReplicaView
    ready: bool
    deadline: float
    # Drained because its profile changed (not its node): stopped only once a replacement serves.
    rolling: bool = False


class _Pass:
    """The working state of one reconcile pass. Private; lives for one call of :func:`reconcile`."""

    def __init__(
        self,
        snap: Snapshot,
        memo: ReconcileMemo,
        new_id: NewId | None,
        ports: tuple[int, int],
        refresh_s: float,
        wanted: Mapping[str, int],
        stop_first: AbstractSet[str],
    ) -> None:
        self.snap = snap
        # Scaling (scaling.py): wanted counts that override a profile's replicas, and idle replicas to
        # stop before any other surplus.
        self.wanted = wanted
        self.stop_first = stop_first
        self.reasons_refresh_s = refresh_s
        self.memo = memo
        self.new_id = new_id
        self.port_lo, self.port_hi = ports
        self.models: dict[str, ModelMemo] = dict(memo.models)
        self.models_changed = False
        self.counted = set(memo.counted)
        self.seq = memo.seq
        self.ids: set[str] = set()
        self.place: list[NewReplica] = []
        self.stop: list[StopReplica] = []
        self.mark: list[str] = []
        self.unplaceable: dict[str, Unplaceable] = {}
        self.backoff: dict[str, Backoff] = {}
        self._fleet: Fleet | None = None
        self._ports: dict[str, set[int]] | None = None

    def fleet(self) -> Fleet:
        if self._fleet is None:
            self._fleet = Fleet(self.snap)
        return self._fleet

    def ports(self) -> dict[str, set[int]]:
        if self._ports is None:
            self._ports = ports_by_address(self.snap)
        return self._ports

    def set_model(self, name: str, m: ModelMemo) -> None:
        if self.models.get(name, ModelMemo()) != m:
            self.models[name] = m
            self.models_changed = True

    def mint_id(self, model: str) -> str:
        while True:
            seq = self.seq
            self.seq += 1
            rid = (self.new_id or _default_id(self.snap.now))(model, seq)
            if rid not in self.ids:
                self.ids.add(rid)
                return rid


def _default_id(now: float) -> NewId:
    return lambda model, seq: default_replica_id(model, now, seq)


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
    p = _Pass(snap, memo, new_id, port_range, reasons_refresh_s, wanted or {}, stop_first)
    catalog = {m.name: m for m in snap.catalog.models}
    nodes = snap.nodes
    active: dict[str, list[_Active]] = {}
    draining: dict[str, list[_Draining]] = {}
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
        st = replica_status(r, now, profile.startup_timeout_s if spec is None else spec.startup_timeout_s)
        if st.state is ReplicaState.FAILED:
            p.stop.append(StopReplica(r.id, r.model, "failed: " + "; ".join(st.errors), failed=True))
            if r.id not in p.counted:
                p.counted.add(r.id)
                _count_failure(p, r.model, now, "; ".join(st.errors), backoff_base_s, backoff_max_s)
            continue
        if st.state is ReplicaState.STOPPING:
            p.stop.append(StopReplica(r.id, r.model, "; ".join(st.errors)))
            continue
        ready = st.state is ReplicaState.READY
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
            draining.setdefault(r.model, []).append(_Draining(r, ready, drain_deadline, rolling))
            continue
        active.setdefault(r.model, []).append(_Active(r, ready, reachable, outdated))

    # A replica placed after the last failure is serving: the crash loop is over.
    for model, created in newest_ready.items():
        m = p.models.get(model)
        if m is not None and m.failures and m.last_failure_at is not None and created > m.last_failure_at:
            p.set_model(model, replace(m, failures=0, next_attempt=0.0))

    for profile in snap.catalog.models:
        _reconcile_model(p, profile, active.get(profile.name, []), draining.get(profile.name, []), placing)

    return _finish(p, catalog)


def _count_failure(p: _Pass, model: str, now: float, error: str, base: float, cap: float) -> None:
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


def _reconcile_model(
    p: _Pass, profile: ModelProfile, active: list[_Active], draining: list[_Draining], placing: bool
) -> None:
    now = p.snap.now
    name = profile.name
    desired = p.wanted.get(name, profile.replicas)

    # Roll (a profile change): one outdated replica at a time is drained, so one replacement is surged
    # and the drain below stops the old one only once the new one serves. Not while anything of this
    # model drains already (the previous step of the roll, or a node drain), nor while there is surplus.
    if placing and not draining and len(active) <= desired:
        outdated = [a for a in active if a.outdated]
        if outdated:
            # Not ready first (stopping it costs nothing), then the oldest.
            go = min(outdated, key=lambda a: (a.ready, a.replica.created, a.replica.id))
            active = [a for a in active if a is not go]
            draining = [_Draining(go.replica, go.ready, math.inf, rolling=True)]
            p.mark.append(go.replica.id)

    serving = sum(1 for a in active if a.ready)

    # Drain (#8): keep draining replicas that still serve while replacements are not ready yet.
    if draining:
        keep = max(0, desired - serving)
        for d in sorted(draining, key=lambda d: (not d.ready, d.replica.created, d.replica.id)):
            if d.deadline <= now:
                p.stop.append(StopReplica(d.replica.id, name, "drain deadline passed"))
            elif not d.ready:
                p.stop.append(StopReplica(d.replica.id, name, "draining and not serving"))
            elif keep > 0:
                keep -= 1
            elif d.rolling:
                p.stop.append(StopReplica(d.replica.id, name, "rolled: its replacement serves"))
            else:
                p.stop.append(StopReplica(d.replica.id, name, "drained: a replacement serves"))

    if len(active) > desired:
        # Stop what serves least: not ready first, then on an unreachable node, then outdated, then the newest.
        victims = sorted(
            active,
            key=lambda a: (
                a.replica.id not in p.stop_first,
                a.ready,
                a.reachable,
                not a.outdated,
                -a.replica.created,
                a.replica.id,
            ),
        )
        for a in victims[: len(active) - desired]:
            why = (
                "scaled down: unused for longer than idle_after"
                if a.replica.id in p.stop_first
                else "surplus"
            )
            p.stop.append(StopReplica(a.replica.id, name, f"{why}: {len(active)} replicas, {desired} wanted"))

    missing = desired - len(active)
    m = p.models.get(name)
    if missing <= 0:
        if m is not None and m.unplaceable_since is not None:
            p.set_model(name, replace(m, unplaceable_since=None, unplaceable=None, unplaceable_checked=None))
        return
    if m is not None and m.next_attempt > now:
        p.backoff[name] = Backoff(m.next_attempt, m.failures, m.last_error or "failed")
        return
    if not placing:
        return
    fleet = p.fleet()
    for _ in range(missing):
        m = p.models.get(name)
        fresh = (
            m is not None
            and m.unplaceable is not None
            and m.unplaceable_checked is not None
            and now - m.unplaceable_checked < p.reasons_refresh_s
            and m.unplaceable_nodes == len(p.snap.nodes)
        )
        placed = place_in(profile, fleet, detail=not fresh)
        res = _with_ports(p, placed, profile) if isinstance(placed, Placement) else placed
        if isinstance(res, Unplaceable):
            m = p.models.get(name) or ModelMemo()
            if fresh and m.unplaceable is not None:
                res = m.unplaceable
            else:
                m = replace(m, unplaceable=res, unplaceable_checked=now, unplaceable_nodes=len(p.snap.nodes))
            if m.unplaceable_since is None:
                m = replace(m, unplaceable_since=now)
            p.set_model(name, m)
            p.unplaceable[name] = res
            return
        assert isinstance(placed, Placement)
        fleet.take(placed)
        p.place.append(res)
    m = p.models.get(name)
    if m is not None and m.unplaceable_since is not None:
        p.set_model(name, replace(m, unplaceable_since=None, unplaceable=None, unplaceable_checked=None))


def _with_ports(p: _Pass, placement: Placement, profile: ModelProfile) -> NewReplica | Unplaceable:
    rid = p.mint_id(placement.model)
    table = p.ports()
    shards: list[ShardPlacement] = []
    taken: list[tuple[set[int], int]] = []
    for i, s in enumerate(placement.shards):
        addr = p.snap.nodes[s.node].address
        in_use = table.setdefault(addr, set())
        try:
            port = allocate_port(in_use, seed=f"{rid}/{i}", lo=p.port_lo, hi=p.port_hi)
        except PortsExhausted as e:
            for used, port in taken:
                used.discard(port)
            return Unplaceable(
                placement.model,
                (),
                f"cannot place model {placement.model} on {s.node}: address {addr} has {e}",
            )
        in_use.add(port)
        taken.append((in_use, port))
        shards.append(ShardPlacement(i, s.node, addr, s.gpus, port))
    return NewReplica(placement.model, rid, tuple(shards), placement.reasons, ReplicaSpec.of(profile))


def _finish(p: _Pass, catalog: dict[str, ModelProfile]) -> Plan:
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
