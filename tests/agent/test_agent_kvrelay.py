"""The relay's I/O with real sockets: a ZMQ PUB sending vLLM-format frames, a real nats-server.

Frames come from a real ZMQ PUB socket (bound on ipc:// as vLLM binds), made with the same encoder the
simulator uses; deltas and snapshots are read from the bus as a router reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from nats.aio.client import Client as NATS

from llmgw_agent.engines import KvSource
from llmgw_agent.kvrelay import Feed, KvRelay
from llmgw_common.codec import decode, encode
from llmgw_common.kvcache import KvSnapshot, KvSnapshotRequest, block_keys
from llmgw_common.subjects import Subjects
from llmgw_common.vllm_kv_events import BlockRemoved, BlockStored, EventBatch, encode_frames
from llmgw_runtime.runtime import cancel_and_wait
from tests.kit.kvtap import KvTap
from tests.kit.poll import eventually

pytestmark = pytest.mark.slow
BS = 4
NODE = "n1"


class Pub:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.bind(endpoint)

    def send(self, seq: int, *events: object, topic: str = "kv") -> None:
        self.sock.send_multipart(encode_frames(topic, seq, EventBatch(1.0, tuple(events))))  # type: ignore[arg-type]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
async def relay(nc: NATS, prefix: str) -> AsyncIterator[KvRelay]:
    r = KvRelay(nc, Subjects(prefix), NODE, "boot-1", tick_s=0.05, idle_s=0.5)
    await r.start()
    yield r
    await r.stop()


def stored(hashes: tuple[int, ...], parent: int | None, start: int) -> BlockStored:
    return BlockStored(hashes, parent, tuple(range(start, start + BS * len(hashes))), BS)


async def test_deltas_restart_gap_garbage_snapshot_and_gone(
    nc: NATS, prefix: str, relay: KvRelay, tmp_path: Path
) -> None:
    subjects = Subjects(prefix)
    seen = KvTap()
    await nc.subscribe(subjects.kv(NODE), cb=seen.heard)
    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    relay.sync({"r1": Feed("m", KvSource(endpoint, "kv", BS))})
    pub = Pub(endpoint)
    try:
        k = block_keys(tuple(range(3 * BS)), BS)
        # A SUB joins a PUB some time after connecting: send until the first batch is through.
        seq = 0

        async def first_through() -> bool:
            nonlocal seq
            if not relay.readers["r1"].blocks.keys:
                pub.send(seq, stored((1, 2), None, 0))
                seq += 1
            return seen.held().get("r1") == set(k[:2])

        await eventually(first_through, timeout=10, what="the first stored blocks relayed")
        pub.send(seq, stored((3,), 2, 2 * BS), BlockRemoved((1,)))
        await eventually(lambda: seen.held()["r1"] == {k[1], k[2]}, timeout=5, what="store+remove relayed")
        assert relay.counters.clears == 0

        # The engine restarted: its sequence falls; the replica is cleared, then holds the new block.
        pub.send(0, stored((7,), None, 100))
        k7 = block_keys(tuple(range(100, 100 + BS)), BS)
        await eventually(lambda: seen.held()["r1"] == set(k7), timeout=5, what="restart cleared")
        # A gap: batch 1 never came.
        pub.send(2, stored((8,), None, 200))
        k8 = block_keys(tuple(range(200, 200 + BS)), BS)
        await eventually(lambda: seen.held()["r1"] == set(k8), timeout=5, what="gap cleared")
        assert relay.counters.clears == 2 and relay.counters.dropped == 0

        # Garbage, then a foreign topic: dropped, counted, cleared; the agent goes on.
        pub.sock.send_multipart([b"kv", b"\x00" * 8, b"\xc1garbage"])
        await eventually(lambda: relay.counters.dropped == 1, timeout=5, what="garbage dropped")
        pub.send(3, stored((9,), None, 300))
        await eventually(lambda: bool(seen.held()["r1"]), timeout=5, what="stores after garbage")
        pub.send(4, stored((10,), None, 400), topic="other")
        await eventually(lambda: relay.counters.dropped == 2, timeout=5, what="foreign topic dropped")
        await eventually(
            lambda: seen.held()["r1"] == set(), timeout=5, what="cleared after the foreign batch"
        )
        assert relay.counters.clears == 4

        # A router that starts now: a snapshot, then the deltas after its seq.
        pub.send(10, stored((11, 12), None, 500))
        k11 = block_keys(tuple(range(500, 500 + 2 * BS)), BS)
        await eventually(lambda: relay.readers["r1"].blocks.keys == set(k11), timeout=5, what="stored")
        reply = await nc.request(subjects.kv_snapshot(NODE), encode(KvSnapshotRequest()), timeout=5)
        snap = decode(reply.data, KvSnapshot)
        assert snap.node == NODE and snap.stream == "boot-1" and snap.running == ["r1"]
        assert snap.next_replica is None and [
            (r.replica, set(r.stored), r.cleared) for r in snap.replicas
        ] == [("r1", set(k11), True)]
        # Consistent with its seq: the deltas up to it hold the same set.
        await asyncio.sleep(0.2)
        upto = KvTap()
        upto.deltas = [m for m in seen.deltas if m.seq <= snap.seq]
        assert upto.held()["r1"] == set(k11)
        first = seen.deltas[0].seq  # the relay's first (empty) batch may precede the subscription
        assert [m.seq for m in seen.deltas] == list(range(first, first + len(seen.deltas)))

        # The replica stops: gone.
        relay.sync({})
        await eventually(lambda: "r1" not in seen.held() and seen.entries("r1")[-1] == (False, True), timeout=5,
                         what="gone")  # fmt: skip
    finally:
        pub.close()


async def test_an_idle_relay_sends_empty_batches_only_while_it_follows_a_replica(
    nc: NATS, prefix: str, relay: KvRelay, tmp_path: Path
) -> None:
    seen = KvTap()
    await nc.subscribe(Subjects(prefix).kv(NODE), cb=seen.heard)
    await asyncio.sleep(1.2)  # idle_s 0.5: two idle batches were due before issue 35
    assert seen.deltas == []  # a node with no replica that publishes KV events sends nothing
    # A followed replica: its first stored blocks, then empty batches now and then.
    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    relay.sync({"r1": Feed("m", KvSource(endpoint, "kv", BS))})
    pub = Pub(endpoint)
    try:
        seq = 0

        async def first_through() -> bool:
            nonlocal seq
            if not relay.readers["r1"].blocks.keys:
                pub.send(seq, stored((1,), None, 0))
                seq += 1
            return bool(seen.held().get("r1"))

        await eventually(first_through, timeout=10, what="the first stored blocks relayed")
        await eventually(lambda: len(seen.deltas) >= 3, timeout=5, what="two idle batches")
    finally:
        pub.close()
    assert seen.deltas[0].replicas and all(m.replicas == [] for m in seen.deltas[1:])
    assert [m.seq for m in seen.deltas] == list(range(1, len(seen.deltas) + 1))
    # It leaves: gone, one empty batch after it, then nothing.
    relay.sync({})
    await eventually(lambda: any(r.gone for m in seen.deltas for r in m.replicas), timeout=5, what="gone")
    await asyncio.sleep(1.5)
    after = [m for m in seen.deltas if m.seq > max(m.seq for m in seen.deltas if m.replicas)]
    assert [m.replicas for m in after] == [[]]


async def test_a_garbage_snapshot_request_is_dropped(nc: NATS, prefix: str, relay: KvRelay) -> None:
    await nc.publish(Subjects(prefix).kv_snapshot(NODE), b"\xc1", reply="_INBOX.x")
    await eventually(lambda: relay.drops.count == 1, timeout=5, what="the request dropped")
    reply = await nc.request(Subjects(prefix).kv_snapshot(NODE), encode(KvSnapshotRequest()), timeout=5)
    assert decode(reply.data, KvSnapshot).replicas == []


async def test_a_failure_inside_the_reader_clears_the_replica_and_follows_it_anew(
    nc: NATS, prefix: str, relay: KvRelay, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = KvTap()
    await nc.subscribe(Subjects(prefix).kv(NODE), cb=seen.heard)
    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    feeds = {"r1": Feed("m", KvSource(endpoint, "kv", BS))}
    relay.sync(feeds)
    pub = Pub(endpoint)
    try:
        seq = 0

        async def through() -> bool:
            nonlocal seq
            pub.send(seq, stored((seq + 1,), None, 10 * seq))
            seq += 1
            return bool(seen.held().get("r1"))

        await eventually(through, timeout=10, what="a first block relayed")
        first = relay.readers["r1"]

        def broken(self: object, seq: int, batch: object) -> None:
            raise RuntimeError("a bug")

        # A bug in the translation (the one way to get there): never stale entries, never the agent's end.
        monkeypatch.setattr("llmgw_agent.kvtranslate.ReplicaBlocks.apply", broken)
        pub.send(seq, stored((99,), None, 990))
        await eventually(lambda: "r1" not in relay.readers, timeout=5, what="the reader ended")
        await eventually(lambda: seen.held().get("r1") == set(), timeout=5, what="the replica cleared")
        monkeypatch.undo()
        relay.sync(feeds)  # the agent's next tick
        assert relay.readers["r1"] is not first
        seq = 0

        async def again() -> bool:
            nonlocal seq
            pub.send(seq, stored((7,), None, 70))
            seq += 1
            return seen.held().get("r1") == set(block_keys(tuple(range(70, 70 + BS)), BS))

        await eventually(again, timeout=10, what="followed anew")
    finally:
        pub.close()


class Vllm:
    """An engine's two sockets as vLLM 0.32's ZmqEventPublisher has them: PUB for batches, ROUTER for
    replays ([id, "", start seq] in; each kept batch [id, "", topic, seq, payload] out, then the end
    marker [id, "", "", seq -1, ""])."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.kept: list[list[bytes]] = []
        self.asked: list[int] = []
        self.task = asyncio.create_task(self._serve())

    async def send(self, seq: int, *events: object) -> None:
        frames = encode_frames("kv", seq, EventBatch(1.0, tuple(events)))  # type: ignore[arg-type]
        self.kept.append(frames)
        await self.pub.send_multipart(frames)

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            for f in self.kept:
                if int.from_bytes(f[1], "big") >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", *f])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


