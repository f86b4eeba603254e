"""The control plane's tables, built from bus messages, and the frozen :class:`Snapshot` they yield.

Node health is judged by the control plane's own clock (the time a heartbeat *arrived*), never by the
sender's timestamp: a node whose messages were buffered during a disconnect is not fresh because its
clock says so. How each report changes the tables, and how far it is believed, is :mod:`reports`; what
is kept of a node, :mod:`nodes`; a replica's phase, :mod:`phase`.
"""

from __future__ import annotations

import logging
from types import MappingProxyType

from llmgw_common.catalog import Catalog
from llmgw_common.messages import Marks, ReplicaRecord
from llmgw_controlplane.nodes import ERROR_CHARS, NodeRecord, ShardDetail, ShardKey, Transition, node_health
from llmgw_controlplane.reports import NodeReports
from llmgw_controlplane.scheduler.snapshot import (
    GpuView,
    NodeState,
    NodeView,
    ReplicaView,
    ShardView,
    Snapshot,
)
from llmgw_runtime.clockcheck import Doubts

# Re-exported: tests and the other modules import these from here.
__all__ = [
    "ERROR_CHARS",
    "ClusterState",
    "NodeRecord",
    "ShardDetail",
    "ShardKey",
    "Transition",
]


class ClusterState(NodeReports):
    """Node and replica tables. Mutated only by the service's callbacks (node reports: the ``on_*``
    methods of :class:`NodeReports`); read through snapshots."""

    def __init__(
        self,
        *,
        heartbeat_interval_s: float,
        unreachable_after_missed: int,
        node_lost_s: float,
        catalog: Catalog | None = None,
        doubts: Doubts | None = None,
    ) -> None:
        self.doubts = doubts or Doubts(logging.getLogger("llmgw.controlplane"))
        self.interval_s = heartbeat_interval_s
        self.missed = unreachable_after_missed
        self.lost_s = node_lost_s
        self.nodes: dict[str, NodeRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.catalog = catalog or Catalog()
        self.catalog_version = 0
        self._marks = Marks()
        self.marks_rev = 0
        self.heartbeats = 0
        # Replicas older than this count as created now for the startup timeout: before it, nobody
        # here could have seen them become ready (e.g. replicas adopted after a restart).
        self.observed_from = 0.0
        # (node, replica) -> when that node's agent restarted while it reported a shard of the replica
        # ready: its startup timeout counts from then (the new agent re-adopts the engine and checks it
        # before saying ready). Keyed by node: a node's restart says nothing of another node's shards.
        self.readopted: dict[tuple[str, str], float] = {}
        # Bumped whenever replica records or the catalog change: cached assignments are rebuilt.
        self.generation = 0
        # Snapshot caches: views are rebuilt only for what changed, so a steady pass costs little.
        self._replica_views: dict[str, ReplicaView] = {}
        self._dirty_replicas: set[str] = set()
        self._replicas_tuple: tuple[ReplicaView, ...] = ()
        self._nodes_map: MappingProxyType[str, NodeView] = MappingProxyType({})
        # Bumped whenever a snapshot's content differs from the previous one's.
        self.version = 0

    @property
    def marks(self) -> Marks:
        return self._marks

    @marks.setter
    def marks(self, marks: Marks) -> None:
        self._marks = marks
        self.marks_rev += 1

    # ------------------------------------------------------------ health

    def health(self, rec: NodeRecord, now: float) -> NodeState:
        """How long it has been silent says (events and transitions read this)."""
        return node_health(rec.last_seen, now, self.interval_s, self.missed, self.lost_s)

    def judge(self, now: float) -> list[Transition]:
        """Update every node's health; returns the transitions since the last call."""
        out = []
        for rec in self.nodes.values():
            h = self.health(rec, now)
            if h is not rec.health:
                out.append(Transition(rec.name, rec.health, h))
                rec.health = h
        return out

    def forget_silent(self, now: float, forget_s: float) -> list[str]:
        """Remove nodes lost for longer than ``forget_s`` on which no replica record has a shard.

        Lost means silent for ``node_lost_s``, so a node goes after ``node_lost_s + forget_s`` of silence.
        A node still named by a replica record stays until that replica is rebuilt elsewhere, so nothing
        the reconciler must act on disappears. A forgotten node that reports again is a new node.
        """
        after = self.lost_s + forget_s
        silent = [name for name, rec in self.nodes.items() if now - rec.last_seen > after]
        if not silent:
            return []
        held = {sp.node for r in self.replicas.values() for sp in r.shards}
        gone = [name for name in silent if name not in held]
        for name in gone:
            del self.nodes[name]
        return gone

    def detail(self, node: str, key: ShardKey) -> ShardDetail | None:
        """What ``node``'s status messages said of its shard ``key`` beyond its state, if anything."""
        rec = self.nodes.get(node)
        return rec.details.get(key) if rec is not None else None

    def prune_reports(self) -> None:
        """Forget what reports said of replicas that neither a record nor any node's latest report names.

        A node names replica ids freely (a late status of a replica already stopped, or invented ones):
        what its statuses and restarts left (log tails, restart times) would otherwise stay for ever.
        """
        if not self.readopted and not any(rec.details for rec in self.nodes.values()):
            return
        placed = {(sp.node, rid, sp.shard) for rid, r in self.replicas.items() for sp in r.shards}
        reported: set[tuple[str, str]] = {(node, rid) for node, rid, _ in placed}
        for name, rec in self.nodes.items():
            reported.update((name, rid) for rid, _ in rec.shards)
            for key in [k for k in rec.details if k not in rec.shards and (name, *k) not in placed]:
                del rec.details[key]
        for gone in [k for k in self.readopted if k not in reported]:
            del self.readopted[gone]

    # ------------------------------------------------------------ records

    def set_replicas(self, records: dict[str, ReplicaRecord]) -> None:
        self.replicas = dict(records)
        self.generation += 1
        self._replica_views = {}
        self._dirty_replicas = set(self.replicas)
        self._replicas_tuple = ()

    def set_observed_from(self, t: float) -> None:
        self.observed_from = t
        self._dirty_replicas.update(self.replicas)

    def put_replica(self, rec: ReplicaRecord) -> None:
        self.replicas[rec.id] = rec
        self.generation += 1
        self._dirty_replicas.add(rec.id)

    def drop_replica(self, replica_id: str) -> ReplicaRecord | None:
        rec = self.replicas.pop(replica_id, None)
        if rec is not None:
            self.generation += 1
            self._dirty_replicas.add(replica_id)
            for s in rec.shards:
                self.readopted.pop((s.node, replica_id), None)
                node = self.nodes.get(s.node)
                if node is not None:
                    node.details.pop((replica_id, s.shard), None)
        return rec

    def set_catalog(self, catalog: Catalog, version: int) -> None:
        self.catalog = catalog
        self.catalog_version = version
        self.generation += 1
        self.version += 1

    # ------------------------------------------------------------ views

    def _node_view(self, rec: NodeRecord, state: NodeState) -> NodeView:
        """The node as the pure side sees it in ``state`` (``last_seen`` as of when the view was last
        rebuilt)."""
        if rec.view is not None and rec.view.state is state and rec.view_key == (rec.rev, self.marks_rev):
            return rec.view
        cordoned = rec.name in self.marks.cordoned
        deadline = self.marks.draining.get(rec.name)
        inv = rec.inventory
        if inv is None:
            view = NodeView(
                name=rec.name,
                state=state,
                address=rec.address,
                last_seen=rec.last_seen,
                cordoned=cordoned,
                draining=deadline is not None,
                drain_deadline=deadline,
            )
        else:
            view = NodeView(
                name=rec.name,
                state=state,
                fabric=inv.fabric,
                labels=MappingProxyType(dict(inv.labels)),
                engines=frozenset(inv.engines),
                gpus=tuple(
                    GpuView(g.index, g.gpu_class, g.memory_mb, g.healthy, tuple(g.reasons)) for g in inv.gpus
                ),
                memory_gb=inv.memory_gb,
                cpus=inv.cpus,
                storage_looked=inv.storage.looked,
                weights=tuple(inv.storage.weights),
                cordoned=cordoned,
                draining=deadline is not None,
                drain_deadline=deadline,
                address=rec.address,
                last_seen=rec.last_seen,
            )
        rec.view, rec.view_key = view, (rec.rev, self.marks_rev)
        return view

    def replica_view(self, rec: ReplicaRecord) -> ReplicaView:
        shards = []
        for sp in rec.shards:
            node = self.nodes.get(sp.node)
            rep = node.shards.get((rec.id, sp.shard)) if node is not None else None
            shards.append(
                ShardView(
                    shard=sp.shard,
                    node=sp.node,
                    gpus=sp.gpus,
                    port=sp.port,
                    state=rep.state if rep is not None else None,
                    error=rep.error if rep is not None else None,
                )
            )
        return ReplicaView(
            id=rec.id,
            model=rec.model,
            created=max(rec.created, self.observed_from),
            startup_from=max((self.readopted.get((sp.node, rec.id), 0.0) for sp in rec.shards), default=0.0),
            shards=tuple(shards),
            draining=rec.draining,
            draining_since=rec.draining_since,
            spec=rec.spec,
        )

    def snapshot(self, now: float) -> Snapshot:
        """The frozen view at ``now``. Reuses every view whose inputs did not change since the last one."""
        old = self._nodes_map
        changed = len(old) != len(self.nodes)
        nodes: dict[str, NodeView] = {}
        marks_rev = self.marks_rev
        # Bound once: this loop runs over every node every pass.
        health, interval_s, missed, lost_s = node_health, self.interval_s, self.missed, self.lost_s
        ready, unreachable = NodeState.READY, NodeState.UNREACHABLE
        for name, rec in self.nodes.items():
            state = health(rec.last_seen, now, interval_s, missed, lost_s)
            if state is ready and rec.inventory is None:
                # Heartbeats but no inventory yet (just after a control-plane restart, or known only from
                # the replica table): keeps its replicas, takes no new ones until we know what it has.
                state = unreachable
            v = rec.view
            if v is None or v.state is not state or rec.view_key != (rec.rev, marks_rev):
                v = self._node_view(rec, state)
            nodes[name] = v
            if not changed and old.get(name) is not v:
                changed = True
        if changed:
            self._nodes_map = MappingProxyType(nodes)
            self.version += 1
        if self._dirty_replicas:
            views = self._replica_views
            for rid in self._dirty_replicas:
                record = self.replicas.get(rid)
                if record is None:
                    views.pop(rid, None)
                else:
                    views[rid] = self.replica_view(record)
            self._dirty_replicas = set()
            self._replicas_tuple = tuple(views[k] for k in sorted(views))
            self.version += 1
        return Snapshot(now=now, nodes=self._nodes_map, replicas=self._replicas_tuple, catalog=self.catalog)
