"""A router whose keys bucket holds a key no client can read (a raw publish on ``$KV.<bucket>.<key>``)
starts, follows the bus and runs: before, the followers' first full read failed on it, the bus task
died and the router's run ended (exit 70) on every start while the key stood.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.router.router_helpers import EngineFactory, RouterFactory


@pytest.mark.slow
async def test_a_router_starts_and_serves_with_a_forged_key_in_its_keys_bucket(
    nats_server: NatsServer, prefix: str, engines: EngineFactory, routers: RouterFactory
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_keys)
        await nc.publish(f"$KV.{Subjects(prefix).bucket_keys}.bad+key", b"forged")
        await bus.flush(nc)
        assert await kv.keys() == ["bad+key"]
    finally:
        await nc.close()
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, auth=False, tick_s=0.1)
    await asyncio.wait_for(r.synced.wait(), 10)
    stop = asyncio.Event()
    run = asyncio.create_task(r.run(stop))
    await asyncio.sleep(0.5)
    assert not run.done(), run
    stop.set()
    await asyncio.wait_for(run, 5)
