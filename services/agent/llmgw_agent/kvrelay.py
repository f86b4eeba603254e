"""The KV-event relay: each replica's engine events in (ZMQ SUB on its ipc:// socket), the node's
batched deltas out (``<prefix>.node.<node>.kv``), and snapshots on request (``…kv-snapshot``).

The decisions are elsewhere, on plain data: :mod:`llmgw_agent.kvtranslate` (events -> llmgw keys,
restarts, gaps), :mod:`llmgw_agent.kvdeltas` (batches, pages). This module only moves bytes: one reader
task per replica, one publishing loop, one snapshot responder, all owned by :class:`KvRelay` and
cancelled by :meth:`KvRelay.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import zmq
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from llmgw_agent import kvstate
from llmgw_agent.engines import KvSource
from llmgw_agent.kvdeltas import IDLE_S, TICK_S, DeltaBatcher, ReplicaView, snapshot_page
from llmgw_agent.kvtranslate import Change, ReplicaBlocks
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.kvcache import KvSnapshotRequest
from llmgw_common.subjects import Subjects
from llmgw_common.vllm_kv_events import KvWireError, decode_frames
from llmgw_runtime.bus import DropLog
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.agent.kvrelay")

# A publisher's messages queued before ZMQ drops (a drop shows as a sequence gap, then a resync).
RCV_HWM = 100_000
# The publishing loop wakes this often to see whether a batch is due.
POLL_S = 0.05
# Each followed replica's blocks are saved this often when they changed (kvstate.py); a restarted
# agent asks the engine to replay what came after (vLLM keeps 10,000 batches).
SAVE_S = 10.0
# How long a new reader waits for the engine's replay before following it live only.
REPLAY_TIMEOUT_S = 3.0
# vLLM's end-of-replay marker: sequence -1 as 8 signed bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class Feed:
    """One replica whose engine publishes KV events, as the agent runs it."""

    model: str
    source: KvSource
    # The engine process's identity (pid and start time); "" when unknown: its blocks are not saved.
    engine: str = ""

    @property
    def state_path(self) -> Path | None:
        """Beside the engine's socket: the relay's saved blocks of it (kvstate.py)."""
        p = self.source.ipc_path
        return p.with_name(p.name + ".state") if p is not None and self.engine else None


@dataclass
class _Reader:
    feed: Feed
    blocks: ReplicaBlocks
    sock: zmq.asyncio.Socket
    task: asyncio.Task[None] | None = None
    # The sequence number last saved; the blocks are saved again when theirs moved on.
    saved_seq: int | None = None

    @property
    def block_size(self) -> int:
        return self.blocks.block_size or self.feed.source.block_size


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load(feed: Feed) -> ReplicaBlocks | None:
    path = feed.state_path
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return kvstate.load(data, feed.engine)


@dataclass
class RelayCounters:
    batches: int = 0
    # Batches that did not decode, or came with another topic: dropped, the replica cleared.
    dropped: int = 0
    # Replicas cleared for any reason (restart, gap, drop, the engine's own AllBlocksCleared).
    clears: int = 0
    orphans: int = 0
    messages: int = 0
    snapshots: int = 0
    # Replicas whose saved blocks were taken up after an agent restart, and batches replayed to them.
    resumed: int = 0
    replayed: int = 0


@dataclass
class KvRelay:
    nc: NATS
    subjects: Subjects
    node: str
    stream: str
    clock: Callable[[], float] = time.time
    tick_s: float = TICK_S
    idle_s: float = IDLE_S
    counters: RelayCounters = field(default_factory=RelayCounters)

    def __post_init__(self) -> None:
        self.batcher = DeltaBatcher(self.node, self.stream, tick_s=self.tick_s, idle_s=self.idle_s)
        self.readers: dict[str, _Reader] = {}
        self.drops = DropLog(log)
        # Made with the first reader: an agent whose engines publish nothing holds no ZMQ threads.
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self._closed = False
        # Held from taking a batch until it is published: deltas go out in seq order whoever takes
        # them (the loop, a snapshot answer), even when a publish waits on a full buffer.
        self._sending = asyncio.Lock()
        # Replica -> why its reader last failed, until a batch is read again: a reader that fails the
        # same way at every sync (a socket that cannot be opened) says so once, not once a second.
        self._failing: dict[str, str] = {}

    # ---------------------------------------------------------------- replicas

    def sync(self, feeds: Mapping[str, Feed]) -> None:
        """Follow exactly these replicas: start readers for new ones, stop (and announce ``gone``)
        those no longer listed or whose source changed."""
        if self._closed:
            return
        for rid in [r for r, rd in self.readers.items() if feeds.get(r) != rd.feed]:
            self._drop_reader(rid)
        for rid, feed in feeds.items():
            if rid not in self.readers:
                self._add_reader(rid, feed)
        # A replica whose reader failed (cleared, no reader since) and that left: gone to receivers too,
        # or they would hold it, and this node send its idle batches, for ever.
        for rid, (model, block_size) in list(self.batcher.held.items()):
            if rid not in feeds and rid not in self.readers and rid not in self.batcher.pending:
                self.batcher.gone(rid, model, block_size)
                self._failing.pop(rid, None)

    def _add_reader(self, rid: str, feed: Feed) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        # Every topic: a message of another topic on this socket is counted and dropped, not filtered.
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Connecting before the engine binds is fine: ZMQ retries until the socket file exists.
        try:
            sock.connect(feed.source.endpoint)
        except zmq.ZMQError as e:
            # An endpoint ZMQ refuses outright (a path too long for a Unix socket): nothing is followed,
            # nothing of it may stay indexed; the next sync tries again, and it is said once.
            sock.close(linger=0)
            self.counters.clears += 1
            self.batcher.add(rid, feed.model, feed.source.block_size, Change(cleared=True))
            self._failed(rid, f"{e} ({feed.source.endpoint})")
            return
        saved = _load(feed)
        rd = _Reader(feed, saved or ReplicaBlocks(), sock)
        if saved is not None:
            # An agent restarted beside this engine: what the last one followed, to every receiver.
            self.counters.resumed += 1
            rd.saved_seq = saved.last_seq
            keys = tuple(sorted(saved.refs))
            self.batcher.add(rid, feed.model, rd.block_size, Change(cleared=True, stored=keys))
            log.info("replica %s: %d saved blocks taken up (batch %s)", rid, len(keys), saved.last_seq)
        rd.task = asyncio.create_task(self._read(rid, rd), name=f"kv-read-{rid}")
        # Closed when the task ends, however: a task cancelled before it ran never reaches a finally.
        rd.task.add_done_callback(lambda _: sock.close(linger=0))
        self.readers[rid] = rd
        if rid not in self._failing:
            log.info("following KV events of %s on %s", rid, feed.source.endpoint)

    def _drop_reader(self, rid: str) -> None:
        rd = self.readers.pop(rid)
        if rd.task is not None:
            rd.task.cancel()  # its socket is closed as it ends (_add_reader's callback)
        self.batcher.gone(rid, rd.feed.model, rd.block_size)
        path = rd.feed.state_path
        if path is not None:
            path.unlink(missing_ok=True)
        self._failing.pop(rid, None)
        log.info("replica %s left: its KV entries are dropped", rid)

    async def _read(self, rid: str, rd: _Reader) -> None:
        try:
            if rd.feed.source.replay is not None:
                await self._replay(rid, rd, rd.feed.source.replay)
            while True:
                frames = await rd.sock.recv_multipart()
                self.on_frames(rid, rd, frames)
        except zmq.ZMQError as e:
            self._restart(rid, rd, str(e))
        except Exception as e:
            # A bug in following this engine must not leave its entries standing as they were (wrong
            # from here on) nor end the agent: cleared, logged with its traceback, followed anew.
            log.exception("KV events of %s: unexpected failure", rid)
            self._restart(rid, rd, f"{type(e).__name__}: {e}")

    async def _replay(self, rid: str, rd: _Reader, endpoint: str) -> None:
        """Ask the engine for the batches after the last one followed (all it keeps when none was),
        apply them, then those that arrived live meanwhile and came after them."""
        assert self._ctx is not None
        start = 0 if rd.blocks.last_seq is None else rd.blocks.last_seq + 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        held: list[list[bytes]] = []
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            poller = zmq.asyncio.Poller()
            poller.register(dealer, zmq.POLLIN)
            poller.register(rd.sock, zmq.POLLIN)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + REPLAY_TIMEOUT_S
            while (left := deadline - loop.time()) > 0:
                ready = dict(await poller.poll(left * 1000))
                if rd.sock in ready:
                    held.append(await rd.sock.recv_multipart())
                if dealer in ready:
                    frames = (await dealer.recv_multipart())[1:]  # after the empty delimiter
                    if len(frames) == 3 and frames[0] == b"" and frames[1] == END_SEQ:
                        break
                    self.counters.replayed += 1
                    self.on_frames(rid, rd, frames)
        finally:
            dealer.close(linger=0)
        for frames in held:
            last = rd.blocks.last_seq
            if (
                last is not None
                and len(frames) == 3
                and len(frames[1]) == 8
                and int.from_bytes(frames[1]) <= last
            ):
                continue  # replayed already
            self.on_frames(rid, rd, frames)

    def _failed(self, rid: str, why: str) -> None:
        if self._failing.get(rid) != why:
            log.warning("KV events of %s: %s; following it anew (said once while it goes on)", rid, why)
            self._failing[rid] = why

    def _restart(self, rid: str, rd: _Reader, why: str) -> None:
        """The reader ended: the replica is cleared, and the next sync follows it with a new one."""
        self._failed(rid, why)
        if self.readers.get(rid) is rd:
            del self.readers[rid]
            self.counters.clears += 1
            self.batcher.add(rid, rd.feed.model, rd.block_size, rd.blocks.lost(why))

    def on_frames(self, rid: str, rd: _Reader, frames: list[bytes]) -> None:
        self.counters.batches += 1
        self._failing.pop(rid, None)
        try:
            topic, seq, batch = decode_frames(frames)
        except KvWireError as e:
            change = self._lost(rid, rd, f"undecodable KV-event batch: {e}")
        else:
            if topic != rd.feed.source.topic:
                change = self._lost(
                    rid, rd, f"KV-event batch of topic {topic!r}, expected {rd.feed.source.topic!r}"
                )
            else:
                change = rd.blocks.apply(seq, batch)
                if change.cleared:
                    self.counters.clears += 1
                    if change.reason:
                        log.info("replica %s: KV entries cleared: %s", rid, change.reason)
        self.counters.orphans += change.orphans
        self.batcher.add(rid, rd.feed.model, rd.block_size, change)

    def _lost(self, rid: str, rd: _Reader, why: str) -> Change:
        self.counters.dropped += 1
        self.counters.clears += 1
        self.drops.drop(f"{rd.feed.source.endpoint} ({rid})", f"{why}; the replica's entries are cleared")
        return rd.blocks.lost(why)

    # ---------------------------------------------------------------- bus

    async def _publish(self, subject: str, msg: BaseModel) -> None:
        try:
            await self.nc.publish(subject, encode(msg))
            self.counters.messages += 1
        except nats.errors.Error as e:
            log.warning("cannot publish on %s: %s", subject, e)

    async def flush_deltas(self) -> None:
        """Publish everything pending now (a snapshot is taken after it, at its ``seq``)."""
        async with self._sending:
            for m in self.batcher.take(self.clock()):
                await self._publish(self.subjects.kv(self.node), m)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_save = loop.time() + SAVE_S
        while True:
            if self.batcher.due(self.clock()):
                await self.flush_deltas()
            if loop.time() >= next_save:
                await self.save()
                next_save = loop.time() + SAVE_S
            await asyncio.sleep(POLL_S)

    async def save(self) -> None:
        """Save each replica's blocks that moved on since their last save (kvstate.py)."""
        for rid, rd in list(self.readers.items()):
            path = rd.feed.state_path
            seq = rd.blocks.last_seq
            if path is None or seq is None or seq == rd.saved_seq:
                continue
            data = kvstate.dump(rd.feed.engine, rd.blocks)
            try:
                await asyncio.to_thread(_write_atomic, path, data)
            except OSError as e:
                log.warning("cannot save the KV blocks of %s in %s: %s", rid, path, e)
                continue
            rd.saved_seq = seq

    def views(self) -> dict[str, ReplicaView]:
        return {
            rid: ReplicaView(rd.feed.model, rd.block_size, rd.blocks.refs.keys())
            for rid, rd in self.readers.items()
        }

    async def _on_snapshot(self, msg: Msg) -> None:
        try:
            req = decode(msg.data, KvSnapshotRequest)
        except DecodeError as e:
            self.drops.drop(msg.subject, str(e))
            return
        if not msg.reply:
            return
        async with self._sending:
            # Pending changes first, taken and built without an await between: the page is the state
            # after the batcher's seq exactly.
            pending = self.batcher.take(self.clock()) if self.batcher.changed() else []
            page = snapshot_page(
                req, self.views(), node=self.node, stream=self.stream, seq=self.batcher.seq, now=self.clock()
            )
            for m in pending:
                await self._publish(self.subjects.kv(self.node), m)
        self.counters.snapshots += 1
        try:
            await msg.respond(encode(page))
        except nats.errors.Error as e:
            log.warning("cannot answer a KV snapshot request: %s", e)

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.kv_snapshot(self.node), cb=self._on_snapshot)
        self._tasks.append(asyncio.create_task(self._loop(), name="kv-relay"))

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks)

    async def stop(self) -> None:
        """Stop reading, announce every replica gone, publish the last batch."""
        self._closed = True
        await cancel_and_wait(self._tasks)
        readers = [rd.task for rd in self.readers.values() if rd.task is not None]
        for rid in list(self.readers):
            self._drop_reader(rid)
        await cancel_and_wait(readers)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        if self.batcher.changed():
            await self.flush_deltas()
        if self._ctx is not None:
            # destroy, not term: term waits (blocking the loop) for any socket still open.
            self._ctx.destroy(linger=0)
