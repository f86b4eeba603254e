"""Node events from the cluster's announced state, so that none is lost in a change of leader.

Each leading pass compares what the cluster has ANNOUNCED of its nodes (kept in ``<prefix>_announced``,
not in this process) with what this process judges now, and announces each difference once:

- judged lost, not announced lost -> ``node.lost``;
- announced lost, judged not lost, and reporting -> ``node.recovered``;
- announced lost and gone from the table for ``node_forget_s`` -> dropped without an event (a forgotten
  node that reports again is a new node).

A node lost and back again while no control plane led (or back and lost again) is announced as it is
now, not replayed: nobody saw when it went or came, and the pairs ``node.lost``/``node.recovered`` stay
balanced. The record is written before its events are published, its ``unsent`` list cleared after
they were: a leader that stops between the two leaves them for the next, which republishes them under
the same ids (the stream's duplicate window keeps one copy). Writes are compare-and-set on the key's
revision and carry the writer's lease fence; a record written under a higher fence is never
overwritten (:class:`Fenced`), so a stale leader cannot undo what its successor announced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from llmgw_common.announced import (
    ANNOUNCED_NODES_KEY,
    AnnouncedNodes,
    NodeAnnouncement,
    NodeTurn,
)
from llmgw_common.codec import encode
from llmgw_common.event_details import EventDetails, NodeLostDetails, NodeRecoveredDetails, event
from llmgw_common.messages import Event
from llmgw_common.subjects import Subjects
from llmgw_controlplane.apply import Fenced
from llmgw_runtime import bus

log = logging.getLogger("llmgw.controlplane.events")


class FencedAbove(Fenced):
    """The record carries a higher fence than ours: a successor's, or (our lease confirmed still ours)
    one from before the leader bucket was made again, whose revisions began again from 1."""


@dataclass(frozen=True, slots=True)
class Judged:
    """What this process judges of its nodes now. Sets and lookups, not a record per node: a pass at
    5,000 nodes built one each and took 23 ms; only the announced-lost nodes are looked at one by one."""

    lost: AbstractSet[str]
    # Every node in the table.
    known: Container[str]
    # Whether a heartbeat of it arrived within node_lost_s. Not lost is not proof of life: a node known
    # only from replica records after a restart, or whose silence was excused after our own reconnect,
    # is judged ready until node_lost_s passes without a word from it.
    reporting: Callable[[str], bool]


def missed(
    announced: AnnouncedNodes, judged: Judged, now: float, forget_s: float
) -> tuple[dict[str, float], list[NodeAnnouncement]]:
    """The announced-lost table after this pass, and the announcements it takes to get there (pure)."""
    lost = dict(announced.lost)
    out: list[NodeAnnouncement] = []
    for node in sorted(judged.lost - lost.keys()):
        lost[node] = now
        out.append(NodeAnnouncement(node=node, turn=NodeTurn.LOST, at=now))
    for node in sorted(lost.keys() - judged.lost):
        if node in judged.known:
            if judged.reporting(node):
                del lost[node]
                out.append(NodeAnnouncement(node=node, turn=NodeTurn.RECOVERED, at=now))
        elif now - lost[node] > forget_s:
            del lost[node]
    return lost, out


def node_event(a: NodeAnnouncement) -> Event:
    """The event of an announcement: the same id whoever makes it, so a republished one is stored once."""
    details: EventDetails
    if a.turn is NodeTurn.LOST:
        summary, details = f"node {a.node} stopped reporting: its replicas move", NodeLostDetails()
    else:
        summary, details = f"node {a.node} reports again", NodeRecoveredDetails()
    return event(
        details, id=f"{a.turn}:{a.node}:{int(a.at * 1000)}", subject=a.node, time=a.at, summary=summary
    )


class AnnouncedStore:
    """The record in ``<prefix>_announced``, read once a tenure and written under the lease's fence."""

    def __init__(self, js: JetStreamContext, prefix: str, *, replicas: int = 1) -> None:
        self.js = js
        self.bucket = Subjects(prefix).bucket_announced
        self.replicas = replicas
        self._kv: KeyValue | None = None
        # The record as last read or written, and its revision (None: read it before the next write).
        self._rec: AnnouncedNodes | None = None
        self._rev = 0
        # Whether this tenure's fence is on the record yet (see announce: once a tenure is enough).
        self._stamped = False

    def new_tenure(self) -> None:
        """Leading (again): read what was announced meanwhile, and republish what was left unsent."""
        self._rec = None
        self._stamped = False

    def resend(self) -> None:
        """Some events never reached the stream (dropped while it was unreachable): read the record
        again next pass, which republishes its ``unsent`` (the same ids: stored once)."""
        self._rec = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            # Control planes' own, so made here, not by ensure_all (which every role runs).
            self._kv = await bus.ensure_kv(self.js, self.bucket, replicas=self.replicas, direct=False)
        return self._kv

    async def read(self) -> tuple[AnnouncedNodes | None, int]:
        kv = await self._bucket()
        rec, rev = await bus.kv_get(kv, ANNOUNCED_NODES_KEY, AnnouncedNodes)
        if rec is None and rev:
            log.warning("announced node state at revision %d did not decode: starting from none", rev)
        return rec, rev

    async def announce(self, judged: Judged, fence: int, now: float, forget_s: float) -> list[Event]:
        """Record this pass's announcements under ``fence``; the events to publish now (at a takeover,
        also those a previous leader recorded and may not have published). Raises :class:`Fenced` when
        a control plane with a higher fence wrote the record.

        Whenever the record is read afresh (a takeover, a compare-and-set lost, a write whose answer
        never came) its ``unsent`` are published again: a write of ours that landed unseen recorded
        announcements that no one published yet (seen in partition case 4: a node.recovered lost)."""
        fresh = self._rec is None
        if self._rec is None:
            rec, self._rev = await self.read()
            self._rec = rec or AnnouncedNodes(fence=0)
        rec = self._rec
        if rec.fence > fence:
            raise FencedAbove(f"announced node state written under fence {rec.fence}, ours is {fence}")
        lost, made = missed(rec, judged, now, forget_s)
        resend = rec.unsent if fresh else ()
        # The fence is stamped on a tenure's first write and on every write that carries a change, not
        # whenever it differs: the lease's revision moves on every renewal (TTL/3), and rewriting the
        # record for that alone was a write every few seconds with nothing in it. Still safe: a
        # successor's takeover revision is above every revision a stale leader ever held (renewals are
        # compare-and-set on the lease key, so the stale one cannot renew past the takeover), and the
        # successor's first write stamps a fence at least that high; so every stale fence stays below
        # what is on the record, and "a lower fence may not write over it" refuses the stale leader
        # whether the record carries the successor's first fence or a later one.
        if made or lost != rec.lost or (not self._stamped and rec.fence != fence):
            new = AnnouncedNodes(fence=fence, lost=lost, unsent=rec.unsent + tuple(made))
            if not await self._write(new):
                return []  # someone wrote meanwhile: read it again next pass, and judge against it
        for a in made:
            log.info("node %s: %s (announced state, fence %d)", a.node, a.turn, fence)
        return [node_event(a) for a in (*resend, *made)]

    async def overrule(self, fence: int) -> None:
        """Write the record read last under ``fence`` although it carries a higher one: only for a
        leader whose lease is confirmed its own (no successor can hold it), facing a fence from an
        earlier leader bucket. What it says stays (announced is announced), its unsent published next
        pass: the write is followed by a fresh read."""
        rec = self._rec
        if rec is None:
            return
        await self._write(rec.model_copy(update={"fence": fence}))
        self._rec = None

    async def sent(self, fence: int) -> None:
        """Every event announced so far is in the stream: clear the record's ``unsent``."""
        rec = self._rec
        # rec.fence is this tenure's first (or a later) fence, below ours once the lease renewed.
        if rec is None or not rec.unsent or rec.fence > fence:
            return
        await self._write(rec.model_copy(update={"unsent": (), "fence": fence}))

    async def _write(self, new: AnnouncedNodes) -> bool:
        """Compare-and-set on the revision read; False (and the record forgotten) when it moved."""
        kv = await self._bucket()
        try:
            if self._rev == 0:
                self._rev = await kv.create(ANNOUNCED_NODES_KEY, encode(new))
            else:
                self._rev = await kv.update(ANNOUNCED_NODES_KEY, encode(new), last=self._rev)
        except KeyWrongLastSequenceError:
            log.info("announced node state moved under us: reading it again")
            self._rec = None
            return False
        except (nats.errors.Error, TimeoutError):
            self._rec = None  # it may have landed: read it before writing again
            raise
        self._rec = new
        self._stamped = True
        return True
