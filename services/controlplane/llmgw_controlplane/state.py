"""The control plane's tables, built from bus messages, and the frozen :class:`Snapshot` they yield.

Node health is judged by the control plane's own clock (the time a heartbeat *arrived*), never by the
sender's timestamp: a node whose messages were buffered during a disconnect is not fresh because its
clock says so. Every ``on_*`` method returns whether something the reconciler cares about changed, so
the caller marks the loop dirty only then (heartbeats that repeat the same state do not).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw_common.catalog import Catalog
from llmgw_common.messages import (
    Heartbeat,
    Inventory,
    LoadReport,
    Marks,
    ReplicaLoad,
    ReplicaRecord,
    ShardReport,
    ShardState,
    ShardStatus,
)
from llmgw_controlplane.snapshot import GpuView, NodeState, NodeView, ReplicaView, ShardView, Snapshot

ShardKey = tuple[str, int]


def node_health(last_seen: float, now: float, interval_s: float, missed: int, lost_s: float) -> NodeState:
    """READY, UNREACHABLE after ``missed`` silent heartbeat intervals, LOST after ``lost_s`` of silence."""
    silent = now - last_seen
    if silent > lost_s:
        return NodeState.LOST
    if silent > interval_s * missed:
        return NodeState.UNREACHABLE
    return NodeState.READY


@dataclass(slots=True)
class ShardDetail:
    """What a shard's status messages said beyond its state: the error and the engine's last lines."""

    error: str | None = None
    log_tail: tuple[str, ...] = ()


@dataclass(slots=True)
class NodeRecord:
    name: str
    # Own clock: when its last heartbeat or inventory arrived (or, for a node known only from the
    # replica table after a restart, when this control plane started: it gets the full lost timeout).
    last_seen: float
    boot_id: str = ""
    seq: int = -1
    address: str = "127.0.0.1"
    inventory: Inventory | None = None
    inventory_rev: int = 0
    heard: bool = False
    # What the node last reported, per (replica id, shard).
    shards: dict[ShardKey, ShardReport] = field(default_factory=dict)
    last_sent_at: float = 0.0
    restarts: int = 0
    # Health the last time the state was judged: a transition is an event and a reason to reconcile.
    health: NodeState = NodeState.READY
    # Bumped when anything its view shows changes (inventory content, address, heard).
    rev: int = 0
    view: NodeView | None = None
    view_rev: int = -1
    view_marks: int = -1


@dataclass(frozen=True, slots=True)
class Transition:
    node: str
    old: NodeState
    new: NodeState


class ClusterState:
    """Node and replica tables. Mutated only by the service's callbacks; read through snapshots."""

    def __init__(
        self,
        *,
        heartbeat_interval_s: float,
        unreachable_after_missed: int,
        node_lost_s: float,
        catalog: Catalog | None = None,
    ) -> None:
        self.interval_s = heartbeat_interval_s
        self.missed = unreachable_after_missed
        self.lost_s = node_lost_s
        self.nodes: dict[str, NodeRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.catalog = catalog or Catalog()
        self.catalog_version = 0
        self._marks = Marks()
        self.marks_rev = 0
        self.details: dict[ShardKey, ShardDetail] = {}
        self.loads: dict[str, ReplicaLoad] = {}
        self.heartbeats = 0
        # Replicas older than this count as created now for the startup timeout: before it, nobody
        # here could have seen them become ready (e.g. replicas adopted after a restart).
        self.observed_from = 0.0
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

    def _touch_shards(self, keys: Iterable[ShardKey]) -> None:
        for rid, _ in keys:
            self._dirty_replicas.add(rid)

    # ------------------------------------------------------------ ingest

    def _node(self, name: str, now: float) -> tuple[NodeRecord, bool]:
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = NodeRecord(name=name, last_seen=now)
            return rec, True
        return rec, False

    def _heard(self, rec: NodeRecord, boot_id: str, now: float) -> bool:
        """Common part of every message from a node; True when it matters to the reconciler."""
        changed = not rec.heard
        if not rec.heard:
            rec.heard = True
            rec.rev += 1
        if rec.boot_id != boot_id:
            if rec.boot_id:
                rec.restarts += 1
            rec.boot_id = boot_id
            rec.seq = -1
            # A restarted agent reports afresh; what the old boot said is void.
            self._touch_shards(rec.shards)
            rec.shards = {}
            changed = True
        rec.last_seen = max(rec.last_seen, now)
        if rec.health is not NodeState.READY:
            changed = True
        return changed

    def on_heartbeat(self, hb: Heartbeat, now: float) -> bool:
        self.heartbeats += 1
        rec, new = self._node(hb.node, now)
        changed = self._heard(rec, hb.boot_id, now) or new
        if hb.boot_id == rec.boot_id and hb.seq <= rec.seq:
            # Reordered or replayed after a reconnect: liveness counts, content does not.
            return changed
        rec.seq = hb.seq
        rec.last_sent_at = hb.sent_at
        if rec.address != hb.address:
            rec.address = hb.address
            rec.rev += 1
            self.generation += 1  # multi-node leaders' addresses are in assignments
            changed = True
        shards = {(s.replica_id, s.shard): s for s in hb.shards}
        now_states, before = _states(shards), _states(rec.shards)
        if now_states != before:
            changed = True
            self._touch_shards(k for k, _ in set(now_states.items()) ^ set(before.items()))
        rec.shards = shards
        return changed

    def on_inventory(self, inv: Inventory, now: float) -> bool:
        rec, _ = self._node(inv.node, now)
        changed = self._heard(rec, inv.boot_id, now)
        if rec.inventory is None or _content(rec.inventory) != _content(inv):
            # Only a change of content makes a new view; the 60 s repeat of the same inventory does not.
            rec.inventory = inv
            rec.inventory_rev += 1
            rec.rev += 1
            changed = True
        if rec.address != inv.address:
            rec.address = inv.address
            rec.rev += 1
            self.generation += 1
            changed = True
        return changed

    def on_status(self, st: ShardStatus, now: float) -> bool:
        rec, _ = self._node(st.node, now)
        changed = self._heard(rec, st.boot_id, now)
        key = (st.replica_id, st.shard)
        if st.state is ShardState.FAILED or st.error or st.log_tail:
            self.details[key] = ShardDetail(st.error, tuple(st.log_tail))
        elif st.state is ShardState.READY:
            self.details.pop(key, None)
        if st.sent_at < rec.last_sent_at:
            return changed  # older than the heartbeat that already told us the state
        old = rec.shards.get(key)
        if old is None or old.state is not st.state or old.port != st.port:
            self._dirty_replicas.add(st.replica_id)
            rec.shards[key] = ShardReport(
                replica_id=st.replica_id,
                shard=st.shard,
                model=st.model,
                state=st.state,
                port=st.port,
                error=st.error,
                since=st.sent_at,
            )
            changed = True
        return changed

    def on_load(self, rep: LoadReport) -> None:
        for r in rep.replicas:
            if r.shard == 0:
                self.loads[r.replica_id] = r

    def excuse_silence(self, now: float) -> None:
        """The control plane itself was cut off from the bus: nobody's silence so far is the node's.

        Every node's clock restarts at ``now``, as after a control-plane restart; a node that really
        died is found lost ``node_lost_s`` later instead of every healthy node being lost at once.
        """
        for rec in self.nodes.values():
            rec.last_seen = max(rec.last_seen, now)

    def know_node(self, name: str, now: float) -> None:
        """A node named by the replica table that has not reported since this control plane started."""
        self._node(name, now)

    # ------------------------------------------------------------ health

    def health(self, rec: NodeRecord, now: float) -> NodeState:
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
            self.loads.pop(replica_id, None)
            for s in rec.shards:
                self.details.pop((replica_id, s.shard), None)
        return rec

    def set_catalog(self, catalog: Catalog, version: int) -> None:
        self.catalog = catalog
        self.catalog_version = version
        self.generation += 1
        self.version += 1

    # ------------------------------------------------------------ views

    def node_view(self, rec: NodeRecord, now: float) -> NodeView:
        """The node as the pure side sees it (``last_seen`` as of when the view was last rebuilt)."""
        state = self.health(rec, now)
        if rec.inventory is None and state is NodeState.READY:
            # Heartbeats but no inventory yet (e.g. just after a control-plane restart), or known only
            # from the replica table: keeps its replicas, takes no new ones until we know what it has.
            state = NodeState.UNREACHABLE
        if (
            rec.view is not None
            and rec.view.state is state
            and rec.view_rev == rec.rev
            and rec.view_marks == self.marks_rev
        ):
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
        rec.view, rec.view_rev, rec.view_marks = view, rec.rev, self.marks_rev
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
        # Inlined health and cache check: this loop runs over every node every pass.
        unreachable_after = self.interval_s * self.missed
        lost_after = self.lost_s
        marks_rev = self.marks_rev
        ready, unreachable, lost = NodeState.READY, NodeState.UNREACHABLE, NodeState.LOST
        for name, rec in self.nodes.items():
            silent = now - rec.last_seen
            state = lost if silent > lost_after else unreachable if silent > unreachable_after else ready
            if state is ready and rec.inventory is None:
                state = unreachable
            v = rec.view
            if v is None or v.state is not state or rec.view_rev != rec.rev or rec.view_marks != marks_rev:
                v = self.node_view(rec, now)
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


def _content(inv: Inventory) -> dict[str, object]:
    return inv.model_dump(exclude={"sent_at"})


def _states(shards: dict[ShardKey, ShardReport]) -> dict[ShardKey, tuple[ShardState, int | None]]:
    return {k: (v.state, v.port) for k, v in shards.items()}


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
