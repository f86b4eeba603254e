"""A replica's phase, from its shards' reported states (pure, on a view)."""

from __future__ import annotations

from llmgw_common.messages import ShardState
from llmgw_controlplane.snapshot import ReplicaView


class ReplicaPhase:
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


def replica_phase(view: ReplicaView) -> str:
    """starting -> ready (every shard ready) -> failed (any shard failed); stopping when any stops."""
    states = [s.state for s in view.shards]
    if any(s is ShardState.FAILED for s in states):
        return ReplicaPhase.FAILED
    if states and all(s is ShardState.READY for s in states):
        return ReplicaPhase.READY
    if any(s in (ShardState.STOPPING, ShardState.STOPPED) for s in states):
        return ReplicaPhase.STOPPING
    return ReplicaPhase.STARTING
