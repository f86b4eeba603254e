"""A stand-in for an agent's KV relay, on a real bus: it publishes real :class:`KvDeltas` and answers
:class:`KvSnapshotRequest` with real :class:`KvSnapshot` pages, as ``docs/bus.md`` says an agent does.

It holds what its replicas cache as plain sets, so a test compares a router's index with the truth.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common.codec import decode, encode
from llmgw_common.kvcache import KvDeltas, KvSnapshot, KvSnapshotRequest, ReplicaKv
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import flush


class FakeKvAgent:
    def __init__(
        self, nc: NATS, subjects: Subjects, node: str, *, page_keys: int = 1000, block_size: int = 4
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.node = node
        self.page_keys = page_keys
        self.block_size = block_size
        self.stream = uuid.uuid4().hex
        self.seq = 0
        # replica -> (model, its keys in the order stored)
        self.sets: dict[str, tuple[str, dict[int, None]]] = {}
        self.snapshot_requests = 0
        # Called on each snapshot request before the answer is made (a change racing the snapshot).
        self.before_answer: Callable[[], Awaitable[None]] | None = None
        # Called after the answer's state was taken, before it is sent.
        self.after_capture: Callable[[], Awaitable[None]] | None = None
        self._sub: Subscription | None = None
        self._frozen: tuple[str, int, dict[str, tuple[str, list[int]]]] | None = None

    async def serve(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.kv_snapshot(self.node), cb=self._answer)
        await flush(self.nc)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    # ------------------------------------------------------------------ changes

    def change(
        self,
        replica: str,
        stored: list[int] | None = None,
        removed: list[int] | None = None,
        *,
        model: str = "m",
        gone: bool = False,
    ) -> ReplicaKv:
        """Apply a change to the truth and return it as a delta entry."""
        stored, removed = stored or [], removed or []
        if gone:
            self.sets.pop(replica, None)
        else:
            _, keys = self.sets.setdefault(replica, (model, {}))
            for k in stored:
                keys[k] = None
            for k in removed:
                keys.pop(k, None)
        return ReplicaKv(
            replica=replica,
            model=model,
            block_size=self.block_size,
            stored=stored,
            removed=removed,
            gone=gone,
        )

    async def publish(self, *changes: ReplicaKv, lost: bool = False) -> int:
        """One batch with the next seq; ``lost``: numbered but never sent (a gap the router must see)."""
        self.seq += 1
        if not lost:
            d = KvDeltas(
                node=self.node, stream=self.stream, seq=self.seq, sent_at=time.time(), replicas=list(changes)
            )
            await self.nc.publish(self.subjects.kv(self.node), encode(d))
            await flush(self.nc)
        return self.seq

    def restart(self) -> None:
        """A new agent process: a new stream from seq 0, and its engines' caches empty."""
        self.stream = uuid.uuid4().hex
        self.seq = 0
        self.sets.clear()

    def truth(self, replica: str) -> set[int]:
        return set(self.sets[replica][1]) if replica in self.sets else set()

    # ------------------------------------------------------------------ snapshots

    async def _answer(self, msg: Msg) -> None:
        self.snapshot_requests += 1
        req = decode(msg.data, KvSnapshotRequest)
        if self.before_answer is not None:
            await self.before_answer()
        if req.replica is None or self._frozen is None:
            # A first page freezes the sets, so every page of this snapshot is of one seq (as an agent
            # pages over a copy: offsets into a set that changes would skip keys).
            self._frozen = (self.stream, self.seq, {r: (m, list(ks)) for r, (m, ks) in self.sets.items()})
        stream, seq, sets = self._frozen
        order = sorted(sets)
        start = order.index(req.replica) if req.replica in order else 0
        offset = req.offset if req.replica in order else 0
        page: list[ReplicaKv] = []
        room = self.page_keys
        nxt: tuple[str | None, int] = (None, 0)
        for i in range(start, len(order)):
            r = order[i]
            model, keys = sets[r]
            ks = keys[offset:]
            take = ks[:room]
            page.append(ReplicaKv(replica=r, model=model, block_size=self.block_size, stored=take))
            room -= len(take)
            if len(take) < len(ks):
                nxt = (r, offset + len(take))
                break
            offset = 0
            if room <= 0 and i + 1 < len(order):
                nxt = (order[i + 1], 0)
                break
        if self.after_capture is not None:
            await self.after_capture()
        snap = KvSnapshot(
            node=self.node,
            stream=stream,
            seq=seq,
            sent_at=time.time(),
            running=order,
            replicas=page,
            next_replica=nxt[0],
            next_offset=nxt[1],
        )
        await msg.respond(encode(snap))
