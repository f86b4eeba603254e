"""How node reports change the tables (:class:`NodeReports`, a part of :class:`ClusterState`).

Every ``on_*`` method returns whether something the reconciler cares about changed, so the caller marks
the loop dirty only then (heartbeats that repeat the same state do not). What a message claims is
believed only as far as it can be (one bad message must not stop or freeze a node's replicas; each
refusal is one rate-limited log line):

- a sender's time that is not finite or lies in our future (:mod:`llmgw_runtime.clockcheck`) voids the
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

from collections.abc import Iterable

from llmgw_common.messages import Heartbeat, Inventory, ShardReport, ShardState, ShardStatus
from llmgw_common.names import clipped
from llmgw_controlplane.nodes import ERROR_CHARS, NodeRecord, ShardDetail, ShardKey, short_error
from llmgw_controlplane.scheduler.snapshot import NodeState
from llmgw_controlplane.seqcheck import seq_believed
from llmgw_runtime.clockcheck import Doubts, distrust, order_time


class NodeReports:
    """The node-report half of :class:`ClusterState`: the tables it changes are declared here and
    built by ``ClusterState.__init__``."""

    nodes: dict[str, NodeRecord]
    doubts: Doubts
    interval_s: float
    heartbeats: int
    generation: int
    readopted: dict[tuple[str, str], float]
    _dirty_replicas: set[str]

    def _touch_shards(self, keys: Iterable[ShardKey]) -> None:
        for rid, _ in keys:
            self._dirty_replicas.add(rid)

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

    def _time_believed(self, node: str, kind: str, sent_at: float, now: float) -> bool:
        """Whether a report's send time is one to act on (llmgw_runtime.clockcheck); else one doubt line."""
        why = distrust(sent_at, now)
        if why is not None:
            self._doubt(node, "time", f"{kind}: {why}", now)
            return False
        return True

    def _set_address(self, rec: NodeRecord, address: str) -> bool:
        """Take a node's new address; True when it changed (multi-node leaders' addresses are in
        assignments, so the generation moves too)."""
        if rec.address == address:
            return False
        rec.address = address
        rec.rev += 1
        self.generation += 1
        return True

    def on_heartbeat(self, hb: Heartbeat, now: float) -> bool:
        self.heartbeats += 1
        if not self._time_believed(hb.node, "heartbeat", hb.sent_at, now):
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
        changed |= self._set_address(rec, hb.address)
        shards = {(s.replica_id, s.shard): short_error(s) for s in hb.shards}
        now_states, before = _states(shards), _states(rec.shards)
        if now_states != before:
            changed = True
            self._touch_shards(k for k, _ in set(now_states.items()) ^ set(before.items()))
        rec.shards = shards
        return changed

    def on_inventory(self, inv: Inventory, now: float) -> bool:
        if not self._time_believed(inv.node, "inventory", inv.sent_at, now):
            return False
        rec, _ = self._node(inv.node, now)
        changed = bool(self._heard(rec, inv.boot_id, now, proof=True))
        if rec.inventory is None or _content(rec.inventory) != _content(inv):
            # Only a change of content makes a new view; the 60 s repeat of the same inventory does not.
            rec.inventory = inv
            rec.rev += 1
            changed = True
        changed |= self._set_address(rec, inv.address)
        return changed

    def on_status(self, st: ShardStatus, now: float) -> bool:
        if not self._time_believed(st.node, "status", st.sent_at, now):
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


def _content(inv: Inventory) -> dict[str, object]:
    return inv.model_dump(exclude={"sent_at"})


def _states(shards: dict[ShardKey, ShardReport]) -> dict[ShardKey, tuple[ShardState, int | None]]:
    return {k: (v.state, v.port) for k, v in shards.items()}
