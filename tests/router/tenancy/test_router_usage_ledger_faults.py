"""The usage ledger (ledger.py) when things go wrong, on a real nats-server: a graceful stop with a
request in flight, a writer cancelled mid-flush, JetStream failing with the connection up, and an hour
whose key an operator deleted."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from llmgw_common.codec import encode
from llmgw_common.messages import UsageHour
from llmgw_common.subjects import Subjects
from llmgw_router.tenancy.ledger import Ledger
from llmgw_router.tenancy.usage import UsageTable
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.usage_ledger import HOUR, By, fold, ledger_key, read_hours
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory
from tests.router.tenancy.test_router_quota_bus import _setup
from tests.router.tenancy.test_router_usage_ledger import _billed

TICK = 0.2
NOW = 10 * HOUR + 30.0


@pytest.mark.slow
async def test_a_request_in_flight_at_a_graceful_stop_gets_its_usage_into_the_ledger(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1", ttft_ms=300, tokens_per_s=40)
    await _setup(nc, prefix, eng.url)
    key, rec = await create_key(nc, prefix, "team-a")
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    billed = [0, 0, 0]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        for i, stream in enumerate((False, True)):
            r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=TICK, router_id=f"g{i}")
            await asyncio.wait_for(r.synced.wait(), 10)
            answer = asyncio.create_task(_billed(s, r.port, stream, 8))
            await asyncio.sleep(0.15)  # in flight: the engine's first token is 0.3 s away
            assert not answer.done()
            await r.stop()
            status, p, c = await answer
            assert status == 200
            billed = [billed[0] + 1, billed[1] + p, billed[2] + c]
            rows = fold(await read_hours(kv), By.MODEL, key_id=rec.id)
            assert [(x.requests, x.prompt_tokens, x.completion_tokens) for x in rows] == [tuple(billed)]


class Gated:
    """The real bucket; a write waits for ``go`` (set: passes at once), ``entered`` once it is waiting."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv, self.go, self.entered = kv, asyncio.Event(), asyncio.Event()

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        self.entered.set()
        await self.go.wait()
        return await self.kv.update(key, value, last=last)

    async def get(self, key: str) -> KeyValue.Entry:
        return await self.kv.get(key)


