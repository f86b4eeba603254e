from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import encode
from llmgw_common.messages import Heartbeat
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.settings import BusSettings
from tests.kit.cancels import swallows_one_cancel
from tests.kit.poll import eventually


async def test_ensure_all_is_idempotent_and_binds(nats_server: NatsServer, prefix: str) -> None:
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        js = nc.jetstream()
        subj = Subjects(prefix)
        b1 = await bus.ensure_all(js, subj)
        b2 = await bus.ensure_all(js, subj)
        assert (
            set(b1)
            == set(b2)
            == {
                f"{prefix}_assign",
                f"{prefix}_routing",
                f"{prefix}_desired",
                f"{prefix}_replicas",
                f"{prefix}_keys",
                f"{prefix}_leader",
                f"{prefix}_usage",
            }
        )
        info = await js.stream_info(subj.events_stream)
        assert info.config.subjects == [subj.all_events()]
    finally:
        await nc.close()


async def test_typed_subscribe_drops_garbage_with_one_line(
    nats_server: NatsServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    got: list[Heartbeat] = []
    drops = bus.DropLog(logging.getLogger("test"))
    subj = Subjects(prefix)
    try:
        await bus.subscribe(nc, subj.all_nodes("heartbeat"), Heartbeat, lambda m, _: got.append(m), drops)
        with caplog.at_level(logging.WARNING, logger="test"):
            await nc.publish(subj.heartbeat("n1"), b"\xc1garbage")
            await nc.publish(
                subj.heartbeat("n1"), encode(Heartbeat(node="n1", boot_id="b", seq=1, sent_at=1.0))
            )
            await bus.flush(nc)
            await eventually(lambda: got, timeout=5, every=0.01, what="the good heartbeat after the garbage")
        assert [h.node for h in got] == ["n1"]
        assert drops.count == 1
        assert len([r for r in caplog.records if "dropped undecodable" in r.message]) == 1
    finally:
        await nc.close()


async def test_kv_follower_sees_puts_and_deletes(nats_server: NatsServer, prefix: str) -> None:
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_f")
        await kv.put("a", b"1")
        seen: dict[str, bytes | None] = {}
        f = KvFollower(kv, lambda k, v, r: seen.__setitem__(k, v), resync_s=0.2)
        await f.start()
        assert seen == {"a": b"1"}
        await kv.put("b", b"2")
        await kv.delete("a")
        await eventually(
            lambda: seen.get("b") == b"2" and seen.get("a", b"") is None,
            timeout=5,
            every=0.01,
            what="the follower to see b put and a deleted",
        )
        await f.stop()
        assert seen == {"a": None, "b": b"2"}
    finally:
        await nc.close()


@pytest.mark.slow
async def test_connect_without_wait_fails_fast_when_no_server() -> None:
    s = BusSettings(nats_urls=["nats://127.0.0.1:1"])
    with pytest.raises((OSError, nats.errors.Error)):
        await bus.connect(s, "t", connect_timeout=0.5, wait=False)


async def test_single_key_follower_sees_a_delete_on_resync(nats_server: NatsServer, prefix: str) -> None:
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_g")
        await kv.put("n1", b"1")
        seen: list[tuple[str, bytes | None]] = []
        f = KvFollower(kv, lambda k, v, r: seen.append((k, v)), key="n1", resync_s=3600)
        await f.start()
        await f.stop()  # no watcher: only resync() can see the delete
        await kv.delete("n1")
        await f.resync()
        assert seen == [("n1", b"1"), ("n1", None)]
        assert await bus.kv_get(kv, "n1", Heartbeat) == (None, 0)
    finally:
        await nc.close()


def test_nats_server_restarts_on_the_same_port(tmp_path: Path) -> None:
    srv = NatsServer(tmp_path)
    srv.start()
    try:
        url = srv.url
        srv.stop()
        srv.start()
        assert srv.url == url and srv.proc is not None and srv.proc.poll() is None
    finally:
        srv.stop()


async def test_kv_follower_retries_a_value_whose_callback_raised_and_keeps_watching(
    nats_server: NatsServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A raising callback neither ends the watch nor loses the value: it is delivered again."""
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_r")
        calls: list[tuple[str, bytes | None]] = []
        taken: list[bytes | None] = []

        def on_change(k: str, v: bytes | None, r: int) -> None:
            calls.append((k, v))
            if len(calls) == 1:
                raise ValueError("cannot take it now")
            taken.append(v)

        # A resync an hour away: only the retry can deliver the value again, only the watch the update.
        f = KvFollower(kv, on_change, resync_s=3600, retry_s=0.1, name="flaky")
        await f.start()
        await kv.put("a", b"1")
        await eventually(lambda: taken, timeout=5, every=0.01, what="the retry to deliver the refused value")
        assert taken == [b"1"]
        assert calls == [("a", b"1"), ("a", b"1")]
        assert f.errors == 1
        assert f.revisions["a"] > 0
        assert any("flaky" in r.message and "cannot take it now" in str(r.exc_info) for r in caplog.records)
        await kv.put("a", b"2")
        await eventually(
            lambda: len(taken) == 2, timeout=5, every=0.01, what="the watch to deliver the update"
        )
        await f.stop()
        assert taken == [b"1", b"2"]
        assert f.errors == 1
    finally:
        await nc.close()


async def test_kv_follower_retries_a_delete_whose_callback_raised(
    nats_server: NatsServer, prefix: str
) -> None:
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_d")
        await kv.put("n1", b"1")
        seen: list[tuple[str, bytes | None]] = []
        fail = [True]

        def on_change(k: str, v: bytes | None, r: int) -> None:
            if v is None and fail[0]:
                fail[0] = False
                raise RuntimeError("busy")
            seen.append((k, v))

        f = KvFollower(kv, on_change, key="n1", resync_s=3600)
        await f.start()
        await f.stop()  # resync() by hand: the delete is seen twice, the first time refused
        await kv.delete("n1")
        await f.resync()
        assert seen == [("n1", b"1")] and f.errors == 1 and "n1" in f.revisions
        await f.resync()
        assert seen == [("n1", b"1"), ("n1", None)] and "n1" not in f.revisions
    finally:
        await nc.close()


@pytest.mark.slow
async def test_stop_ends_a_loop_that_swallowed_a_cancel(nats_server: NatsServer, prefix: str) -> None:
    """Python 3.11's asyncio.wait_for, inside nats-py's request and so inside resync()'s kv.get, returns
    the answer and drops a cancel that lands as the answer arrives (CPython gh-86296): the resync loop
    goes on, and a stop() that cancels once waits for ever (a router's stop hung so in a test)."""
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_s")
        f = KvFollower(kv, lambda k, v, r: None, resync_s=3600)
        await f.start()

        stubborn = asyncio.create_task(swallows_one_cancel())
        f._tasks.append(stubborn)
        await asyncio.sleep(0)
        stopping = asyncio.create_task(f.stop())
        # Not wait_for: it would cancel stop(), whose own suppress would swallow that cancel too.
        done, _ = await asyncio.wait({stopping}, timeout=5)
        stubborn.cancel()  # (only needed when the assertion below fails)
        assert stopping in done and stubborn.done()
    finally:
        await nc.close()


async def test_kv_keys_lists_from_the_streams_info_every_page_and_no_consumer(
    nats_server: NatsServer, prefix: str
) -> None:
    """bus.kv_keys lists a bucket from its stream's info, not with nats-py's consumer scan, whose end
    marker can come before the values (nats.py #842: a listing of none of 31 keys was seen). No consumer is
    created, and a bucket with more keys than one answer holds (100,000) is listed whole."""
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_many")
        n = 100_050
        for i in range(n):  # core publishes into the bucket's stream: a second, not 100,050 acks
            await nc.publish(f"$KV.{prefix}_many.k{i}", b"v")
        await bus.flush(nc)
        await eventually(
            lambda: _messages(nc, f"KV_{prefix}_many", n),
            timeout=20.0,
            what="the bucket's 100,050 keys stored",
        )
        await kv.delete("k7")
        seen: list[str] = []

        async def note(m: Msg) -> None:
            seen.append(m.subject)

        spy = await nc.subscribe("$JS.API.>", cb=note)
        keys = await bus.kv_keys(kv)
        await bus.flush(nc)
        await spy.unsubscribe()
        assert len(keys) == len(set(keys)) == n
        assert set(keys) == {f"k{i}" for i in range(n)}  # k7 too: a deleted key's marker is a message
        assert seen == [f"$JS.API.STREAM.INFO.KV_{prefix}_many"] * 2, seen  # two pages, no consumer
        assert await bus.kv_keys(await bus.ensure_kv(nc.jetstream(), f"{prefix}_none")) == []
    finally:
        await nc.close()


async def _messages(nc: NATS, stream: str, n: int) -> bool:
    stored: int = (await nc.jetstream().stream_info(stream)).state.messages
    return stored >= n


async def test_leader_reads_go_to_the_stream_leader_and_read_what_was_written(
    nats_server: NatsServer, prefix: str
) -> None:
    """A control plane's reads (bus.leader_reads): every get a STREAM.MSG.GET, which only the stream's
    leader answers, never a DIRECT.GET (any replica answers those, a lagging one too: after a heal a
    takeover loaded a record deleted before it); keys from the leader's stream info."""
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    seen: list[str] = []
    try:
        plain = await bus.ensure_kv(nc.jetstream(), f"{prefix}_lr")
        await plain.put("a", b"1")
        await plain.put("b", b"2")
        await plain.put("b", b"3")
        await plain.put("gone", b"x")
        await plain.delete("gone")

        async def note(m: Msg) -> None:
            seen.append(m.subject)

        spy = await nc.subscribe("$JS.API.>", cb=note)
        kv = bus.leader_reads(plain)
        assert sorted(await kv.keys()) == ["a", "b", "gone"]  # a deleted key is listed...
        assert sorted(await bus.kv_keys(plain)) == ["a", "b", "gone"]
        assert (await kv.get("b")).value == b"3"
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("gone")  # ...and read as absent
        await bus.flush(nc)
        await spy.unsubscribe()
        gets = [x for x in seen if ".GET." in x]
        assert gets and all(".STREAM.MSG.GET." in x for x in gets), seen
        # Writes are those of the bucket.
        await kv.put("c", b"4")
        assert (await plain.get("c")).value == b"4"
        empty = bus.leader_reads(await bus.ensure_kv(nc.jetstream(), f"{prefix}_lr_empty"))
        assert await bus.kv_keys(empty) == []
    finally:
        await nc.close()


async def test_a_forgotten_key_leaves_no_marker_for_a_leaders_keys(
    nats_server: NatsServer, prefix: str
) -> None:
    """bus.forget_key: a deleted key stays listed by LeaderReads (its marker is a message), a forgotten
    one is gone from the stream, so a takeover that lists the replica records reads no key twice and
    none for ever."""
    s = BusSettings(nats_urls=[nats_server.url], prefix=prefix)
    nc = await bus.connect(s, "t", wait=False)
    try:
        plain = await bus.ensure_kv(nc.jetstream(), f"{prefix}_fk")
        kv = bus.leader_reads(plain)
        for k in ("kept", "deleted", "forgotten"):
            await plain.put(k, b"v1")
            await plain.put(k, b"v2")
        await plain.delete("deleted")
        await bus.forget_key(kv, "forgotten")
        assert sorted(await kv.keys()) == ["deleted", "kept"]
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("forgotten")
        info = await nc.jetstream().stream_info(f"KV_{prefix}_fk")
        assert info.state.messages == 2, info.state  # kept's v2 and deleted's marker (history 1)
        # The key may be written again, as a new replica id never is but a test's could be.
        await plain.put("forgotten", b"v3")
        assert (await kv.get("forgotten")).value == b"v3"
    finally:
        await nc.close()