async def test_a_restarted_agent_takes_up_its_saved_blocks_and_the_batches_it_missed(
    nc: NATS, prefix: str, tmp_path: Path
) -> None:
    subjects = Subjects(prefix)
    sock = tmp_path / "kv.sock"
    source = KvSource(f"ipc://{sock}", "kv", BS, f"ipc://{tmp_path / 'kv-replay.sock'}")
    feed = Feed("m", source, engine="4242:17.5")
    engine = Vllm(source.endpoint, str(source.replay))
    first = KvRelay(nc, subjects, NODE, "boot-1", tick_s=0.05, idle_s=0.5)
    second = KvRelay(nc, subjects, NODE, "boot-2", tick_s=0.05, idle_s=0.5)
    try:
        await first.start()
        first.sync({"r1": feed})
        # The first agent asks for a replay from 0: the engine has nothing yet.
        await eventually(lambda: engine.asked == [0], timeout=5, what="the first replay request")
        await engine.send(0, stored((1, 2), None, 0))
        await engine.send(1, stored((3,), 2, 2 * BS))
        k = block_keys(tuple(range(3 * BS)), BS)
        await eventually(lambda: first.readers["r1"].blocks.keys == set(k), timeout=5, what="followed live")
        await first.save()
        assert feed.state_path is not None and feed.state_path.exists()
        # The agent is killed (nothing runs its stop); the engine goes on meanwhile.
        await cancel_and_wait([*first.tasks, *(rd.task for rd in first.readers.values() if rd.task)])
        await engine.send(2, BlockRemoved((1, 2, 3)), stored((7,), None, 100))
        k7 = block_keys(tuple(range(100, 100 + BS)), BS)

        seen = KvTap()
        await nc.subscribe(subjects.kv(NODE), cb=seen.heard)
        await second.start()
        second.sync({"r1": feed})
        # Saved blocks taken up, batch 2 replayed: the set is the engine's, exactly.
        await eventually(lambda: second.readers["r1"].blocks.keys == set(k7), timeout=5, what="caught up")
        assert engine.asked == [0, 2] and second.counters.resumed == 1 and second.counters.replayed == 1
        assert second.counters.clears == 0
        await eventually(lambda: seen.held().get("r1") == set(k7), timeout=5, what="relayed")
        assert seen.entries("r1")[0] == (True, False)  # the saved set, to every receiver, whole

        # Another engine process under the same replica: nothing saved of the old one is taken up.
        other = KvRelay(nc, subjects, NODE, "boot-3", tick_s=0.05, idle_s=0.5)
        other.sync({"r1": Feed("m", source, engine="999:1.0")})
        assert other.counters.resumed == 0 and not other.readers["r1"].blocks.keys
        await other.stop()
    finally:
        await second.stop()
        await first.stop()
        await engine.close()
    assert not sock.with_name("kv.sock.state").exists()  # the replica gone: its saved blocks too


async def test_a_reader_that_fails_the_same_way_at_every_sync_says_so_once(
    relay: KvRelay, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A socket path longer than a Unix socket's: the reader fails at once, and the agent's sync (every
    # tick) makes a new one, which fails the same way.
    endpoint = f"ipc://{tmp_path / ('x' * 120) / 'kv.sock'}"
    feeds = {"r1": Feed("m", KvSource(endpoint, "kv", BS))}
    caplog.set_level("INFO", logger="llmgw.agent.kvrelay")
    for _ in range(4):
        relay.sync(feeds)
        await eventually(lambda: "r1" not in relay.readers, timeout=5, what="the reader failed")
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "r1" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert relay.counters.clears >= 4  # each failure still clears the replica: never stale entries
    # It leaves with no reader: gone to receivers all the same (no idle batches for it ever after).
    await eventually(lambda: "r1" in relay.batcher.held, timeout=5, what="the cleared replica sent")
    relay.sync({})
    await eventually(lambda: not relay.batcher.held, timeout=5, what="its gone sent")
