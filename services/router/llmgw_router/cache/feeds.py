"""Each node's stream of KV deltas, in order: apply, hold while a snapshot is coming, or resync. Pure.

An agent numbers its batches (``stream`` = its boot id, ``seq`` one more per batch). A router applies a
node's batches only in order from a known base, because a lost batch may have held a removal, and
applying later ones over the hole would keep an entry the engine dropped. So:

- the next ``seq`` of the known ``stream``: apply it;
- an older or repeated ``seq``: drop it (counted);
- a new ``stream`` (the agent restarted), a gap, or a node never synced: ask the node for a snapshot, and
  hold its batches meanwhile; once the snapshot (consistent with ``seq`` Q) is applied, the held batches
  after Q are applied in order. A hole among them, or a batch of another stream, asks again;
- a snapshot that fails (no agent answers, a timeout): the node's entries are dropped, the held batches
  from the newest stream's first are applied from that empty base (right, if incomplete: every entry
  then held was stored after the base, and every later change is seen), and a snapshot is asked again
  after a backoff. A gap before then restarts that empty base at the gap, without asking.

:class:`Feeds` decides; the follower (``follower.py``) does what it says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from llmgw_common.kvcache import KvDeltas

# Batches held per node while its snapshot comes (a tick each: minutes of them); past it the oldest go,
# and the hole that leaves asks for another snapshot.
MAX_HELD = 600
# A failed snapshot is asked again after this, doubling to the cap.
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0


class Delta(Enum):
    APPLY = "apply"  # apply this batch now
    HELD = "held"  # a snapshot is coming: held
    SYNC = "sync"  # held; ask the node for a snapshot now
    RESTART = "restart"  # drop the node's entries, then apply this batch (a gap while a retry waits)
    STALE = "stale"  # old or repeated: dropped


@dataclass(slots=True)
class NodeFeed:
    node: str
    stream: str | None = None
    # The last batch applied (or the snapshot's seq).
    seq: int = 0
    syncing: bool = False
    # True once a snapshot of this stream was applied; False on an empty base after a failed one.
    whole: bool = False
    held: list[KvDeltas] = field(default_factory=list)
    failures: int = 0
    retry_at: float | None = None


class Feeds:
    """Every node's feed; what to do with each batch and snapshot."""

    def __init__(self, max_held: int = MAX_HELD) -> None:
        self.max_held = max_held
        self.nodes: dict[str, NodeFeed] = {}
        self.stale = 0
        self.gaps = 0
        self.dropped_held = 0

    def feed(self, node: str) -> NodeFeed:
        f = self.nodes.get(node)
        if f is None:
            f = self.nodes[node] = NodeFeed(node)
        return f

    def on_delta(self, d: KvDeltas, now: float) -> Delta:
        f = self.feed(d.node)
        if f.syncing:
            self._hold(f, d)
            return Delta.HELD
        if f.stream == d.stream and d.seq <= f.seq:
            self.stale += 1
            return Delta.STALE
        if f.stream == d.stream and d.seq == f.seq + 1:
            f.seq = d.seq
            return Delta.APPLY
        if f.stream is not None:
            self.gaps += 1
        if f.retry_at is not None and now < f.retry_at:
            # The node's snapshots failed lately: an empty base at this batch, not another ask yet.
            f.stream, f.seq, f.whole = d.stream, d.seq, False
            return Delta.RESTART
        f.syncing = True
        f.held = [d]
        return Delta.SYNC

    def begin_sync(self, node: str) -> bool:
        """Mark ``node`` as having a snapshot coming (its batches are held from now); False if one already is."""
        f = self.feed(node)
        if f.syncing:
            return False
        f.syncing = True
        f.held = []
        return True

    def snapshot_applied(self, node: str, stream: str, seq: int, sent_at: float) -> list[KvDeltas] | None:
        """The snapshot (``stream``, ``seq``, made at ``sent_at``) is applied: the held batches to apply
        after it, in order; or None when they cannot follow it (a hole, or a batch of another stream sent
        after it: the agent restarted meanwhile): ask again (the node stays syncing). Batches of another
        stream sent before the snapshot are an earlier life of the agent, and go."""
        f = self.feed(node)
        f.held = [d for d in f.held if (d.seq > seq if d.stream == stream else d.sent_at >= sent_at)]
        later = sorted(f.held, key=lambda d: d.seq)
        expect = seq + 1
        for d in later:
            if d.stream != stream or d.seq != expect:
                return None
            expect += 1
        f.stream, f.seq, f.whole = stream, expect - 1, True
        f.syncing, f.held, f.failures, f.retry_at = False, [], 0, None
        return later

    def snapshot_failed(self, node: str, now: float) -> list[KvDeltas]:
        """The snapshot could not be had: drop the node's entries (the caller), apply what this returns,
        and ask again at ``retry_at``."""
        f = self.feed(node)
        f.failures += 1
        f.retry_at = now + min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (f.failures - 1))
        f.syncing, f.whole = False, False
        held, f.held = f.held, []
        if not held:
            f.stream, f.seq = None, 0
            return []
        newest = held[-1].stream
        run = sorted((d for d in held if d.stream == newest), key=lambda d: d.seq)
        out = [run[0]]
        for d in run[1:]:
            if d.seq == out[-1].seq + 1:
                out.append(d)
            elif d.seq > out[-1].seq + 1:
                # A hole: start the empty base over after it.
                out = [d]
        f.stream, f.seq = newest, out[-1].seq
        return out

    def due(self, now: float) -> list[str]:
        """Nodes whose snapshot should be asked again now."""
        return [
            f.node
            for f in self.nodes.values()
            if not f.syncing and f.retry_at is not None and now >= f.retry_at
        ]

    def forget(self, node: str) -> None:
        self.nodes.pop(node, None)

    def _hold(self, f: NodeFeed, d: KvDeltas) -> None:
        f.held.append(d)
        if len(f.held) > self.max_held:
            del f.held[0]
            self.dropped_held += 1
