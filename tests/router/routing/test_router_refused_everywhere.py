"""Every replica the routing table names refuses the connection: the table is likely stale.

A warm `docker compose up` (issue 25): routers read the previous run's table the moment they start,
before any control plane has rewritten it, and its engines are not listening yet; the router answered
502 three times before its first 200. Nothing was sent to an engine, so the router waits for the next
table (``refused_wait_s``) and goes again; a model on its way is then held like any other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_router.service import Router
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_sim.options import SimOptions
from tests.kit.ports import free_port
from tests.router.router_helpers import (
    EngineProcs,
    RouterFactory,
    StaticFile,
    start_engine_process,
    stop_engine_processes,
)
from tests.router.test_router_bus import _publish_routing

pytestmark = pytest.mark.slow


@pytest.fixture
def sim() -> Iterator[EngineProcs]:
    procs = [start_engine_process("m1", SimOptions(port=0, model="m1", ttft_ms=5, tokens_per_s=500))]
    try:
        yield procs
    finally:
        stop_engine_processes(procs)


def _stale(port: int) -> dict[str, list[Endpoint]]:
    """A table naming one replica whose engine is not listening (a previous run's)."""
    return {"m1": [Endpoint(replica_id="old", model="m1", url=f"http://127.0.0.1:{port}", node="n1")]}


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _router(routers: RouterFactory, nats_server: NatsServer, prefix: str, **kw: float) -> Router:
    r = await routers(nats_urls=[nats_server.url], prefix=prefix, auth=False, **kw)
    await asyncio.wait_for(r.synced.wait(), 10)
    return r


async def test_a_request_that_every_replica_refused_is_served_by_the_next_table(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, sim: EngineProcs
) -> None:
    await _publish_routing(nc, prefix, _stale(free_port()))
    r = await _router(routers, nats_server, prefix)
    assert r.ctx.limits.refused_wait_s == 10.0

    async def new_table() -> None:
        await asyncio.sleep(1.0)
        fresh = [Endpoint(replica_id="new", model="m1", url=sim[0][1], node="n1")]
        await _publish_routing(nc, prefix, {"m1": fresh}, version=2)

    task = asyncio.create_task(new_table())
    async with httpx.AsyncClient(timeout=30) as c:
        resp = await c.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=CHAT)
    await task
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]
    # Counted once, as the answer it got.
    assert r.ctx.metrics.requests_count("m1", 200) == 1
    assert r.ctx.metrics.requests_count("m1", 502) == 0


async def test_no_next_table_within_refused_wait_s_is_the_502_saying_what_refused(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory
) -> None:
    await _publish_routing(nc, prefix, _stale(free_port()))
    r = await _router(routers, nats_server, prefix, refused_wait_s=0.5)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        resp = await c.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=CHAT)
    took = time.monotonic() - t0
    assert resp.status_code == 502
    assert "old:" in resp.json()["error"]["message"] and "failed before an answer" in resp.text
    assert took >= 0.5
    assert r.ctx.metrics.requests_count("m1", 502) == 1


async def test_a_static_router_answers_502_at_once(routers: RouterFactory, static_file: StaticFile) -> None:
    # No table will ever follow a static one: nothing to wait for.
    r = await routers(static_file({"m1": [f"http://127.0.0.1:{free_port()}"]}, auth=False))
    assert r.ctx.limits.refused_wait_s == 0.0
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        resp = await c.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=CHAT)
    assert resp.status_code == 502
    assert time.monotonic() - t0 < 5.0


async def test_a_model_coming_in_the_next_table_is_held_until_its_replica_is_ready(
    nats_server: NatsServer, prefix: str, nc: NATS, routers: RouterFactory, sim: EngineProcs
) -> None:
    # The next table says a replica is on its way (none ready yet): the request, refused everywhere in
    # the stale one, is held like any other until the replica is there, then answered (and counted) once.
    await _publish_routing(nc, prefix, _stale(free_port()))
    r = await _router(routers, nats_server, prefix)
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_routing)

    async def tables() -> None:
        await asyncio.sleep(0.5)
        coming = RoutingEndpoints(version=2, coming={"m1": "replica new starting"})
        await kv.put("endpoints", encode(coming))
        await asyncio.sleep(1.0)
        fresh = [Endpoint(replica_id="new", model="m1", url=sim[0][1], node="n1")]
        await _publish_routing(nc, prefix, {"m1": fresh}, version=3)

    task = asyncio.create_task(tables())
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        resp = await c.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=CHAT)
    await task
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - t0 >= 1.4  # it waited for the replica, not only for the table
    assert r.ctx.metrics.requests_count("m1", 200) == 1
    assert r.ctx.metrics.requests_count("m1", 502) == 0 and r.ctx.metrics.requests_count("m1", 503) == 0
