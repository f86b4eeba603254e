"""A router keeps serving from memory through a NATS outage, and its run does not end because of it.

The router's run ends (TaskDied, exit 70) when one of its loops ends; a loop that ended on an error
an outage brings (a timeout, no responders, a closed watch) would turn every NATS restart into a
router restart, dropping every client connection. The server is killed and started again on its port.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import nats
import pytest

from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, RouterFactory

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


async def _status(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=CHAT) as resp:
            await resp.read()
            return resp.status


async def _put_endpoints(url: str, prefix: str, eps: list[Endpoint], version: int) -> None:
    nc = await nats.connect(url)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing)
        await kv.put("endpoints", encode(RoutingEndpoints(version=version, endpoints={"m1": tuple(eps)})))
    finally:
        await nc.close()


@pytest.mark.slow
async def test_the_router_runs_and_serves_through_a_nats_outage(
    tmp_path: Path, engines: EngineFactory, routers: RouterFactory
) -> None:
    from tests.router.test_router_bus import _publish_routing  # the routing values the router reads

    eng, eng2 = await engines("m1"), await engines("m1")
    srv = NatsServer(tmp_path / "nats")
    srv.start()
    prefix = "outage"
    try:
        nc = await nats.connect(srv.url)
        await _publish_routing(
            nc, prefix, {"m1": [Endpoint(replica_id="r1", model="m1", url=eng.url, node="n")]}
        )
        await nc.close()
        r = await routers(nats_urls=[srv.url], prefix=prefix, auth=False, tick_s=0.1)
        await asyncio.wait_for(r.synced.wait(), 10)
        stop = asyncio.Event()
        run = asyncio.create_task(r.run(stop))
        url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
        assert await _status(url) == 200
        for _outage in range(2):
            srv.kill()
            # Down for several of the followers' re-reads (every 2 s) and the client's reconnects.
            for _ in range(40):
                assert await _status(url) == 200
                await asyncio.sleep(0.1)
            assert not run.done(), run
            srv.start()
            await asyncio.sleep(0.5)
            assert not run.done(), run
        # Back: the router follows the bus again (a change made now reaches it).
        await _put_endpoints(
            srv.url, prefix, [Endpoint(replica_id="r2", model="m1", url=eng2.url, node="n")], version=2
        )
        await eventually(
            lambda: [e.replica_id for e in r.ctx.pool.by_model.get("m1", ())] == ["r2"],
            timeout=10.0,
            what="the router to follow the endpoint change made after the outage",
        )
        assert not run.done(), run
        stop.set()
        await asyncio.wait_for(run, 5)
    finally:
        srv.stop()
