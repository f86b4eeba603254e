"""The bus side of the exact index: the agents' KV deltas in, snapshots asked for, the index kept whole.

Subscribes ``<prefix>.node.*.kv`` with a callback; each :class:`KvDeltas` goes through the node's feed
(``feeds.py``: apply in order, hold while a snapshot comes, or resync). A snapshot is asked by
request/reply on ``<prefix>.node.<node>.kv-snapshot``, page by page, at most ``concurrency`` nodes at a
time: on start for every node the caller names (those holding an endpoint in the routing table), so a
router that starts or restarts holds the whole index within seconds; on a gap or a new stream; and again
after a backoff where one failed. A periodic pass (level-triggered) asks for nodes never heard of.

A message that does not decode, or whose node is not its subject's, is dropped with one log line and
counted; it never reaches the index. Replicas that leave the routing table are dropped by
:meth:`KvEventFollower.retain`, called by the wiring with the current replica ids.

Measured (``tests/router/cache/test_cache_follower.py``, the last test, on the loaded 2-core build
machine, router and stand-in agents in one process): a starting router took 100,000 blocks from 4 nodes
in 0.05-0.16 s and 1,000,000 in 1.0 s (20,000-key pages, 4 nodes at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.errors import BadMessage
from llmgw_common.kvcache import KvDeltas, KvSnapshot, KvSnapshotRequest, ReplicaKv
from llmgw_common.names import visible
from llmgw_common.subjects import Subjects
from llmgw_router.cache.feeds import MAX_HELD, Delta, Feeds
from llmgw_router.cache.index import KvIndex
from llmgw_runtime.bus import DropLog, flush
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.router.cache.follower")

# Pages of one snapshot at most (a page holds up to 60,000 keys): a node that keeps answering "next" past
# this is refused, not followed forever.
MAX_PAGES = 10_000


class SnapshotError(BadMessage):
    """A node's snapshot could not be had whole: a reply that contradicts the others, or no progress."""


@dataclass(slots=True)
class _Snapshot:
    stream: str
    seq: int
    sent_at: float
    running: set[str]
    # replica -> (model, block size, keys)
    replicas: dict[str, tuple[str, int, list[int]]] = field(default_factory=dict)


