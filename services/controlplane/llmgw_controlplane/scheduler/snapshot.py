"""The frozen view of the cluster that every decision reads: nodes, replicas, catalog, marks, time.

The control plane's I/O side builds a :class:`Snapshot` from what the bus told it; the pure side
(:mod:`placement`, :mod:`reconciler`) reads nothing else. Time arrives as data (``now``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from llmgw_common.catalog import Catalog
from llmgw_common.messages import ReplicaSpec, ShardState, WeightsEntry


class NodeState(StrEnum):
    READY = "ready"
    # Missed a few heartbeats: keeps its replicas, gets no new ones.
    UNREACHABLE = "unreachable"
    # Silent past the lost timeout: its replicas are rebuilt elsewhere.
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    gpu_class: str
    memory_mb: int = 0
    healthy: bool = True
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    state: NodeState = NodeState.READY
    fabric: str | None = None
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    engines: frozenset[str] = frozenset({"sim", "vllm", "llamacpp"})
    gpus: tuple[GpuView, ...] = ()
    # None: the node did not report memory. Never read as 0 (ARCHITECTURE #3).
    memory_gb: float | None = None
    cpus: int | None = None
    # False: the node was told no directories and did not look (ARCHITECTURE #4).
    storage_looked: bool = False
    weights: tuple[WeightsEntry, ...] = ()
    cordoned: bool = False
    draining: bool = False
    # When a drain gives up waiting for replacements (ARCHITECTURE #8); None: the reconciler's default grace.
    drain_deadline: float | None = None
    address: str = "127.0.0.1"
    last_seen: float = 0.0


@dataclass(frozen=True, slots=True)
class ShardView:
    shard: int
    node: str
    gpus: tuple[int, ...] = ()
    port: int = 0
    # What the node last reported; None when it has not reported this shard yet.
    state: ShardState | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    id: str
    model: str
    created: float
    shards: tuple[ShardView, ...]
    draining: bool = False
    draining_since: float | None = None
    # The startup timeout counts from here when it is later than ``created`` (its node's agent restarted
    # while it was ready: the new agent re-adopts and checks the engine before it says ready again).
    startup_from: float = 0.0
    # What it was started with; None: whatever the catalog says (a record from before specs were kept).
    spec: ReplicaSpec | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.shards)


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    nodes: Mapping[str, NodeView]
    replicas: tuple[ReplicaView, ...] = ()
    catalog: Catalog = field(default_factory=Catalog)
    # What pure functions derived from this snapshot, kept so each is computed once per snapshot
    # (``phase.judged``: every replica's phase and whether it is routed). A snapshot made by
    # ``dataclasses.replace`` starts without: its content may differ.
    derived: dict[type, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def used_gpus(self) -> dict[str, set[int]]:
        """GPU indexes held by replicas, per node."""
        used: dict[str, set[int]] = {}
        for r in self.replicas:
            for s in r.shards:
                used.setdefault(s.node, set()).update(s.gpus)
        return used

    def replicas_of(self, model: str) -> tuple[ReplicaView, ...]:
        return tuple(r for r in self.replicas if r.model == model)
