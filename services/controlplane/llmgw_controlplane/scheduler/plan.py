"""What one reconcile pass decided: replicas to place, to stop, to mark draining; and the memo it carries on.

A :class:`Plan` is data. One function of the control plane's I/O side applies it (assignments, replica
records, endpoints); the reconciler itself never writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw_common.messages import ReplicaSpec
from llmgw_controlplane.scheduler.placement import Unplaceable


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    shard: int
    node: str
    # The node's address: ports are unique per address, and shard 0's is the leader's.
    address: str
    gpus: tuple[int, ...]
    port: int


@dataclass(frozen=True, slots=True)
class NewReplica:
    model: str
    replica_id: str
    shards: tuple[ShardPlacement, ...]
    # Why these nodes (from placement), in the user's terms.
    reasons: tuple[str, ...] = ()
    # The profile it is placed for; its assignment keeps it however the catalog changes later.
    spec: ReplicaSpec | None = None

    @property
    def leader(self) -> str | None:
        """host:port of shard 0 for a multi-node replica; None for a single-node one."""
        if len(self.shards) < 2:
            return None
        s = self.shards[0]
        return f"{s.address}:{s.port}"


@dataclass(frozen=True, slots=True)
class StopReplica:
    replica_id: str
    model: str
    reason: str
    # A shard's node is lost: nothing will acknowledge the stop, so drop the record and withdraw the
    # endpoint now. When the node comes back its assignment no longer holds the shard, so it stops it.
    node_lost: bool = False
    # The replica failed (a shard failed or it never became ready): its model is backing off.
    failed: bool = False
    # A drained or rolled replica whose replacement serves: it still serves what it holds, so it is
    # stopped only once routers have seen it flagged and hold nothing on it (:mod:`drains`).
    handover: bool = False


@dataclass(frozen=True, slots=True)
class Backoff:
    until: float
    failures: int
    reason: str


@dataclass(frozen=True, slots=True)
class ModelMemo:
    """What the reconciler remembers about one model between passes."""

    failures: int = 0
    last_failure_at: float | None = None
    last_error: str | None = None
    # No placement for this model before this time (crash-loop backoff).
    next_attempt: float = 0.0
    # When placement of this model first failed in the current streak; None when it is placed.
    unplaceable_since: float | None = None
    # The last refusal with its reasons, and when they were worked out: reasons cost a verdict per node,
    # so a pass that finds the model still unplaceable reuses them until they are ``reasons_refresh_s`` old.
    unplaceable: Unplaceable | None = None
    unplaceable_checked: float | None = None
    # How many nodes the fleet had when they were worked out: a node joining or leaving makes them stale
    # at once (else "no node has reported" outlives the first inventories by ``reasons_refresh_s``).
    unplaceable_nodes: int = -1


def _empty_models() -> Mapping[str, ModelMemo]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ReconcileMemo:
    """The reconciler's memory, passed in and returned inside the :class:`Plan` so that the pass is pure.

    The caller keeps the latest one; a fresh control plane starts from ``ReconcileMemo()``.
    """

    models: Mapping[str, ModelMemo] = field(default_factory=_empty_models)
    # Failed replica ids whose failure has been counted already (pruned to those still present).
    counted: frozenset[str] = frozenset()
    # Counter for replica ids this process minted.
    seq: int = 0

    def model(self, name: str) -> ModelMemo:
        return self.models.get(name) or ModelMemo()


def _empty_unplaceable() -> Mapping[str, Unplaceable]:
    return MappingProxyType({})


def _empty_backoff() -> Mapping[str, Backoff]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Plan:
    place: tuple[NewReplica, ...] = ()
    stop: tuple[StopReplica, ...] = ()
    # Replicas to mark draining (their endpoints take no new requests); each gets a replacement.
    mark_draining: tuple[str, ...] = ()
    # Models below their count that no node could take, with every reason.
    unplaceable: Mapping[str, Unplaceable] = field(default_factory=_empty_unplaceable)
    # Models below their count that are waiting out a crash-loop backoff.
    backoff: Mapping[str, Backoff] = field(default_factory=_empty_backoff)
    memo: ReconcileMemo = field(default_factory=ReconcileMemo)

    @property
    def changes(self) -> bool:
        """True when applying the plan writes anything."""
        return bool(self.place or self.stop or self.mark_draining)