class Unavailable:
    """JetStream answering 503 to every write while the connection stays up (a server cut off)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv, self.down = kv, True

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        if self.down:
            raise nats.js.errors.ServiceUnavailableError
        return await self.kv.update(key, value, last=last)

    async def get(self, key: str) -> KeyValue.Entry:
        return await self.kv.get(key)


def _ledger(kv: object, now: list[float], interval_s: float = 0.1) -> tuple[UsageTable, Ledger]:
    table = UsageTable(since=100.0, clock=lambda: now[0])
    return table, Ledger(table, kv, "w0", lambda: True, lambda: now[0], interval_s=interval_s)  # type: ignore[arg-type]


def _totals(hours: list[UsageHour]) -> list[tuple[str, int, int]]:
    rows = fold(hours, By.HOUR)
    return [(r.group, r.requests, r.total_tokens) for r in rows]


async def test_a_writer_cancelled_mid_flush_keeps_what_it_took(prefix: str, nc: NATS) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    gated = Gated(kv)
    table, ledger = _ledger(gated, [NOW])
    table.add("k1", "m1", (5, 7))
    flush = asyncio.create_task(ledger.flush())
    await asyncio.wait_for(gated.entered.wait(), 5)
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    assert table.dirty == {10 * HOUR}
    gated.go.set()
    assert await ledger.flush() is True
    assert _totals(await read_hours(kv)) == [("1970-01-01T10", 1, 12)]


@pytest.mark.slow
async def test_while_jetstream_fails_usage_is_kept_and_written_when_it_is_back(
    prefix: str, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    down = Unavailable(kv)
    table, ledger = _ledger(down, [NOW])
    writer = asyncio.create_task(ledger.run())
    caplog.set_level(logging.INFO, logger="llmgw_router.tenancy.ledger")
    try:
        table.add("k1", "m1", (5, 7))
        for _ in range(20):
            table.add("k1", "m1", (1, 1))
        await eventually(lambda: ledger.failing, timeout=5, what="the first write failing")
        await asyncio.sleep(1.2)  # the writer retries (every 0.5 s) and fails again: one warning
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "ServiceUnavailable" in warnings[0].getMessage()
        assert await read_hours(kv) == []
        down.down = False
        for _ in range(50):
            if not ledger.failing:
                break
            await asyncio.sleep(0.1)
        assert not ledger.failing
        assert any(r.levelno == logging.INFO and "succeed again" in r.getMessage() for r in caplog.records)
        assert _totals(await read_hours(kv)) == [("1970-01-01T10", 21, 52)]
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer


@pytest.mark.slow
async def test_a_burst_is_written_at_most_once_per_interval_and_whole(prefix: str, nc: NATS) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    table, ledger = _ledger(kv, [NOW], interval_s=0.1)
    writer = asyncio.create_task(ledger.run())
    loop = asyncio.get_running_loop()
    try:
        began = loop.time()
        for _ in range(200):
            table.add("k1", "m1", (1, 1))
            await asyncio.sleep(0.005)
        spent = loop.time() - began
        await eventually(lambda: ledger.written == table.version, timeout=5, what="the burst written")
        # Paced: one write, then at most one per interval (not one per answer, nor per round trip).
        assert ledger.writes <= spent / 0.1 + 2, (ledger.writes, spent)
        assert _totals(await read_hours(kv)) == [("1970-01-01T10", 200, 400)]
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer


async def test_nothing_is_tried_while_the_bus_is_away_and_all_is_written_after(prefix: str, nc: NATS) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    up = [False]
    table = UsageTable(since=100.0, clock=lambda: NOW)
    ledger = Ledger(table, kv, "w0", lambda: up[0], lambda: NOW, interval_s=0.05)
    writer = asyncio.create_task(ledger.run())
    try:
        table.add("k1", "m1", (1, 1))
        await asyncio.sleep(0.3)
        assert ledger.writes == 0 and table.dirty == {10 * HOUR}
        up[0] = True
        await eventually(lambda: ledger.writes > 0, timeout=5, what="the write once the bus is back")
        assert _totals(await read_hours(kv)) == [("1970-01-01T10", 1, 2)]
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer


async def test_an_hour_that_cannot_be_written_holds_no_other_and_a_deleted_key_is_written_again(
    prefix: str, nc: NATS
) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    now = [NOW]
    table, ledger = _ledger(kv, now)
    # Hour 10's key holds another writer's value (a conflict: never ours to write over).
    held = UsageHour(router="x0", since=5.0, hour=10 * HOUR, written_at=NOW, usage={"k9": {"m1": (1, 1, 1)}})
    await kv.put(ledger_key(10 * HOUR, "w0", 100.0), encode(held))
    table.add("k1", "m1", (5, 7))
    now[0] = NOW + HOUR
    table.add("k1", "m1", (2, 2))
    assert await ledger.flush() is False
    assert table.dirty == {10 * HOUR}
    assert _totals(await read_hours(kv)) == [("1970-01-01T11", 1, 4), ("1970-01-01T10", 1, 2)]  # k1, then k9
    # An operator deletes hour 10's key, and purges hour 11's: both are written again, whole.
    await kv.delete(ledger_key(10 * HOUR, "w0", 100.0))
    await kv.purge(ledger_key(11 * HOUR, "w0", 100.0))
    table.add("k1", "m1", (1, 0))
    assert await ledger.flush() is True
    assert _totals(await read_hours(kv)) == [("1970-01-01T10", 1, 12), ("1970-01-01T11", 2, 5)]


@pytest.mark.slow
async def test_a_stream_whose_client_left_is_in_the_ledger_with_the_tokens_it_was_sent(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1", ttft_ms=5, tokens_per_s=40)
    await _setup(nc, prefix, eng.url)
    key, rec = await create_key(nc, prefix, "leaves")
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=TICK, router_id="l0")
    await asyncio.wait_for(r.synced.wait(), 10)
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "x " * 4}],
        "max_tokens": 200,
        "stream": True,
    }
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data: {")
                if seen == 5:
                    break
            resp.close()  # gone: the engine's 200 tokens take 5 s, the client read 5 of them

    async def written() -> tuple[int, int] | None:
        rows = fold(await read_hours(kv), By.MODEL, key_id=rec.id)
        return (rows[0].requests, rows[0].completion_tokens) if rows else None

    requests, completion = await eventually(written, timeout=10.0, what="the left stream in the ledger")
    assert requests == 1
    assert 5 <= completion < 200


class Counted:
    """The real bucket; each get 50 ms late, counting how many are in flight at once."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv, self.now, self.most = kv, 0, 0

    def __getattr__(self, name: str) -> object:  # the listing (bus.kv_keys) reads the bucket's stream
        return getattr(self.kv, name)

    async def get(self, key: str) -> KeyValue.Entry:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(0.05)
            return await self.kv.get(key)
        finally:
            self.now -= 1


async def test_a_starting_router_reads_its_months_hours_at_once_and_no_older_ones(
    prefix: str, nc: NATS
) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    for h in range(30):  # hours 0..29; the read is from hour 10 on
        u = UsageHour(
            router="r0", since=1.0, hour=h * HOUR, written_at=h * HOUR, usage={"k1": {"m1": (1, h, 0)}}
        )
        await kv.put(ledger_key(h * HOUR, "r0", 1.0), encode(u))
    await kv.put(ledger_key(12 * HOUR, "r1", 1.0), b"not a ledger value")
    counted = Counted(kv)
    got = await read_hours(counted, 10 * HOUR + 5.0)  # type: ignore[arg-type]
    assert [h.hour for h in got] == [h * HOUR for h in range(10, 30)]
    assert counted.most > 1  # concurrent, not one by one