class KvEventFollower:
    """Feeds a :class:`KvIndex` from the bus. ``nodes()`` names the nodes holding an endpoint now."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        index: KvIndex,
        nodes: Callable[[], Iterable[str]],
        *,
        clock: Callable[[], float] = time.time,
        request_timeout_s: float = 2.0,
        concurrency: int = 8,
        attempts: int = 3,
        pass_s: float = 1.0,
        max_held: int = MAX_HELD,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.index = index
        self.nodes = nodes
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.attempts = attempts
        self.pass_s = pass_s
        self.feeds = Feeds(max_held)
        self.drops = DropLog(log)
        self._sem = asyncio.Semaphore(concurrency)
        self._sub: Subscription | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._syncs: dict[str, asyncio.Task[None]] = {}
        # node -> the replicas of it the index holds; replica -> its node.
        self._replicas_of: dict[str, set[str]] = {}
        self._node_of: dict[str, str] = {}
        # Numbers the wiring exposes as metrics.
        self.batches = 0
        self.snapshots = 0
        self.snapshot_failures = 0
        self.last_lag_s: float | None = None
        self.lag_by_model: dict[str, float] = {}
        # Set once every node named at start was synced or given up on.
        self.ready = asyncio.Event()

    @property
    def undecodable(self) -> int:
        """Messages dropped: undecodable, or naming another node than their subject's."""
        return self.drops.count

    async def start(self) -> None:
        """Subscribe, then ask every node named by ``nodes()`` for its snapshot (in the background: see
        ``ready``). Subscribed first, so that no batch sent while a snapshot is made is missed."""
        self._sub = await self.nc.subscribe(
            self.subjects.all_nodes("kv"), cb=self._on_msg, pending_msgs_limit=65536
        )
        await flush(self.nc)
        first = [n for n in dict.fromkeys(self.nodes()) if self._sync(n)]
        self._loop_task = asyncio.create_task(self._pass_loop(first), name="kv-follower-pass")

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        tasks = [*self._syncs.values(), *([self._loop_task] if self._loop_task else [])]
        await cancel_and_wait(tasks)
        self._syncs.clear()
        self._loop_task = None

    def retain(self, replicas: Iterable[str]) -> list[str]:
        """Drop every indexed replica not in ``replicas`` (the routing table's, now); returns those dropped."""
        gone = self.index.retain(replicas)
        for r in gone:
            self._forget_replica(r)
        return gone

    def syncing(self) -> list[str]:
        return sorted(self._syncs)

    # ------------------------------------------------------------------ deltas

    async def _on_msg(self, msg: Msg) -> None:
        try:
            d = decode(msg.data, KvDeltas)
        except DecodeError as e:
            self.drops.drop(msg.subject, str(e))
            return
        parts = msg.subject.split(".")
        if len(parts) < 2 or parts[-2] != d.node:
            self.drops.drop(msg.subject, f"a batch of node {visible(d.node)!r} on another node's subject")
            return
        now = self.clock()
        lag = now - d.sent_at
        self.last_lag_s = lag
        for r in d.replicas:
            self.lag_by_model[r.model] = lag
        what = self.feeds.on_delta(d, now)
        if what is Delta.APPLY:
            self._apply(d)
        elif what is Delta.RESTART:
            self._drop_node(d.node)
            self._apply(d)
        elif what is Delta.SYNC:
            log.info("node %s: %s, asking for a snapshot", visible(d.node), "new stream or gap")
            self._start_sync(d.node)

    def _apply(self, d: KvDeltas) -> None:
        self.batches += 1
        for r in d.replicas:
            self._apply_replica(d.node, r)

    def _apply_replica(self, node: str, r: ReplicaKv) -> None:
        self.index.apply(r)
        if r.gone:
            self._forget_replica(r.replica)
        else:
            self._place(node, r.replica)

    # ------------------------------------------------------------------ snapshots

    def _sync(self, node: str) -> bool:
        """Ask ``node`` for a snapshot unless one is coming; True if this started one."""
        if not self.feeds.begin_sync(node):
            return False
        self._start_sync(node)
        return True

    def _start_sync(self, node: str) -> None:
        t = asyncio.create_task(self._sync_node(node), name=f"kv-snapshot-{node}")
        self._syncs[node] = t
        t.add_done_callback(functools.partial(self._sync_done, node))

    def _sync_done(self, node: str, t: asyncio.Task[None]) -> None:
        if self._syncs.get(node) is t:
            del self._syncs[node]
        if not t.cancelled() and t.exception() is not None:
            log.error("node %s: the snapshot task failed", visible(node), exc_info=t.exception())
            # Not left holding the node's batches forever: as a failed snapshot, retried after a backoff.
            self._drop_node(node)
            for d in self.feeds.snapshot_failed(node, self.clock()):
                self._apply(d)

    async def _sync_node(self, node: str) -> None:
        async with self._sem:
            for attempt in range(self.attempts):
                if attempt:
                    await asyncio.sleep(0.2 * attempt)
                try:
                    snap = await self._fetch(node)
                except (nats.errors.Error, TimeoutError, DecodeError, SnapshotError) as e:
                    why = f"{type(e).__name__}: {e}".rstrip(": ")
                    log.info(
                        "node %s: snapshot attempt %d failed (%s)", visible(node), attempt + 1, visible(why)
                    )
                    continue
                self._install(node, snap)
                later = self.feeds.snapshot_applied(node, snap.stream, snap.seq, snap.sent_at)
                if later is None:
                    log.info("node %s: batches held during the snapshot do not follow it; asking again", node)
                    continue
                self.snapshots += 1
                for d in later:
                    self._apply(d)
                return
            self.snapshot_failures += 1
            log.warning(
                "node %s: no snapshot after %d attempts; its entries dropped, following its batches from here",
                visible(node),
                self.attempts,
            )
            self._drop_node(node)
            for d in self.feeds.snapshot_failed(node, self.clock()):
                self._apply(d)

    async def _fetch(self, node: str) -> _Snapshot:
        subject = self.subjects.kv_snapshot(node)
        req = KvSnapshotRequest()
        snap: _Snapshot | None = None
        asked: set[tuple[str | None, int]] = set()
        for _ in range(MAX_PAGES):
            asked.add((req.replica, req.offset))
            msg = await self.nc.request(subject, encode(req), timeout=self.request_timeout_s)
            page = decode(msg.data, KvSnapshot)
            if page.node != node:
                raise SnapshotError(f"a page of node {page.node!r}")
            if snap is None:
                snap = _Snapshot(page.stream, page.seq, page.sent_at, set(page.running))
            elif page.stream != snap.stream:
                raise SnapshotError("the agent restarted between pages")
            else:
                # Pages made at different seqs: the held batches are replayed from the earliest (a batch
                # applied twice in order leaves the same sets).
                snap.seq = min(snap.seq, page.seq)
                snap.sent_at = min(snap.sent_at, page.sent_at)
                snap.running = set(page.running)
            for r in page.replicas:
                _, _, keys = snap.replicas.setdefault(r.replica, (r.model, r.block_size, []))
                keys.extend(r.stored)
            if page.next_replica is None:
                return snap
            req = KvSnapshotRequest(replica=page.next_replica, offset=page.next_offset)
            if (req.replica, req.offset) in asked:
                raise SnapshotError(f"asked for page {req.replica!r}@{req.offset} twice")
        raise SnapshotError(f"more than {MAX_PAGES} pages")

    def _install(self, node: str, snap: _Snapshot) -> None:
        """The node's replicas become the snapshot's: those it no longer runs are dropped."""
        for r in list(self._replicas_of.get(node, ())):
            if r not in snap.replicas or r not in snap.running:
                self.index.drop(r)
                self._forget_replica(r)
        for r, (model, block_size, keys) in snap.replicas.items():
            if r in snap.running:
                self.index.replace(r, model, block_size, keys)
                self._place(node, r)

    # ------------------------------------------------------------------ bookkeeping

    def _place(self, node: str, replica: str) -> None:
        was = self._node_of.get(replica)
        if was == node:
            return
        if was is not None:
            self._replicas_of.get(was, set()).discard(replica)
        self._node_of[replica] = node
        self._replicas_of.setdefault(node, set()).add(replica)

    def _forget_replica(self, replica: str) -> None:
        node = self._node_of.pop(replica, None)
        if node is not None:
            self._replicas_of.get(node, set()).discard(replica)

    def _drop_node(self, node: str) -> None:
        for r in list(self._replicas_of.pop(node, ())):
            self.index.drop(r)
            self._node_of.pop(r, None)

    async def _pass_loop(self, first: list[str]) -> None:
        # The first snapshots: ``ready`` once each is applied or given up on.
        await asyncio.gather(*(self._syncs[n] for n in first if n in self._syncs), return_exceptions=True)
        self.ready.set()
        while True:
            await asyncio.sleep(self.pass_s)
            # Dropped and cleared replicas' bits, a budget at a time, other work running between.
            while self.index.sweep():
                await asyncio.sleep(0)
            now = self.clock()
            for n in dict.fromkeys(self.nodes()):
                if n not in self.feeds.nodes:
                    self._sync(n)
            for n in self.feeds.due(now):
                self._sync(n)
