"""A key's limits held across three real routers on a real nats-server: each admits from its share,
the shares move through the usage reports, a limit raised with `update_key` holds everywhere within a
tick, and a router that stops leaves what it admitted counted."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, KeyLimits, RoutingCatalog, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_router.service import Router
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key, update_key
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
TICK = 0.2


class ShiftedClock:
    """Real time moved so that a UTC minute began a moment ago: the test never straddles one."""

    def __init__(self) -> None:
        now = time.time()
        self.offset = (math.floor(now / 60) + 1) * 60 + 0.5 - now

    def __call__(self) -> float:
        return time.time() + self.offset


async def _setup(nc: NATS, prefix: str, url: str) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing)
    cat = Catalog(models=(ModelProfile(name="m1", engine="sim"),))
    await kv.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))
    eps = {"m1": (Endpoint(replica_id="r1", model="m1", url=url, node="n1"),)}
    await kv.put("endpoints", encode(RoutingEndpoints(version=1, endpoints=eps)))


async def _routers(routers: RouterFactory, url: str, prefix: str, n: int) -> list[Router]:
    clock = ShiftedClock()
    out = []
    for i in range(n):
        r = await routers(nats_urls=[url], prefix=prefix, tick_s=TICK, router_id=f"q{i}")
        r.ctx.clock = clock
        out.append(r)
    for r in out:
        await asyncio.wait_for(r.synced.wait(), 10)
    # Every router has heard the others (their reports go out every tick, limited keys or not).
    await eventually(
        lambda: all(len(r.ctx.quota._seen) == n - 1 for r in out), timeout=5.0, what="routers to hear peers"
    )
    return out


async def _spray(routers: list[Router], key: str, total: int, seconds: float = 0.0) -> Counter[int]:
    """``total`` requests round-robin over the routers, 9 at a time, spread over ``seconds``."""
    got: Counter[int] = Counter()
    todo = iter(range(total))
    t0 = time.monotonic()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:

        async def worker() -> None:
            for i in todo:
                await asyncio.sleep(max(0.0, t0 + i * seconds / total - time.monotonic()))
                r = routers[i % len(routers)]
                async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=CHAT) as resp:
                    await resp.read()
                    got[resp.status] += 1

        await asyncio.gather(*(worker() for _ in range(9)))
    return got


@pytest.mark.slow
async def test_three_routers_hold_a_key_near_its_limit_and_a_raise_holds_within_a_tick(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1")
    await _setup(nc, prefix, eng.url)
    key, rec = await create_key(nc, prefix, "batch", limits=KeyLimits(rpm=60))
    free, _ = await create_key(nc, prefix, "free")
    rs = await _routers(routers, nats_server.url, prefix, 3)
    got = await _spray(rs, key, 180, seconds=3.0)  # 60x the limit's rate, over 15 ticks
    # Each router alone would have admitted 60 (180 in all); shared, the cluster admits the limit
    # within the README's bound, and refuses the rest with 429 only (never 503).
    assert set(got) <= {200, 429}, got
    assert 57 <= got[200] <= 63, got
    assert sum(r.ctx.quota.meters[f"k:{rec.id}"].requests for r in rs) == got[200]
    # A key without limits beside it is never refused.
    assert await _spray(rs, free, 60) == Counter({200: 60})
    # Raised to 120: every router holds the new limit within a tick or two, and the cluster admits
    # about 60 more this minute, not 120 more per router.
    await update_key(nc, prefix, "batch", limits=KeyLimits(rpm=120))
    # A watch event (as for revocation); 2 s on a loaded 2-core machine.
    await eventually(lambda: all(_rpm(r, rec.id) == 120 for r in rs), timeout=2.0, what="rpm=120 everywhere")
    await asyncio.sleep(3 * TICK)  # the shares recomputed from the new limit
    more = await _spray(rs, key, 120, seconds=3.0)
    assert set(more) <= {200, 429} and 57 <= more[200] <= 63, more


@pytest.mark.slow
async def test_a_router_that_stops_leaves_what_it_admitted_counted(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, routers: RouterFactory
) -> None:
    eng = await engines("m1")
    await _setup(nc, prefix, eng.url)
    key, _ = await create_key(nc, prefix, "batch", limits=KeyLimits(rpm=40))
    rs = await _routers(routers, nats_server.url, prefix, 3)
    first = await _spray([rs[0]], key, 10, seconds=1.0)
    assert first == Counter({200: 10})
    await asyncio.sleep(3 * TICK)  # its report of the 10 reaches the others
    await rs[0].stop()
    # Forgotten after 3 ticks as a router to share with, but its 10 stay taken from this minute's 40.
    await eventually(
        lambda: all(rs[0].settings.router_id not in r.ctx.quota._seen for r in rs[1:]),
        timeout=5.0,
        what="the stopped router to be forgotten",
    )
    rest = await _spray(rs[1:], key, 60, seconds=2.0)
    # 30 when every report is on time. A 0.2 s tick is often late on a loaded 2-core box, and a late
    # report lets a router's allowance grow by its part of what remained (the router README's bound):
    # 32 was seen once beside the rest of the suite. The regression this guards is the stopped
    # router's 10 forgotten, 40 admitted.
    assert set(rest) <= {200, 429} and 28 <= rest[200] <= 33, rest


def _rpm(r: Router, key_id: str) -> int | None:
    rec = r.ctx.keys.by_id(key_id)
    return rec.limits.rpm if rec is not None and rec.limits is not None else None
