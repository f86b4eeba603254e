"""The control plane's tables, built from bus messages, and the frozen :class:`Snapshot` they yield.

Node health is judged by the control plane's own clock (the time a heartbeat *arrived*), never by the
sender's timestamp: a node whose messages were buffered during a disconnect is not fresh because its
clock says so. Every ``on_*`` method returns whether something the reconciler cares about changed, so
the caller marks the loop dirty only then (heartbeats that repeat the same state do not).

What a message claims is believed only as far as it can be (one bad message must not stop or freeze a
node's replicas; each refusal is one rate-limited log line):

- a sender's time that is not finite or lies in our future (:mod:`llmgw_common.clockcheck`) voids the
  whole message;
- a new ``boot_id`` (an agent restart) is believed only from an inventory of that boot, which the agent
  sends first; heartbeats and statuses of an unproven boot are ignored and the service asks the node for
  its inventory. What the old boot said of its shards stands until the new boot's first heartbeat
  replaces it (the agent re-adopts its running engines before that heartbeat);
- a heartbeat ``seq`` may jump ahead only as far as the time since the last one allows
  (:mod:`seqcheck`), so a forged huge seq cannot make every genuine heartbeat look like a replay;
- replicas that were ready when their node's agent restarted count their startup timeout from the
  restart: the new agent re-adopts their engines and checks them again before it reports them ready.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw_common.catalog import Catalog
from llmgw_common.clockcheck import Doubts, distrust, order_time
from llmgw_common.messages import (
    Heartbeat,
    Inventory,
    Marks,
    ReplicaRecord,
    ShardReport,
    ShardState,
    ShardStatus,
)
from llmgw_common.names import clipped
from llmgw_controlplane.seqcheck import seq_believed
from llmgw_controlplane.snapshot import GpuView, NodeState, NodeView, ReplicaView, ShardView, Snapshot

ShardKey = tuple[str, int]

# A shard's error as a node reports it is kept to this many characters: it reaches crash-loop reasons,
# the routing table (one KV value for every model) and events, which a node must not be able to make
# larger than the server's max_payload (every routing write then failed, for every model).
ERROR_CHARS = 1000


def _short_error(rep: ShardReport) -> ShardReport:
    if rep.error is None or len(rep.error) <= ERROR_CHARS:
        return rep
    return rep.model_copy(update={"error": clipped(rep.error, ERROR_CHARS)})


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
    # A different boot some heartbeat or status claimed, not proven by an inventory yet ("" when none).
    unproven_boot: str = ""
    seq: int = -1
    # Own clock: when the heartbeat numbered ``seq`` came.
    seq_at: float = 0.0
    # A seq that jumped further than time allows, and when: believed once the next one follows it.
    seq_jump: tuple[int, float] | None = None
    address: str = "127.0.0.1"
    inventory: Inventory | None = None
    inventory_rev: int = 0
    heard: bool = False
    # What the node last reported, per (replica id, shard).
    shards: dict[ShardKey, ShardReport] = field(default_factory=dict)
    # The error and log tail its status messages gave, per (replica id, shard). Kept per node: a node's
    # reports describe its own shards only, never the same replica id's shard on another node.
    details: dict[ShardKey, ShardDetail] = field(default_factory=dict)
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

    def _heard(self, rec: NodeRecord, boot_id: str, now: float, *, proof: bool = False) -> bool | None:
        """Common part of every message from a node; True when it matters to the reconciler.

        None when the message claims a boot other than the node's and is no ``proof`` of it (only an
        inventory is): nothing of it is believed, not even that the node is alive.
        """
        changed = not rec.heard
        if rec.boot_id != boot_id:
            if rec.boot_id and not proof:
                rec.unproven_boot = boot_id
                return None
            self._new_boot(rec, boot_id, now)
            changed = True
        if proof:
            rec.unproven_boot = ""
        if not rec.heard:
            rec.heard = True
            rec.rev += 1
        rec.last_seen = max(rec.last_seen, now)
        if rec.health is not NodeState.READY:
            changed = True
        return changed

    def _new_boot(self, rec: NodeRecord, boot_id: str, now: float) -> None:
        if rec.boot_id:
            rec.restarts += 1
        for (rid, _), rep in rec.shards.items():
            if rep.state is ShardState.READY:
                self.readopted[(rec.name, rid)] = now
        rec.boot_id = boot_id
        rec.seq, rec.seq_jump, rec.last_sent_at = -1, None, float("-inf")
        # A restarted agent reports afresh, but what the old boot said stands until it does (its first
        # heartbeat replaces it whole): the engines outlive an agent, and voiding it here would take
        # their endpoints from the routers until then. The views change: see ``readopted``.
        self._touch_shards(rec.shards)

    def _doubt(self, node: str, kind: str, why: str, now: float) -> None:
        self.doubts.refuse(f"node {node}", kind, why, now)

    def _unproven(self, rec: NodeRecord, kind: str, boot_id: str, now: float) -> None:
        self._doubt(
            rec.name,
            "boot",
            f"{kind} from boot {boot_id!r}, but the node's boot is {rec.boot_id!r} and no inventory from "
            f"{boot_id!r} came yet",
            now,
        )

    def _seq_believed(self, rec: NodeRecord, seq: int, now: float) -> bool:
        """Whether a heartbeat numbered ``seq`` (same boot, newer than the last) is not an absurd jump."""
        if seq_believed(rec.seq, rec.seq_at, rec.seq_jump, seq, now, self.interval_s):
            return True
        rec.seq_jump = (seq, now)
        why = f"heartbeat seq jumped from {rec.seq} to {seq} in {now - rec.seq_at:.1f}s: held until the next follows it"
        self._doubt(rec.name, "seq", why, now)
        return False

    def wants_inventory(self, name: str) -> bool:
        """The node should be asked for its inventory: none came yet, or it must prove a new boot."""
        rec = self.nodes.get(name)
        return rec is not None and (rec.inventory is None or bool(rec.unproven_boot))

    def on_heartbeat(self, hb: Heartbeat, now: float) -> bool:
        self.heartbeats += 1
        why = distrust(hb.sent_at, now)
        if why is not None:
            self._doubt(hb.node, "time", f"heartbeat: {why}", now)
            return False
        rec, new = self._node(hb.node, now)
        heard = self._heard(rec, hb.boot_id, now)
        if heard is None:
            self._unproven(rec, "heartbeat", hb.boot_id, now)
            return new
        changed = heard or new
        if hb.seq <= rec.seq or not self._seq_believed(rec, hb.seq, now):
            # Reordered or replayed after a reconnect: liveness counts, content does not.
            return changed
        rec.seq, rec.seq_at, rec.seq_jump = hb.seq, now, None
        rec.last_sent_at = order_time(hb.sent_at, now)
        if rec.address != hb.address:
            rec.address = hb.address
            rec.rev += 1
            self.generation += 1  # multi-node leaders' addresses are in assignments
            changed = True
        shards = {(s.replica_id, s.shard): _short_error(s) for s in hb.shards}
        now_states, before = _states(shards), _states(rec.shards)
        if now_states != before:
            changed = True
            self._touch_shards(k for k, _ in set(now_states.items()) ^ set(before.items()))
        rec.shards = shards
        return changed

    def on_inventory(self, inv: Inventory, now: float) -> bool:
        why = distrust(inv.sent_at, now)
        if why is not None:
            self._doubt(inv.node, "time", f"inventory: {why}", now)
            return False
        rec, _ = self._node(inv.node, now)
        changed = bool(self._heard(rec, inv.boot_id, now, proof=True))
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
        why = distrust(st.sent_at, now)
        if why is not None:
            self._doubt(st.node, "time", f"status: {why}", now)
            return False
        rec, _ = self._node(st.node, now)
        heard = self._heard(rec, st.boot_id, now)
        if heard is None:
            self._unproven(rec, "status", st.boot_id, now)
            return False
        changed = heard
        key = (st.replica_id, st.shard)
        error = clipped(st.error, ERROR_CHARS) if st.error is not None else None
        if st.state is ShardState.FAILED or error or st.log_tail:
            rec.details[key] = ShardDetail(error, tuple(st.log_tail))
        elif st.state is ShardState.READY:
            rec.details.pop(key, None)
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
                error=error,
                since=st.sent_at,
            )
            changed = True
        return changed

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
