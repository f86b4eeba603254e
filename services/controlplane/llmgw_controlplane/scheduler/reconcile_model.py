"""The reconciler's second stage, one catalog model at a time: roll, drain, stop the surplus, place.

Reads what :mod:`reconciler` classified (active and draining replicas of the model) and writes its
decisions into the pass (:class:`reconcile_pass.Pass`). Placements go through the pass's one
:class:`Fleet`, so a pass never double-books a GPU, and through one per-address port table, so it never
double-books a port.
"""

from __future__ import annotations

import math
from dataclasses import replace

from llmgw_common.catalog import ModelProfile
from llmgw_common.messages import ReplicaSpec
from llmgw_controlplane.scheduler.placement import Placement, Unplaceable, place_in
from llmgw_controlplane.scheduler.plan import Backoff, ModelMemo, NewReplica, ShardPlacement, StopReplica
from llmgw_controlplane.scheduler.ports import PortsExhausted, allocate_port
from llmgw_controlplane.scheduler.reconcile_pass import Active, Draining, Pass


def reconcile_model(
    p: Pass, profile: ModelProfile, active: list[Active], draining: list[Draining], placing: bool
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
            draining = [Draining(go.replica, go.ready, math.inf, rolling=True)]
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
            elif serving == 0:
                # Nothing serves instead (the model is wanted at 0): the routing table keeps it unflagged
                # (a model is never left with only flagged endpoints), so no handover could end.
                p.stop.append(StopReplica(d.replica.id, name, f"drained: {desired} replicas wanted"))
            elif d.rolling:
                p.stop.append(
                    StopReplica(d.replica.id, name, "rolled: its replacement serves", handover=True)
                )
            else:
                p.stop.append(StopReplica(d.replica.id, name, "drained: a replacement serves", handover=True))

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


def _with_ports(p: Pass, placement: Placement, profile: ModelProfile) -> NewReplica | Unplaceable:
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
