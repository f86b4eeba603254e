"""What the durable usage ledger's group commit costs a request (issue 20): one in-process router on a
real nats-server in front of a zero-delay sim engine, the same key's requests with the ledger attached
and detached in alternating rounds.

    .venv/bin/python bench/usage_ledger_cost.py

Prints the sequential latency p50/p90/p99 each way (a lone request waits one KV write), then the rate
of 2,000 requests sent at once each way and how many ledger writes they took (the group commit).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import nats
from nats.aio.client import Client as NATS

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_router.service import Router
from llmgw_router.settings import RouterSettings
from llmgw_router.tenancy.ledger import Ledger
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key
from llmgw_runtime.natsserver import NatsServer
from llmgw_sim import serving as sim_engine
from llmgw_sim.options import SimOptions

BODY = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


async def publish_routing(nc: NATS, url: str) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects("cost").bucket_routing)
    cat = Catalog(models=(ModelProfile(name="m1", engine="sim"),))
    await kv.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))
    eps = {"m1": (Endpoint(replica_id="r1", model="m1", url=url, node="n1"),)}
    await kv.put("endpoints", encode(RoutingEndpoints(version=1, endpoints=eps)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def main() -> None:
    srv = NatsServer(Path(tempfile.mkdtemp()))
    srv.start()
    eng = await sim_engine.start(SimOptions(port=0, model="m1", zero=True))
    nc = await nats.connect(srv.url)
    await publish_routing(nc, eng.url)
    key, _ = await create_key(nc, "cost", "k")
    r = Router(RouterSettings(port=0, nats_urls=[srv.url], prefix="cost", router_id="c0"))
    await r.start()
    await asyncio.wait_for(r.synced.wait(), 10)
    ledger = r.ctx.usage.ledger
    assert isinstance(ledger, Ledger)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:

            async def one() -> float:
                t = time.perf_counter()
                async with s.post(url, json=BODY) as resp:
                    await resp.read()
                return time.perf_counter() - t

            for _ in range(100):
                await one()
            lat: dict[str, list[float]] = {"with ledger": [], "without": []}
            for _ in range(6):
                for mode, xs in lat.items():
                    r.ctx.usage.ledger = ledger if mode == "with ledger" else None
                    xs += [await one() for _ in range(300)]
            for mode, xs in lat.items():
                print(
                    f"{mode:12} sequential p50 {pct(xs, 0.5):.2f} ms, p90 {pct(xs, 0.9):.2f}, p99 {pct(xs, 0.99):.2f}"
                )
            for mode in ("with ledger", "without", "with ledger", "without"):
                r.ctx.usage.ledger = ledger if mode == "with ledger" else None
                w0, t0 = ledger.writes, time.perf_counter()
                await asyncio.gather(*(one() for _ in range(2000)))
                rate = 2000 / (time.perf_counter() - t0)
                print(f"{mode:12} 2,000 at once: {rate:,.0f} requests/s, {ledger.writes - w0} ledger writes")
    finally:
        r.ctx.usage.ledger = ledger
        await r.stop()
        await nc.close()
        await eng.runner.cleanup()
        srv.stop()


if __name__ == "__main__":
    asyncio.run(main())
