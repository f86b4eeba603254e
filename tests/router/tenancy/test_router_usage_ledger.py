"""Usage that lasts (usage_ledger, ledger.py) through real routers on a real nats-server: written behind
the answers (none waits for it), equal to what clients were billed, and a day budget spent before a
router restart still spent after it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from llmgw_common.messages import KeyLimits
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.usage_ledger import By, fold, read_hours
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory
from tests.router.tenancy.test_router_quota_bus import _setup

TICK = 0.2


class HeldKV:
    """The real bucket, whose writes wait until ``go`` is set: an answer that waited for its write
    would never reach the client while it is clear."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self.go = asyncio.Event()

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        await self.go.wait()
        return await self.kv.update(key, value, last=last)

    async def get(self, key: str) -> KeyValue.Entry:
        return await self.kv.get(key)


def _body(stream: bool, n: int) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "x " * n}], "max_tokens": n}
    if stream:
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    return b


async def _billed(s: aiohttp.ClientSession, port: int, stream: bool, n: int) -> tuple[int, int, int]:
    """(status, prompt, completion) as the client was told them."""
    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=_body(stream, n)) as r:
        if r.status != 200:
            await r.read()
            return r.status, 0, 0
        if not stream:
            u = (await r.json())["usage"]
            return 200, u["prompt_tokens"], u["completion_tokens"]
        usage = None
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        assert usage is not None
        return 200, usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.slow
async def test_answers_never_wait_for_the_ledger_and_what_it_holds_sums_exactly(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1")
    await _setup(nc, prefix, eng.url)
    key, rec = await create_key(nc, prefix, "team-a")
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=TICK, router_id="u0")
    await asyncio.wait_for(r.synced.wait(), 10)
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    assert r.ledger is not None
    held = HeldKV(kv)
    r.ledger.kv = held  # type: ignore[assignment]
    billed = [0, 0, 0]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        for i, stream in enumerate([False, True, False, True, True, False]):
            # Every answer whole while no write can finish: none waits for the ledger.
            status, p, c = await asyncio.wait_for(_billed(s, r.port, stream, 2 + i), 10)
            assert status == 200
            billed = [billed[0] + 1, billed[1] + p, billed[2] + c]
        assert await read_hours(kv) == []
        held.go.set()

        async def written() -> bool:
            rows = fold(await read_hours(kv), By.MODEL, key_id=rec.id)
            return [(x.requests, x.prompt_tokens, x.completion_tokens) for x in rows] == [tuple(billed)]

        await eventually(written, timeout=10, what="the held answers' usage written, exactly")
        # Concurrent answers share writes (paced): fewer writes than requests.
        writes = r.ledger.writes
        got = await asyncio.gather(*(_billed(s, r.port, i % 2 == 0, 3) for i in range(40)))
    assert all(g[0] == 200 for g in got)
    want = (billed[0] + 40, billed[1] + sum(g[1] for g in got), billed[2] + sum(g[2] for g in got))

    async def all_written() -> bool:
        t = fold(await read_hours(kv), By.MODEL, key_id=rec.id)[0]
        return (t.requests, t.prompt_tokens, t.completion_tokens) == want

    # Written within the write interval (0.1 s) plus a write or two, exactly.
    await eventually(all_written, timeout=10, what="every answer's usage written, exactly")
    assert r.ledger.writes - writes < 40


@pytest.mark.slow
async def test_a_day_budget_spent_before_a_restart_stays_spent(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1")
    await _setup(nc, prefix, eng.url)
    key, _ = await create_key(nc, prefix, "capped", limits=KeyLimits(daily_tokens=60))
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=TICK, router_id="b0")
    await asyncio.wait_for(r.synced.wait(), 10)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        statuses = [(await _billed(s, r.port, False, 8))[0] for _ in range(12)]
        assert 200 in statuses and statuses[-1] == 429, statuses
        await r.stop()
        # The same router id, a new incarnation: it reads the month's ledger at start.
        again = await routers(nats_urls=[nats_server.url], prefix=prefix, tick_s=TICK, router_id="b0")
        await asyncio.wait_for(again.synced.wait(), 10)
        async with s.post(f"http://127.0.0.1:{again.port}/v1/chat/completions", json=_body(False, 8)) as resp:
            body = await resp.json()
        assert resp.status == 429, body
        assert body["error"]["code"] == "insufficient_quota"
        assert "has used its daily budget of 60 tokens" in body["error"]["message"]


class FailingOnce:
    """The real bucket; its first write times out (JetStream away) without reaching it."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv, self.failed = kv, False

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        if not self.failed:
            self.failed = True
            raise TimeoutError
        return await self.kv.update(key, value, last=last)

    async def get(self, key: str) -> KeyValue.Entry:
        return await self.kv.get(key)


async def test_a_failed_write_is_kept_and_written_later_with_no_request_after_it(
    prefix: str, nc: NATS
) -> None:
    from llmgw_router.tenancy.ledger import Ledger
    from llmgw_router.tenancy.usage import UsageTable

    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    table = UsageTable(since=100.0, clock=lambda: 7200.5)
    ledger = Ledger(table, FailingOnce(kv), "w0", lambda: True, lambda: 7200.5)  # type: ignore[arg-type]
    table.add("k1", "m1", (5, 7))
    assert await ledger.flush() is False
    assert await read_hours(kv) == []
    assert await ledger.flush() is True  # the hour stayed marked: nothing new was needed to write it
    rows = fold(await read_hours(kv), By.HOUR)
    assert [(r.key_id, r.group, r.requests, r.total_tokens) for r in rows] == [("k1", "1970-01-01T02", 1, 12)]
