"""A replica's phase and whether it is routed: the one judgement every part of the control plane reads.

:func:`replica_status` decides the phase (starting, ready, failed, stopping) from the replica's shard
reports and the snapshot's clock, startup timeout included; :func:`serving` decides whether routers are
given it. The reconciler, the routing table, events and the ctl views all read these two, so a replica
the reconciler stops as failed is failed in ``ctl replicas`` too, and is not announced as on its way.
Both are pure; :func:`judged` computes them once per snapshot for every replica in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from llmgw_common.ctl import ReplicaPhase
from llmgw_common.messages import ShardState
from llmgw_controlplane.scheduler.snapshot import NodeState, ReplicaView, Snapshot

__all__ = [
    "Judgement",
    "ReplicaPhase",
    "ReplicaStatus",
    "judged",
    "replica_phase",
    "replica_status",
    "serving",
]

_GONE = (ShardState.STOPPING, ShardState.STOPPED)


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    phase: ReplicaPhase
    # FAILED: every failed shard's error ("shard 1 on gpu-b2: CUDA out of memory"), or the startup
    # timeout; STOPPING: which shards stop. Empty otherwise.
    errors: tuple[str, ...] = ()


def startup_timeout_s(snap: Snapshot, r: ReplicaView) -> float | None:
    """The time it was given to start: its own spec's, else its model's profile's; None when neither
    is known (a record from before specs were kept, of a model no longer in the catalog)."""
    if r.spec is not None:
        return r.spec.startup_timeout_s
    profile = snap.catalog.get(r.model)
    return profile.startup_timeout_s if profile is not None else None


def replica_status(snap: Snapshot, r: ReplicaView) -> ReplicaStatus:
    """The phase of ``r`` at ``snap.now``, read from the snapshot's judgement when ``r`` is one of its
    replicas (judged once per snapshot), else decided by :func:`_decide`."""
    j = judged(snap)
    return j.status[r.id] if _mine(j, r) else _decide(snap, r)


def _decide(snap: Snapshot, r: ReplicaView) -> ReplicaStatus:
    """Ready only when every shard is; one failed shard fails it, every error kept; stopping when a shard
    stops; failed too when not ready ``startup_timeout_s`` after it was created (or after its
    ``startup_from``, when its node's agent restarted); starting otherwise."""
    errors = [
        f"shard {s.shard} on {s.node}: {s.error or 'failed'}"
        for s in r.shards
        if s.state is ShardState.FAILED
    ]
    if errors:
        return ReplicaStatus(ReplicaPhase.FAILED, tuple(errors))
    gone = [f"shard {s.shard} on {s.node} {s.state}" for s in r.shards if s.state in _GONE]
    if gone:
        return ReplicaStatus(ReplicaPhase.STOPPING, tuple(gone))
    if r.shards and all(s.state is ShardState.READY for s in r.shards):
        return _READY
    timeout = startup_timeout_s(snap, r)
    if timeout is not None and snap.now - max(r.created, r.startup_from) > timeout:
        waiting = [
            f"shard {s.shard} on {s.node} {s.state or 'not reported'}"
            for s in r.shards
            if s.state is not ShardState.READY
        ]
        return ReplicaStatus(
            ReplicaPhase.FAILED, (f"not ready {timeout:g}s after start: {', '.join(waiting)}",)
        )
    return _STARTING


_READY = ReplicaStatus(ReplicaPhase.READY)
_STARTING = ReplicaStatus(ReplicaPhase.STARTING)


def _on_lost_node(snap: Snapshot, r: ReplicaView) -> bool:
    """A shard on a node lost or absent from the table: its endpoints are withdrawn even if it last
    said ready (the reconciler rebuilds it elsewhere)."""
    for s in r.shards:
        n = snap.nodes.get(s.node)
        if n is None or n.state is NodeState.LOST:
            return True
    return False


@dataclass(frozen=True, slots=True)
class Judgement:
    """Every replica of one snapshot, judged: its status, and the ids of those routed."""

    status: Mapping[str, ReplicaStatus]
    serving: frozenset[str]
    # The views judged, so a view that is not this snapshot's is judged on its own, never mistaken.
    views: Mapping[str, ReplicaView]


def judged(snap: Snapshot) -> Judgement:
    """The judgement of ``snap``'s replicas, computed on first use and kept with the snapshot."""
    got = snap.derived.get(Judgement)
    if isinstance(got, Judgement):
        return got
    status = {r.id: _decide(snap, r) for r in snap.replicas}
    routed = frozenset(
        r.id for r in snap.replicas if status[r.id].phase is ReplicaPhase.READY and not _on_lost_node(snap, r)
    )
    j = Judgement(MappingProxyType(status), routed, MappingProxyType({r.id: r for r in snap.replicas}))
    snap.derived[Judgement] = j
    return j


def _mine(j: Judgement, r: ReplicaView) -> bool:
    return j.views.get(r.id) is r


def replica_phase(snap: Snapshot, r: ReplicaView) -> ReplicaPhase:
    return replica_status(snap, r).phase


def serving(snap: Snapshot, r: ReplicaView) -> bool:
    """Routed: ready (startup timeout included) and on no lost node."""
    j = judged(snap)
    if _mine(j, r):
        return r.id in j.serving
    return _decide(snap, r).phase is ReplicaPhase.READY and not _on_lost_node(snap, r)
