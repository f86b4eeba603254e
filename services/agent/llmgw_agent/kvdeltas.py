"""The node's KV-cache changes, batched into :class:`KvDeltas` and paged into :class:`KvSnapshot`: pure.

:class:`DeltaBatcher` keeps, per replica, what changed since the last message it produced, net of
itself (a block stored then removed before a tick is sent as nothing), and decides when a message is
due: every ``tick_s`` while something changed, and an empty one every ``idle_s`` otherwise, so a router
that missed the last batch sees the next ``seq`` and asks for a snapshot. The empty ones go only while
a receiver holds some replica of the node, and once more after the message that left it holding none
(its loss is then noticed too): a node with no replica that publishes KV events sends nothing, which at
50,000 nodes was 10,000 messages a second to every router (bench/RESULTS.md, issue 35). A router learns
of such a node's stream from its snapshot or its first batch that names a replica. A message over
:data:`MAX_KEYS_PER_MESSAGE` keys is split into several, with consecutive ``seq``.

:func:`snapshot_page` answers one :class:`KvSnapshotRequest` from the node's current key sets, which
are the state after the batcher's last ``seq`` when pending changes are taken first (the relay does).
Pages are sorted by replica id, and a replica's keys in ascending order; ``next_offset`` is the first
key of the next page (a key, not a position: a key stored or removed between two pages shifts no
page, and one missed that way comes as a delta after the page's ``seq``). The first replica of a page
starts at the request's offset, every other one at 0 (it replaces what the receiver held).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw_agent.kvtranslate import Change
from llmgw_common.kvcache import MAX_KEYS_PER_MESSAGE, KvDeltas, KvSnapshot, KvSnapshotRequest, ReplicaKv

# While blocks change: at most one message per this many seconds per node. An agent's next step follows
# its last answer at once: at 150 ms the index lagged it, and three routers' hit rate fell to 0.90x one
# router's (bench/kv_routing.py, agent; a router knows only its own sends before the events come).
TICK_S = 0.05
# While nothing changes: an empty message this often (a receiver notices a lost trailing batch).
IDLE_S = 5.0


@dataclass
class Pending:
    """One replica's changes since the last message, net: ``stored`` never held by a receiver that
    applied every message so far, ``removed`` held by it; ``cleared`` empties it first."""

    model: str
    block_size: int
    cleared: bool = False
    gone: bool = False
    stored: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)

    def add(self, c: Change) -> None:
        if c.cleared:
            self.cleared = True
            self.stored.clear()
            self.removed.clear()
        for k in c.removed:
            if k in self.stored:
                self.stored.discard(k)
            else:
                self.removed.add(k)
        for k in c.stored:
            if k in self.removed:
                self.removed.discard(k)
            else:
                self.stored.add(k)

    @property
    def empty(self) -> bool:
        return not (self.cleared or self.gone or self.stored or self.removed)


@dataclass
class DeltaBatcher:
    node: str
    stream: str
    tick_s: float = TICK_S
    idle_s: float = IDLE_S
    max_keys: int = MAX_KEYS_PER_MESSAGE
    seq: int = 0
    sent_at: float = float("-inf")
    pending: dict[str, Pending] = field(default_factory=dict)
    # The replicas a receiver of every message so far holds (named, not gone since): model, block size.
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    # The last message named some replica: one empty message is owed even when none is held.
    trailing: bool = False

    def add(self, replica: str, model: str, block_size: int, c: Change) -> None:
        if c.empty:
            return
        p = self.pending.get(replica)
        if p is None or p.gone:
            p = self.pending[replica] = Pending(model, block_size, cleared=p is not None)
        p.block_size = block_size
        p.add(c)

    def gone(self, replica: str, model: str, block_size: int) -> None:
        """The replica left the node: receivers drop it whole (what was pending for it no longer matters)."""
        self.pending[replica] = Pending(model, block_size, gone=True)

    def changed(self) -> bool:
        return any(not p.empty for p in self.pending.values())

    def due(self, now: float) -> bool:
        if self.changed():
            return now - self.sent_at >= self.tick_s
        if not (self.held or self.trailing):
            return False  # nothing held anywhere: a lost message would have nothing to be noticed for
        return now - self.sent_at >= self.idle_s

    def take(self, now: float) -> list[KvDeltas]:
        """The messages for everything pending (one empty message when nothing is), in order."""
        entries: list[ReplicaKv] = []
        for rid in sorted(self.pending):
            p = self.pending[rid]
            if not p.empty:
                entries += _split(rid, p, self.max_keys)
                if p.gone:
                    self.held.pop(rid, None)
                else:
                    self.held[rid] = (p.model, p.block_size)
        self.pending.clear()
        self.trailing = bool(entries)
        self.sent_at = now
        out: list[KvDeltas] = []
        batch: list[ReplicaKv] = []
        size = 0
        for e in entries:
            n = len(e.stored) + len(e.removed)
            if batch and size + n > self.max_keys:
                out.append(self._message(batch, now))
                batch, size = [], 0
            batch.append(e)
            size += n
        if batch or not out:
            out.append(self._message(batch, now))
        return out

    def _message(self, replicas: list[ReplicaKv], now: float) -> KvDeltas:
        self.seq += 1
        return KvDeltas(node=self.node, stream=self.stream, seq=self.seq, sent_at=now, replicas=replicas)


def _split(rid: str, p: Pending, max_keys: int) -> list[ReplicaKv]:
    """One replica's pending changes as entries of at most ``max_keys`` keys; only the first clears."""
    if p.gone:
        return [ReplicaKv(replica=rid, model=p.model, block_size=p.block_size, gone=True)]
    keys = [(True, k) for k in sorted(p.stored)] + [(False, k) for k in sorted(p.removed)]
    out: list[ReplicaKv] = []
    for start in range(0, max(len(keys), 1), max_keys):
        part = keys[start : start + max_keys]
        out.append(
            ReplicaKv(
                replica=rid,
                model=p.model,
                block_size=p.block_size,
                cleared=p.cleared and start == 0,
                stored=[k for s, k in part if s],
                removed=[k for s, k in part if not s],
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a snapshot says of one replica: its model, block size and current keys."""

    model: str
    block_size: int
    keys: Iterable[int]


def snapshot_page(
    req: KvSnapshotRequest,
    replicas: Mapping[str, ReplicaView],
    *,
    node: str,
    stream: str,
    seq: int,
    now: float,
    max_keys: int = MAX_KEYS_PER_MESSAGE,
) -> KvSnapshot:
    """One page of the node's block sets from where ``req`` says, up to ``max_keys`` keys."""
    names = sorted(replicas)
    page: list[ReplicaKv] = []
    budget = max_keys
    next_replica: str | None = None
    next_offset = 0
    start = req.replica
    for rid in names:
        if start is not None and rid < start:
            continue
        offset = req.offset if rid == start else 0
        v = replicas[rid]
        keys = sorted(k for k in v.keys if k >= offset)
        if page and len(keys) > budget:
            next_replica, next_offset = rid, offset
            break
        taken = keys[:budget]
        # cleared on a replica's first page: it replaces what the receiver held of it.
        entry = ReplicaKv(
            replica=rid, model=v.model, block_size=v.block_size, cleared=offset == 0, stored=taken
        )
        page.append(entry)
        budget -= len(taken)
        if len(keys) > len(taken):
            next_replica, next_offset = rid, keys[len(taken)]
            break
    return KvSnapshot(
        node=node,
        stream=stream,
        seq=seq,
        sent_at=now,
        running=names,
        replicas=page,
        next_replica=next_replica,
        next_offset=next_offset,
    )
