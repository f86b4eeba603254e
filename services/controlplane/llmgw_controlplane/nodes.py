"""What the control plane keeps of each node: its record (last reports, own-clock times, boot and seq
bookkeeping, cached view), health by silence, and the transitions judging it yields."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_common.messages import Inventory, ShardReport
from llmgw_common.names import clipped
from llmgw_controlplane.scheduler.snapshot import NodeState, NodeView

ShardKey = tuple[str, int]

# A shard's error as a node reports it is kept to this many characters: it reaches crash-loop reasons,
# the routing table (one KV value for every model) and events, which a node must not be able to make
# larger than the server's max_payload (every routing write then failed, for every model).
ERROR_CHARS = 1000


def short_error(rep: ShardReport) -> ShardReport:
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
    # The view last built, and what it was built from: (rev, the marks' revision). Its health is in it.
    view: NodeView | None = None
    view_key: tuple[int, int] = (-1, -1)


@dataclass(frozen=True, slots=True)
class Transition:
    node: str
    old: NodeState
    new: NodeState
